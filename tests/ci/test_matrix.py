"""requirements/matrix.toml: the real file validates, and impossible cells are rejected with a reason."""

from __future__ import annotations

import copy

import pytest

from ci import matrix as mx
from ci.matrix.__main__ import main as mx_main

REQUIRED = {  # (CUDA, torch major.minor) pairs we support, the lent GPU machine's exact stack among them
    ("none", "2.13"),
    ("12.1", "2.4"),
    ("12.6", "2.7"),
    ("12.8", "2.8"),
    ("12.8", "2.9"),
    ("13.0", "2.11"),
    ("13.0", "2.12"),
    ("13.0", "2.13"),
    ("13.0", "2.14"),
    ("13.2", "2.15"),
}


pytestmark = pytest.mark.usefixtures("pytorchs_own_index")


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


def test_current_releases_have_gpu_cells_for_every_python_they_publish():
    """torch 2.12 to 2.15: a GPU cell (PyPI's CUDA build) per CPython torch publishes a Linux wheel for."""
    m = mx.load()
    for mm in ("2.12", "2.13", "2.14", "2.15"):
        cells = [c for c in m.cells if c.torch_mm == mm and not c.cpu_only]
        assert cells, mm
        newest = max((v for v in m.upstream["torch"] if v.startswith(mm + ".")), key=mx.Version)
        facts = m.upstream["torch"][newest]
        assert {c.python for c in cells} == set(facts["python"]) and "3.13" in facts["python"], mm
        assert {(c.torch, c.cuda, c.torch_index) for c in cells} == {(newest, facts["pypi_cuda"], "pypi")}, mm
    assert {c.cuda.split(".")[0] for c in m.cells if not c.cpu_only} == {"12", "13"}


def test_recorded_torch_facts():
    """What PyPI's JSON API and PyTorch's release matrix say about the current releases."""
    up = mx.load().upstream["torch"]
    for v in ("2.12.0", "2.12.1", "2.13.0", "2.14.0", "2.14.1"):
        assert up[v]["cuda"] == ["cpu", "12.6", "13.0", "13.2"] and up[v]["cuda_experimental"] == ["13.2"], v
        assert up[v]["pypi_cuda"] == "13.0" and up[v]["python"] == ["3.10", "3.11", "3.12", "3.13", "3.14"], v
    assert (up["2.12.0"]["triton"], up["2.12.1"]["triton"], up["2.13.0"]["triton"]) == ("3.7.0", "3.7.1", "3.7.1")
    assert up["2.15.0"]["pypi_cuda"] == "13.2" and up["2.15.0"]["triton"] == "~=3.9.0"
    assert up["2.15.0"]["python"] == ["3.11", "3.12", "3.13", "3.14", "3.15"]
    assert [v for v in up if mx.cxx_std(up[v]) == 20] == ["2.14.0", "2.14.1", "2.15.0"]


def test_cpu_cell_is_the_ci_machine():
    c = mx.load().get("cpu-torch2.13-py311")
    assert c.cpu_only and c.torch == "2.13.0+cpu" and c.python == "3.11" and c.triton == "3.7.1"
    assert len(c.torch_sha256) == 64 and c.flash_attn.source == "none"


def test_gpu_machine_cell_matches_the_lent_machine():
    c = mx.load().get("cu130-torch2.11-py312")
    assert (c.python, c.cuda, c.torch, c.triton) == ("3.12", "13.0", "2.11.0", "3.6.0")
    assert "numpy==2.5.2" in c.pins


def test_every_cell_uses_one_exact_triton_inside_torchs_pin():
    m = mx.load()
    for c in m.cells:
        spec = mx.pin_specifier(m.upstream["torch"][c.torch_public]["triton"])
        assert len(spec) == 1 and next(iter(spec)).operator in ("==", "~="), c.id
        assert spec.contains(c.triton), c.id
        assert str(mx.Version(c.triton)) == c.triton, c.id  # one version, not a range


def test_triton_not_pinned_by_torch_is_rejected(data):
    assert "triton 3.5.0 is outside torch 2.8.0's pin triton==3.4.0" in _problems(
        _with_cell(data, "cu128-torch2.8-py311", triton="3.5.0"))


