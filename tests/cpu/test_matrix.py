"""requirements/matrix.toml: the real file validates, and impossible cells are rejected with a reason."""

from __future__ import annotations

import copy

import pytest

from ci import matrix as mx
from ci.matrix import tomllib

REQUIRED = {  # (CUDA, torch major.minor) pairs the issue asks for, plus the lent GPU machine's exact stack
    ("none", "2.13"),
    ("12.1", "2.4"),
    ("12.6", "2.7"),
    ("12.8", "2.8"),
    ("12.8", "2.9"),
    ("13.0", "2.11"),
}


@pytest.fixture(autouse=True)
def _pytorchs_own_index(monkeypatch):
    """The URLs below are PyTorch's own: a mirror set around the test run (NSA_PYTORCH_INDEX) must not count."""
    monkeypatch.delenv("NSA_PYTORCH_INDEX", raising=False)



@pytest.fixture(scope="module")
def data() -> dict:
    with mx.DEFAULT_PATH.open("rb") as f:
        return tomllib.load(f)


def _with_cell(data: dict, cell_id: str, **changes) -> dict:
    d = copy.deepcopy(data)
    cell = next(c for c in d["cell"] if c["id"] == cell_id)
    cell.update(changes)
    return d


def _problems(d: dict) -> str:
    with pytest.raises(mx.MatrixError) as e:
        mx.parse(d)
    return str(e.value)


def test_real_matrix_is_valid_and_covers_the_required_cells():
    m = mx.load()
    have = {(c.cuda, c.torch_mm) for c in m.cells}
    assert REQUIRED <= have
    assert {"cu124-torch2.5-py311", "cu124-torch2.6-py311"} & {c.id for c in m.cells}


def test_cpu_cell_is_the_ci_machine():
    c = mx.load().get("cpu-torch2.13-py311")
    assert c.cpu_only and c.torch == "2.13.0+cpu" and c.python == "3.11" and c.triton == "3.7.1"
    assert len(c.torch_sha256) == 64 and c.flash_attn.source == "none"


def test_gpu_machine_cell_matches_the_lent_machine():
    c = mx.load().get("cu130-torch2.11-py312")
    assert (c.python, c.cuda, c.torch, c.triton) == ("3.12", "13.0", "2.11.0", "3.6.0")
    assert "numpy==2.5.2" in c.pins


def test_every_gpu_cell_uses_the_triton_torch_pins():
    m = mx.load()
    for c in m.cells:
        assert c.triton == m.upstream["torch"][c.torch_public]["triton"], c.id


def test_triton_not_pinned_by_torch_is_rejected(data):
    assert "triton must be '3.4.0'" in _problems(_with_cell(data, "cu128-torch2.8-py311", triton="3.5.0"))


def test_python_without_torch_wheel_is_rejected(data):
    d = _with_cell(data, "cu121-torch2.4-py311", python="3.13", id="cu121-torch2.4-py313")
    msg = _problems(d)
    assert "publishes no wheel for Python 3.13" in msg


def test_flash_wheel_upstream_does_not_publish_is_rejected(data):
    fa = {
        "version": "2.8.3",
        "source": "wheel",
        "sha256": "",
        "wheel": "flash_attn-2.8.3+cu12torch2.9cxx11abiTRUE-cp311-cp311-linux_x86_64.whl",
    }
    msg = _problems(_with_cell(data, "cu128-torch2.9-py311", flash_attn=fa))
    assert "publishes no wheel for torch 2.9" in msg


def test_flash_wheel_for_cuda13_is_rejected(data):
    fa = {
        "version": "2.8.3",
        "source": "wheel",
        "sha256": "",
        "wheel": "flash_attn-2.8.3+cu13torch2.11cxx11abiTRUE-cp312-cp312-linux_x86_64.whl",
    }
    assert "publishes no wheel" in _problems(_with_cell(data, "cu130-torch2.11-py312", flash_attn=fa))


def test_flash_wheel_with_wrong_abi_name_is_rejected(data):
    fa = {
        "version": "2.8.3",
        "source": "wheel",
        "sha256": "",
        "wheel": "flash_attn-2.8.3+cu12torch2.8cxx11abiFALSE-cp311-cp311-linux_x86_64.whl",
    }
    assert "cxx11abiTRUE" in _problems(_with_cell(data, "cu128-torch2.8-py311", flash_attn=fa))


def test_excluded_flash_combination_is_rejected():
    up = mx.load().upstream
    ok, why = mx.flash_wheel_published(up, "2.8.3", "2.4", "12", "3.13", False)
    assert not ok and "excluded" in why
    assert mx.flash_wheel_published(up, "2.8.3", "2.8", "12", "3.12", True) == (True, "")


def test_bad_id_and_cuda_and_archs_are_rejected(data):
    assert "id must be 'cu128-torch2.8-py311'" in _problems(_with_cell(data, "cu128-torch2.8-py311", id="x"))
    msg = _problems(_with_cell(data, "cu121-torch2.4-py311", gpu_archs=["8.0", "10.0"]))
    assert "cannot build for sm ['10.0']" in msg
    msg = _problems(_with_cell(data, "cu128-torch2.9-py311", gpu_archs=["7.5", "8.0"]))
    assert "FlashAttention-2 needs sm >= 8.0" in msg


