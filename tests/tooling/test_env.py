"""nsa_env: report schema, backend availability, lock drift and the doctor's diagnoses (each failure
simulated on a report dict), and the flash-attn probes."""

from __future__ import annotations

import copy
import json
import sys
import textwrap
from pathlib import Path

import pytest

from nsa.kernels import flash_wrappers as fw
from nsa_env import cli, doctor, drift
from nsa_env import report as env

from .env_reports import cpu_report, h100_report

ROOT = Path(__file__).resolve().parents[2]

TOP_KEYS = {
    "schema",
    "python",
    "platform",
    "torch",
    "gpus",
    "driver",
    "triton",
    "flash_attn",
    "torch_flash_varlen",
    "sdpa",
    "env",
    "cell",
    "backends",
}


def codes(report: dict, **kw) -> dict[str, str]:
    return {f.code: f.severity for f in doctor.diagnose(report, **kw)}


# --- report ----------------------------------------------------------------------------------------------


def test_collect_schema_and_json(capsys):
    r = env.collect()
    assert set(r) >= TOP_KEYS and r["schema"] == "nsa-env/1"
    assert set(r["backends"]) == set(env.BACKENDS)
    assert all(set(b) == {"ok", "reason"} for b in r["backends"].values())
    assert r["backends"]["reference"]["ok"] and r["backends"]["torch"]["ok"]
    assert cli.main(["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["schema"] == "nsa-env/1"


def test_text_report_runs(capsys):
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    for name in env.BACKENDS:
        assert f"  {name} " in out


def test_guess_cell():
    assert env.guess_cell(h100_report()) == "cu130-torch2.11-py312"
    r = cpu_report()
    r["python"]["version"] = "3.11.7"
    assert env.guess_cell(r) == "cpu-torch2.13-py311"


# --- backends --------------------------------------------------------------------------------------------


def test_backends_all_ok_on_a_healthy_h100():
    b = env.backend_availability(h100_report())
    assert all(ok for ok, _ in b.values()), b


def test_cudnn_attention_is_reported_unused_before_hopper():
    r = h100_report()
    r["gpus"][0]["sm"] = "8.0"
    ok, why = env.backend_availability(r)["torch_cudnn"]
    assert not ok and "sm 9.0" in why


def test_backends_on_cpu_with_and_without_interpreter():
    r = cpu_report()
    b = env.backend_availability(r)
    assert not b["torch_flash"][0] and not b["flash_attn"][0] and not b["torch_cudnn"][0]
    assert not b["triton_sel"][0] and "TRITON_INTERPRET=1" in b["triton_sel"][1]
    r["triton"]["interpreter"] = True
    assert env.backend_availability(r)["triton_sel"][0]


def test_triton_sel_off_on_ada_unless_forced():
    r = h100_report()
    r["gpus"][0].update(name="NVIDIA GeForce RTX 4090", sm="8.9")
    ok, why = env.backend_availability(r)["triton_sel"]
    assert not ok and "NSA_TRITON_SEL_FORCE=1" in why
    r["env"]["NSA_TRITON_SEL_FORCE"] = "1"
    assert env.backend_availability(r)["triton_sel"][0]


def test_backends_without_torch():
    r = cpu_report()
    r["torch"].update(imports=False, error="torch is not installed")
    assert all(not ok and why == "torch is not installed" for ok, why in env.backend_availability(r).values())


# --- lock drift ------------------------------------------------------------------------------------------

LOCK = textwrap.dedent("""\
    # cuda: 13.0
    numpy==2.5.2 \\
        --hash=sha256:{a}
    torch==2.11.0 \\
        --hash=sha256:{a}
    triton==3.6.0 \\
        --hash=sha256:{a}
    flash-attn @ https://x.invalid/flash_attn-2.8.3%2Bcu12torch2.8cxx11abiTRUE-cp311-cp311-linux_x86_64.whl \\
        --hash=sha256:{a}
    """).format(a="a" * 64)
GOOD = {"numpy": "2.5.2", "torch": "2.11.0", "triton": "3.6.0", "flash-attn": "2.8.3"}


def test_no_drift_and_ignored_installers():
    res = drift.check_lock(LOCK, {**GOOD, "pip": "24.0", "nsa": "0.1.0"}, "cu130")
    assert not res["drift"] and res["matching"] == 4
    assert {e["name"] for e in res["ignored"]} == {"pip", "nsa"}


def test_missing_extra_and_wrong_version_are_drift():
    installed = {**GOOD, "numpy": "2.4.6", "jax": "0.11.2"}
    del installed["triton"]
    res = drift.check_lock(LOCK, installed, "cu130")
    assert res["drift"]
    assert res["missing"] == [{"name": "triton", "locked": "3.6.0"}]
    assert res["extra"] == [{"name": "jax", "installed": "0.11.2"}]
    assert res["wrong_version"] == [{"name": "numpy", "locked": "2.5.2", "installed": "2.4.6"}]


def test_local_label_of_the_cells_variant_is_not_drift():
    res = drift.check_lock(LOCK, {**GOOD, "torch": "2.11.0+cu130"}, "cu130")
    assert not res["drift"] and res["local_label"][0]["installed"] == "2.11.0+cu130"
    res = drift.check_lock(LOCK, {**GOOD, "torch": "2.11.0+cu128"}, "cu130")
    assert res["drift"] and res["wrong_version"][0]["name"] == "torch"


def test_check_lock_cli_against_a_lock_file(tmp_path, capsys, monkeypatch):
    lock = tmp_path / "cell.txt"
    lock.write_text(LOCK)
    monkeypatch.setattr(drift, "installed_distributions", lambda: dict(GOOD))
    assert cli.main(["--check-lock", str(lock)]) == 0
    monkeypatch.setattr(drift, "installed_distributions", lambda: {**GOOD, "numpy": "1.0"})
    capsys.readouterr()
    assert cli.main(["--check-lock", str(lock), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["wrong_version"] == [{"name": "numpy", "locked": "2.5.2", "installed": "1.0"}]
    assert cli.main(["--check-lock", "no-such-cell"]) == 2


def test_check_lock_real_cpu_lock_reports_drift_fields():
    res = drift.check_lock(
        (ROOT / "requirements/locks/cpu-torch2.13-py311.txt").read_text(),
        drift.installed_distributions(),
        "cpu",
    )
    assert set(res) >= {"missing", "extra", "wrong_version", "local_label", "drift"}
    assert not any(e["name"] == "torch" for e in res["wrong_version"])


# --- doctor ----------------------------------------------------------------------------------------------


def test_healthy_machine_has_no_errors_or_warnings():
    assert codes(h100_report()) == {}


def test_torch_triton_mismatch():
    r = h100_report()
    r["triton"]["version"] = "3.5.1"
    f = {x.code: x for x in doctor.diagnose(r)}
    assert (
        f["torch_triton_mismatch"].severity == "error" and "triton==3.6.0" in f["torch_triton_mismatch"].fix
    )


def test_flash_attn_undefined_symbol_names_the_matching_wheel():
    r = h100_report()
    r["torch"].update(version="2.8.0+cu128", cuda="12.8", expected_triton="3.4.0")
    r["triton"]["version"] = "3.4.0"
    r["python"]["version"] = "3.11.9"
    r["flash_attn"].update(
        imports=False,
        error="import flash_attn failed: flash_attn_2_cuda.so: undefined symbol: "
        "_ZN3c105ErrorC2ENS_14SourceLocationESs",
    )
    f = {x.code: x for x in doctor.diagnose(r)}["flash_attn_abi"]
    assert f.severity == "error"
    assert "flash_attn-2.8.3+cu12torch2.8cxx11abiTRUE-cp311-cp311-linux_x86_64.whl" in f.fix
    if sys.version_info >= (3, 11):  # the matrix (tomllib) says whether upstream publishes it
        assert "published upstream" in f.fix


def test_undefined_symbol_on_torch_without_upstream_wheel_says_build_from_source():
    r = h100_report()
    r["flash_attn"].update(imports=False, error="undefined symbol: _ZN3c10")
    fix = {x.code: x for x in doctor.diagnose(r)}["flash_attn_abi"].fix
    assert "cu13torch2.11cxx11abiTRUE-cp312" in fix and "--no-build-isolation" in fix
    if sys.version_info >= (3, 11):
        assert "NOT published upstream" in fix


def test_sm_and_head_dim_unsupported_by_fa2():
    r = h100_report()
    r["gpus"][0].update(name="Tesla T4", sm="7.5")
    assert codes(r)["fa2_sm_unsupported"] == "warning"
    assert codes(h100_report(), head_dims=(128, 320))["fa2_head_dim"] == "warning"
    assert "fa2_head_dim" in codes(h100_report(), head_dims=(100,))


def test_driver_too_old_and_minor_older():
    r = h100_report()
    r["driver"] = {"version": "535.104.05", "cuda": "12.2"}
    assert codes(r)["driver_too_old"] == "error"
    r["torch"]["cuda"], r["driver"]["cuda"] = "12.8", "12.4"
    assert codes(r) == {"driver_minor_older": "warning"}


def test_ada_note_and_no_gpu_and_torch_missing():
    r = h100_report()
    r["gpus"][0].update(name="NVIDIA GeForce RTX 4090", sm="8.9")
    assert codes(r)["ada_triton_sel_off"] == "info"
    r = h100_report()
    r["gpus"] = []
    assert codes(r)["no_gpu"] == "info"
    r = cpu_report()
    r["torch"].update(imports=False, error="torch is not installed")
    assert codes(r) == {"torch_missing": "error"}


def test_triton_missing_on_cpu_is_info():
    r = cpu_report()
    r["triton"].update(installed=False, version=None, imports=False, error="triton is not installed")
    assert codes(r) == {"triton_missing": "info"}


def test_doctor_cli_exit_codes(monkeypatch, capsys):
    bad = h100_report()
    bad["triton"]["version"] = "3.5.1"
    monkeypatch.setattr(env, "collect", lambda: copy.deepcopy(bad))
    assert cli.main(["doctor"]) == 1
    assert "torch_triton_mismatch" in capsys.readouterr().out
    monkeypatch.setattr(env, "collect", h100_report)
    assert cli.main(["doctor", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []
    with pytest.raises(SystemExit):
        cli.main(["doctor", "--head-dim", "-1"])


# --- probes ----------------------------------------------------------------------------------------------


def test_probes_are_false_with_a_reason_on_this_machine():
    fw.reset_probes()
    if not fw.cuda_device_status()[0]:
        assert fw.is_flash_available() is False and fw.is_flash_varlen_available() is False
        assert fw.is_torch_flash_varlen_available() is False
        assert fw.torch_flash_varlen_status()[1]


def test_flash_import_failure_is_recorded_not_raised(tmp_path, monkeypatch):
    pkg = tmp_path / "flash_attn"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ImportError('flash_attn_2_cuda.so: undefined symbol: _ZN3c10')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    fw.reset_probes()
    try:
        ok, why = fw.flash_attn_status()
        assert not ok and "undefined symbol" in why
    finally:
        fw.reset_probes()


def test_a_cell_id_is_looked_up_in_the_checkout_around_the_current_directory(tmp_path, monkeypatch):
    root = tmp_path / "checkout"
    (root / "requirements" / "locks").mkdir(parents=True)
    (root / "requirements" / "matrix.toml").write_text("")
    lock = root / "requirements" / "locks" / "cu130-torch2.11-py312.txt"
    lock.write_text(LOCK)
    (root / "docs").mkdir()
    monkeypatch.chdir(root / "docs")
    assert drift.find_lock("cu130-torch2.11-py312") == lock.resolve()
    with pytest.raises(FileNotFoundError, match="no lock requirements/locks/cpu-torch2.13-py311.txt"):
        drift.find_lock("cpu-torch2.13-py311")
    assert drift.find_lock(str(lock)) == lock  # a path is taken as it is, anywhere
    monkeypatch.chdir(tmp_path)  # not inside a checkout: an installed nsa has no locks of its own to fall back on
    with pytest.raises(FileNotFoundError, match="not inside a checkout"):
        drift.find_lock("cu130-torch2.11-py312")
    with pytest.raises(FileNotFoundError, match="neither a lock file nor a cell id"):
        drift.find_lock("requirements/locks/missing.txt")


def test_a_lock_line_that_does_not_parse_is_an_error_naming_the_line(tmp_path, capsys, monkeypatch):
    lock = tmp_path / "cell.txt"
    lock.write_text(LOCK + "torch>=2.4\n")
    monkeypatch.setattr(drift, "installed_distributions", lambda: dict(GOOD))
    assert cli.main(["--check-lock", str(lock)]) == 2
    assert "line 10: unparseable lock line: 'torch>=2.4'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("fa", "tf", "provider"),
    [((True, "flash_attn 2.8"), (True, "torch 2.11"), "flash_attn"),
     ((False, "flash_attn is not installed"), (True, "torch 2.11 aten._flash_attention_forward"), "torch_flash"),
     ((False, "flash_attn is not installed"), (False, "torch sees no CUDA GPU"), None)],
)
@pytest.mark.parametrize("varlen", [False, True])
def test_flash_probes_count_torch_builtin_fa2(monkeypatch, fa, tf, provider, varlen):
    """The runbook's probes answer "can an FA-2 kernel serve here", flash-attn's or torch's built-in."""
    monkeypatch.setattr(fw, "flash_attn_status", lambda varlen=False: fa)
    monkeypatch.setattr(fw, "torch_flash_status", lambda: tf)
    probe = fw.is_flash_varlen_available if varlen else fw.is_flash_available
    assert probe() is (provider is not None)
    assert fw.flash_provider(varlen=varlen) == provider
    ok, why = fw.flash_status(varlen=varlen)
    assert ok is (provider is not None)
    if provider is None:
        assert "flash_attn is not installed" in why and "no CUDA GPU" in why
    else:
        assert why == (fa if provider == "flash_attn" else tf)[1]