# torch 2.14.0's Requires-Dist as PyPI publishes it (torch-2.14.0-cp312-cp312-manylinux_2_28_x86_64.whl):
# triton~=3.8.0; platform_system == "Linux" and python_version < "3.15"
TORCH_2_14_PIN = "~=3.8.0"


def test_torch_2_14s_range_pin_is_understood(data):
    assert data["upstream"]["torch"]["2.14.0"]["triton"] == TORCH_2_14_PIN
    assert data["upstream"]["torch"]["2.14.0"]["triton_python_below"] == "3.15"
    spec = mx.pin_specifier(TORCH_2_14_PIN)
    inside = [v for v in ("3.7.1", "3.8.0", "3.8.1", "3.8.12", "3.9.0") if spec.contains(v)]
    assert inside == ["3.8.0", "3.8.1", "3.8.12"]
    assert mx.pin_specifier("3.6.0") == mx.pin_specifier("==3.6.0")  # a bare version is exact
    assert mx.pin_specifier(">=3.8,<3.9").contains("3.8.5")
    mx.parse(_with_cell(data, "cu130-torch2.14-py312", triton="3.8.1"))  # a later 3.8.x satisfies the range
    for bad in ("3.9.0", "3.7.1"):
        msg = _problems(_with_cell(data, "cu130-torch2.14-py312", triton=bad))
        assert f"triton {bad} is outside torch 2.14.1's pin triton~=3.8.0" in msg
    assert "an exact version inside torch 2.14.1's pin" in _problems(
        _with_cell(data, "cu130-torch2.14-py312", triton="~=3.8.0"))  # a cell pins one version, not a range
    d = copy.deepcopy(data)
    d["upstream"]["torch"]["2.14.1"]["triton"] = "~=3"  # ~= needs two release segments: no PEP 440 specifier
    assert "neither a version nor a specifier" in _problems(d)


def test_no_triton_where_torch_requires_none_for_the_python(data):
    d = copy.deepcopy(data)
    d["upstream"]["torch"]["2.15.0"]["triton_python_below"] = "3.15"
    assert "requires no triton on Python 3.15: triton must be 'none'" in _problems(d)


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


def test_flash_attn_that_cannot_compile_against_the_torch_is_rejected(data):
    fa = {"version": "2.8.3.post2", "source": "source"}
    devel = "nvidia/cuda:13.0.1-cudnn-devel-ubuntu24.04"
    msg = _problems(_with_cell(data, "cu130-torch2.14-py312", flash_attn=fa, base_image=devel))
    assert "compiles with -std=c++17, torch 2.14.1's headers need C++20" in msg
    m = mx.load()
    assert "its headers need C++20" in m.flash_none_reason(m.get("cu130-torch2.14-py312"))
    d = copy.deepcopy(data)  # a release that builds with C++20 would make the reason go away
    d["upstream"]["flash_attn"]["2.8.3.post2"]["cxx_std"] = 20
    assert "say why it has none (flash_attn.why)" in _problems(d)


def test_gpu_cell_without_flash_attn_must_say_why(data):
    assert "say why it has none (flash_attn.why)" in _problems(
        _with_cell(data, "cu130-torch2.12-py312", flash_attn={"source": "none"}))
    d = _with_cell(data, "cu130-torch2.12-py312", flash_attn={"source": "none", "why": "a reason"})
    assert mx.parse(d).flash_none_reason(mx.parse(d).get("cu130-torch2.12-py312")) == "a reason"


def test_flash_wheel_needs_its_sha256_and_a_known_wheel_set(data):
    cell = next(c for c in data["cell"] if c["id"] == "cu128-torch2.8-py311")
    fa = {**cell["flash_attn"], "sha256": ""}
    assert "pin the source package instead" in _problems(_with_cell(data, "cu128-torch2.8-py311", flash_attn=fa))
    fa = {"version": "2.8.3.post2", "source": "wheel", "sha256": "a" * 64,
          "wheel": "flash_attn-2.8.3.post2+cu12torch2.8cxx11abiTRUE-cp311-cp311-linux_x86_64.whl"}
    assert "upstream wheel set is not recorded" in _problems(_with_cell(data, "cu128-torch2.8-py311", flash_attn=fa))