def test_cpu_cell_with_cuda_or_flash_is_rejected(data):
    assert "cuda = 'none'" in _problems(_with_cell(data, "cpu-torch2.13-py311", cuda="13.0"))
    fa = {"version": "2.8.3", "source": "source"}
    assert "flash-attn needs CUDA" in _problems(_with_cell(data, "cpu-torch2.13-py311", flash_attn=fa))


def test_cuda_variant_not_on_pypi_needs_pytorchs_index(data):
    d = _with_cell(
        data, "cu128-torch2.8-py311", cuda="12.6", id="cu126-torch2.8-py311", gpu_archs=["8.0", "9.0"]
    )
    assert "needs torch = '2.8.0+cu126' from torch_index = 'pytorch'" in _problems(d)
    d = _with_cell(data, "cu128-torch2.8-py311", cuda="12.6", id="cu126-torch2.8-py311", gpu_archs=["8.0", "9.0"],
                   torch="2.8.0+cu126", torch_index="pytorch", torch_sha256="a" * 64)
    m = mx.parse(d)
    assert m.index_url(m.get("cu126-torch2.8-py311")) == "https://download.pytorch.org/whl/cu126"


def test_torch_index_must_carry_the_cells_torch(data):
    assert "set torch_index = 'pytorch'" in _problems(_with_cell(data, "cpu-torch2.13-py311", torch_index="pypi"))
    assert "torch_index must be one of" in _problems(_with_cell(data, "cpu-torch2.13-py311", torch_index="x"))
    assert "pin that, or use 'pypi'" in _problems(_with_cell(data, "cu130-torch2.11-py312", torch_index="pytorch"))
    d = copy.deepcopy(data)
    del next(c for c in d["cell"] if c["id"] == "cu130-torch2.11-py312")["torch_index"]
    assert "missing field 'torch_index'" in _problems(d)


def test_every_cell_names_its_index_and_a_mirror_replaces_pytorchs(monkeypatch):
    m = mx.load()
    cpu, gpu = m.get("cpu-torch2.13-py311"), m.get("cu130-torch2.11-py312")
    assert m.pip_index_args(cpu) == ["--extra-index-url", "https://download.pytorch.org/whl/cpu"]
    assert m.pip_index_args(gpu) == []  # PyPI carries torch 2.11.0 as the CUDA 13.0 build
    monkeypatch.setenv("NSA_PYTORCH_INDEX", "http://127.0.0.1:8000/whl/")
    assert m.index_url(cpu) == "http://127.0.0.1:8000/whl/cpu"


def test_quickstart_cells_cover_every_supported_python(data):
    m = mx.load()
    assert sorted(m.quickstart) == ["3.10", "3.11", "3.12", "3.13"]
    for py, cell_id in m.quickstart.items():
        assert m.get(cell_id).python == py
    d = copy.deepcopy(data)
    d["defaults"]["quickstart"]["3.12"] = "cpu-torch2.13-py311"
    assert "Python 3.12 needs a cell for Python 3.12" in _problems(d)


def test_build_and_run_stages_must_share_the_os_and_nvcc_where_flash_attn_compiles(data):
    msg = _problems(_with_cell(data, "cu130-torch2.11-py312", runtime_image="ubuntu:22.04"))
    assert "base_image is ubuntu24.04 but runtime_image is ubuntu22.04" in msg
    msg = _problems(_with_cell(data, "cu130-torch2.11-py312", base_image="ubuntu:24.04"))
    assert "must be a CUDA -devel image" in msg


def test_driver_facts():
    m = mx.load()
    assert m.min_driver("12.8") == ("570.26", "525.60.13")
    assert m.min_driver("12.7")[1] == "525.60.13"  # a minor without its own entry: its major's floor
    assert m.min_driver("13.0") == ("580.65.06", "580.65.06")
    with pytest.raises(KeyError, match="no driver facts"):
        m.min_driver("11.8")


def test_unknown_torch_and_missing_field(data):
    assert "not in [upstream.torch]" in _problems(_with_cell(data, "cu128-torch2.8-py311", torch="2.8.7"))
    d = copy.deepcopy(data)
    del d["cell"][0]["base_image"]
    assert "missing field 'base_image'" in _problems(d)


def test_duplicate_ids_are_rejected(data):
    d = copy.deepcopy(data)
    d["cell"].append(copy.deepcopy(d["cell"][0]))
    assert "duplicate id" in _problems(d)


def test_wheel_name_and_url():
    name = mx.flash_wheel_name("2.8.3", "12", "2.8", True, "3.11")
    assert name == "flash_attn-2.8.3+cu12torch2.8cxx11abiTRUE-cp311-cp311-linux_x86_64.whl"
    url = mx.flash_wheel_url(mx.load().upstream, "2.8.3", name)
    assert url.endswith("/v2.8.3/flash_attn-2.8.3%2Bcu12torch2.8cxx11abiTRUE-cp311-cp311-linux_x86_64.whl")


def test_cli(capsys):
    assert mx.main(["validate"]) == 0
    assert mx.main(["show", "cpu-torch2.13-py311", "--json"]) == 0
    assert '"index_url": "https://download.pytorch.org/whl/cpu"' in capsys.readouterr().out
    assert mx.main(["show", "nope"]) == 2
    assert "unknown cell 'nope'" in capsys.readouterr().err