def test_flash_release_facts():
    up = mx.load().upstream
    for v in ("2.8.3", "2.8.3.post1", "2.8.3.post2"):
        assert len(up["flash_attn"][v]["sdist_sha256"]) == 64 and mx.cxx_std(up["flash_attn"][v]) == 17, v
    assert mx.flash_wheel_published(up, "2.8.3", "2.9", "12", "3.12", True) == (True, "")  # `include`
    assert not mx.flash_wheel_published(up, "2.8.3", "2.9", "12", "3.12", False)[0]
    assert "not recorded" in mx.flash_wheel_published(up, "2.8.3.post2", "2.13", "13", "3.12", True)[1]


# --- flash-attn wheels seen (or seen missing) of a release whose wheel set is unknown -----------------------


def test_single_wheels_of_an_unknown_set(data):
    up = mx.load().upstream
    assert mx.flash_wheel_published(up, "2.8.3.post1", "2.8", "12", "3.12", False) == (True, "")
    assert "is seen missing" in mx.flash_wheel_published(up, "2.8.3.post1", "2.11", "13", "3.12", True)[1]
    assert "not among the wheels seen" in mx.flash_wheel_published(up, "2.8.3.post1", "2.13", "13", "3.12", True)[1]
    # a seen wheel can be pinned (with its sha256) by a cell of that torch / CUDA / Python / ABI
    fa = {"version": "2.8.3.post1", "source": "wheel", "sha256": "c" * 64,
          "wheel": "flash_attn-2.8.3.post1+cu12torch2.8cxx11abiTRUE-cp311-cp311-linux_x86_64.whl"}
    d = copy.deepcopy(data)
    next(c for c in d["cell"] if c["id"] == "cu128-torch2.8-py311")["flash_attn"] = fa
    assert mx.parse(d).get("cu128-torch2.8-py311").flash_attn.version == "2.8.3.post1"


@pytest.mark.parametrize("entry, problem", [
    ({"torch": "2.8", "cuda_major": "12", "python": "3.12"}, "must have exactly torch, cuda_major, python"),
    ({"torch": "2.8", "cuda_major": 12, "python": "3.12", "cxx11abi": True}, "must have exactly"),
    ({"torch": "2.11", "cuda_major": "13", "python": "3.12", "cxx11abi": True},
     "both in wheels_seen and wheels_missing"),
])
def test_bad_wheel_lists_are_rejected(data, entry, problem):
    d = copy.deepcopy(data)
    d["upstream"]["flash_attn"]["2.8.3.post1"]["wheels_seen"].append(entry)
    with pytest.raises(mx.MatrixError, match=problem):
        mx.parse(d)


def test_experimental_cuda_must_be_a_published_variant(data):
    d = copy.deepcopy(data)
    d["upstream"]["torch"]["2.13.0"]["cuda_experimental"] = ["13.3"]
    assert "cuda_experimental ['13.3'] not in its cuda list" in _problems(d)


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
    assert mx_main(["validate"]) == 0
    assert mx_main(["show", "cpu-torch2.13-py311", "--json"]) == 0
    assert '"index_url": "https://download.pytorch.org/whl/cpu"' in capsys.readouterr().out
    assert mx_main(["show", "nope"]) == 2
    assert "unknown cell 'nope'" in capsys.readouterr().err
    assert mx_main(["list"]) == 0
    lines, m = capsys.readouterr().out.splitlines(), mx.load()
    assert [ln.split()[0] for ln in lines] == [c.id for c in mx.load().cells]
    assert lines[0].split() == ["cpu-torch2.13-py311", "Python", "3.11", "CPU", "torch", "2.13.0+cpu", "triton",
                                "3.7.1", "no", "flash-attn", "index", m.index_url(m.get("cpu-torch2.13-py311")),
                                "Quick",
                                "start", "for", "3.11"]
    assert sum("Quick start for" in ln for ln in lines) == len(mx.load().quickstart)
    assert mx_main(["--matrix", "nope.toml", "validate"]) == 1
    assert "nope.toml: 1 problem(s):\n  - file not found" in capsys.readouterr().err
