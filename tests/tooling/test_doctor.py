"""nsa_env.doctor: each check code under a simulated failure (a report changed in one fact, or the log of a
failed install), and passing on the healthy machine it was changed from. No GPU, no network."""

from __future__ import annotations

import copy
import io
import json
import re
from pathlib import Path

import pytest

from nsa_env import cli, doctor, drift, upstream
from nsa_env import report as env

from .env_reports import cpu_report, gpu_machine_report, h100_report, torch28_report

DOCS = Path(__file__).resolve().parents[2] / "docs" / "environments.md"
ALL_CODES = {name for name, _ in doctor.CHECKS} | {"triton_missing", "flash_attn_import", "driver_minor_older"}
NEW_CODES = ("build_isolation", "build_oom_risk", "no_wheel", "cuda_home_mismatch", "no_kernel_image",
             "glibc_too_old", "triton_toolchain")


def found(report: dict, log: str = "", **kw) -> dict[str, doctor.Finding]:
    """code -> the (last) finding with it."""
    return {f.code: f for f in doctor.diagnose(report, log=log, **kw)}


def codes(report: dict, log: str = "", **kw) -> dict[str, str]:
    return {c: f.severity for c, f in found(report, log, **kw).items()}


def status(report: dict, check: str, log: str = "") -> doctor.Outcome:
    return next(o for o in doctor.run_checks(report, log=log) if o.check == check)


# --- the healthy machines ----------------------------------------------------------------------------------


def test_gpu_machine_only_notes_that_flash_attn_has_no_wheel_for_its_torch():
    # torch 2.11 / CUDA 13: no upstream flash-attn wheel, but torch's built-in FA-2 serves NSA: info only.
    assert codes(gpu_machine_report()) == {"no_wheel": "info"}
    outcomes = {o.check: o.status for o in doctor.run_checks(gpu_machine_report())}
    assert set(outcomes) == {name for name, _ in doctor.CHECKS}
    for code in ("triton_toolchain", "no_kernel_image", "glibc_too_old", "cuda_home_mismatch", "build_isolation"):
        assert outcomes[code] == "passed", code


def test_torch28_machine_with_an_upstream_wheel_passes_the_install_checks():
    r = torch28_report()
    assert codes(r) == {}
    assert status(r, "no_wheel").status == "passed"
    assert "no flash-attn source build ahead" in status(r, "build_oom_risk").note


def test_cpu_machine_skips_what_needs_cuda_with_the_reason():
    r = cpu_report()
    r["toolchain"] = copy.deepcopy(gpu_machine_report()["toolchain"])
    by = {o.check: o for o in doctor.run_checks(r)}
    assert codes(r) == {}
    for code in ("build_isolation", "build_oom_risk", "no_wheel", "cuda_home_mismatch"):
        assert by[code].status == "not applicable" and "CPU build" in by[code].note
    assert "no CUDA GPU" in by["no_kernel_image"].note and "no CUDA GPU" in by["triton_toolchain"].note


def test_every_code_is_documented_with_its_fix():
    text = DOCS.read_text()
    section = text[text.index("### Doctor checks"):]
    for code in ALL_CODES:
        assert f"`{code}`" in section, f"docs/environments.md does not describe {code}"


def test_driver_floor_from_the_kernel_module_when_libcuda_does_not_answer():
    r = gpu_machine_report()
    r["driver"] = {"version": "535.104.05", "cuda": None}
    f = found(r)["driver_too_old"]
    assert f.severity == "error" and "580.65.06" in f.fix
    r["driver"]["version"] = "580.95.05"
    assert status(r, "driver_too_old").status == "not applicable"


# --- build_isolation -----------------------------------------------------------------------------------------

PIP_ISOLATION_LOG = """\
Collecting flash-attn==2.8.3
  Downloading flash_attn-2.8.3.tar.gz (8.4 MB)
  Installing build dependencies ... done
  Getting requirements to build wheel ... error
  error: subprocess-exited-with-error
      ModuleNotFoundError: No module named 'torch'
"""


def test_build_isolation_from_the_pip_log():
    f = found(torch28_report(), PIP_ISOLATION_LOG)["build_isolation"]
    assert f.severity == "error" and "isolated" in f.problem
    assert "--no-build-isolation" in f.fix and "psutil" in f.fix


def test_build_isolation_missing_build_modules_before_the_install():
    r = torch28_report()
    r["toolchain"]["build_modules"].update(psutil=False, wheel=False)
    f = found(r)["build_isolation"]
    assert f.severity == "warning" and "wheel, psutil" in f.problem
    assert f.fix.startswith("pip install wheel psutil") and "--no-build-isolation" in f.fix
    assert "releases/download/v2.8.3/flash_attn-2.8.3%2Bcu12torch2.8cxx11abiTRUE-cp311" in f.fix
    r["flash_attn"].update(installed=True, imports=True, version="2.8.3")
    assert "build_isolation" not in codes(r)


# --- build_oom_risk ------------------------------------------------------------------------------------------


def test_build_oom_risk_max_jobs_above_free_memory():
    r = gpu_machine_report()
    r["toolchain"].update(cpus=64, mem_available_gib=32.0, env={"MAX_JOBS": "16"})
    r["torch_flash_op"] = r["torch_flash_varlen"] = {"available": False, "reason": "x"}
    f = found(r)["build_oom_risk"]
    assert f.severity == "warning" and "16 nvcc job(s)" in f.problem and "32 GiB is free" in f.problem
    assert f.fix.startswith("MAX_JOBS=3 NVCC_THREADS=4 ")  # 32 GiB // 9 GiB per job


def test_build_oom_risk_counts_nvcc_threads():
    r = gpu_machine_report()
    r["toolchain"].update(cpus=16, mem_available_gib=20.0, env={"MAX_JOBS": "4", "NVCC_THREADS": "2"})
    assert "build_oom_risk" not in codes(r)  # 4 jobs x 4.5 GiB fit in 20 GiB
    r["toolchain"]["env"]["NVCC_THREADS"] = "4"
    assert "build_oom_risk" in codes(r)


def test_build_oom_risk_machine_too_small_for_one_job():
    r = gpu_machine_report()
    r["toolchain"]["mem_available_gib"] = 6.0
    f = found(r)["build_oom_risk"]
    assert f.severity == "info"  # torch 2.11 has FA-2 built in: flash-attn is optional here
    assert f.fix.startswith("MAX_JOBS=1 NVCC_THREADS=1") and "torch_flash" in f.fix


def test_build_oom_risk_from_a_killed_compiler_in_the_log():
    log = "c++: fatal error: Killed signal terminated program cc1plus\nninja: build stopped: subcommand failed."
    f = found(torch28_report(), log)["build_oom_risk"]
    assert f.severity == "error" and "killed for memory" in f.problem
    assert f.fix.startswith("MAX_JOBS=")


def test_build_oom_risk_needs_no_source_build_to_pass():
    r = gpu_machine_report()
    r["toolchain"]["mem_available_gib"] = 120.0  # flash-attn's own MAX_JOBS choice fits
    assert status(r, "build_oom_risk").status == "passed"


# --- no_wheel ------------------------------------------------------------------------------------------------


def test_no_wheel_names_the_combination_and_the_cells_that_have_one():
    r = gpu_machine_report()
    r["torch_flash_op"] = r["torch_flash_varlen"] = {"available": False, "reason": "x"}
    f = found(r)["no_wheel"]
    assert f.severity == "warning" and "cu13torch2.11cxx11abiTRUE-cp312" in f.problem
    assert "cu128-torch2.8-py311" in f.fix and "--no-build-isolation" in f.fix


def test_no_wheel_from_flash_attn_setup_log_even_on_a_machine_with_wheels():
    log = "Guessing wheel URL:  https://example.invalid/x.whl\nPrecompiled wheel not found. Building from source..."
    assert codes(torch28_report(), log)["no_wheel"] == "warning"


# --- cuda_home_mismatch --------------------------------------------------------------------------------------


def test_cuda_home_other_cuda_major_than_torch():
    r = gpu_machine_report()
    r["toolchain"]["cuda_home"].update(path="/usr/local/cuda-12.4", nvcc_version="12.4", **{"from": "CUDA_HOME"})
    f = found(r)["cuda_home_mismatch"]
    assert f.severity == "error" and "nvcc 12.4" in f.problem and "CUDA 13.0" in f.problem
    assert "/usr/local/cuda-13.0" in f.fix
    r["flash_attn"].update(installed=True, imports=True, version="2.8.3")  # nothing to build: a warning
    assert codes(r)["cuda_home_mismatch"] == "warning"


def test_cuda_home_minor_difference_is_info_and_missing_toolkit_matters_only_for_a_build():
    r = gpu_machine_report()
    r["toolchain"]["cuda_home"]["nvcc_version"] = "13.1"
    assert codes(r)["cuda_home_mismatch"] == "info"
    r["toolchain"]["cuda_home"] = {"path": None, "from": None, "nvcc": None, "nvcc_version": None,
                                   "headers": None, "toolkits": []}
    assert "no CUDA toolkit" in found(r)["cuda_home_mismatch"].problem
    r["flash_attn"].update(installed=True, imports=True, version="2.8.3")
    assert "cuda_home_mismatch" not in codes(r)


def test_cuda_home_from_an_nvcc_wrapper_without_headers():
    r = gpu_machine_report()
    r["toolchain"]["cuda_home"].update(path="/usr/local", nvcc="/usr/local/bin/nvcc", headers=False)
    f = found(r)["cuda_home_mismatch"]
    assert "no include/cuda_runtime.h" in f.problem and "/usr/local/cuda-13.0" in f.fix


def test_cuda_home_mismatch_from_torch_extension_log():
    log = ("RuntimeError:\nThe detected CUDA version (12.4) mismatches the version that was used to compile\n"
           "PyTorch (13.0). Please make sure to use the same CUDA versions.")
    f = found(gpu_machine_report(), log)["cuda_home_mismatch"]
    assert f.severity == "error" and "nvcc 12.4" in f.problem and "cuda-13.0" in f.fix
    f = found(gpu_machine_report(), "OSError: CUDA_HOME environment variable is not set.")["cuda_home_mismatch"]
    assert f.severity == "error" and "no nvcc" in f.problem


# --- no_kernel_image -----------------------------------------------------------------------------------------


def test_no_kernel_image_torch_without_the_gpus_architecture():
    r = torch28_report()
    r["torch"]["arch_list"] = ["sm_80", "sm_86", "sm_90"]
    r["gpus"][0].update(name="NVIDIA GeForce RTX 5090", sm="12.0")
    f = found(r)["no_kernel_image"]
    assert f.severity == "error" and "sm_80 sm_86 sm_90" in f.problem and "sm 12.0" in f.problem
    assert "CUDA 12.8 or newer" in f.fix


def test_no_kernel_image_flash_attn_built_for_other_gpus():
    r = gpu_machine_report()
    r["gpus"][0].update(name="NVIDIA RTX PRO 6000", sm="12.0")
    r["flash_attn"].update(installed=True, imports=True, version="2.8.3", archs={"sass": ["sm_80", "sm_90"], "ptx": []})
    f = found(r)["no_kernel_image"]
    assert "flash-attn 2.8.3 carries kernels for sm_80 sm_90" in f.problem
    assert "FLASH_ATTN_CUDA_ARCHS=120" in f.fix and "FLASH_ATTENTION_FORCE_BUILD=TRUE" in f.fix
    r["gpus"][0].update(name="NVIDIA H100", sm="9.0")
    assert "no_kernel_image" not in codes(r)


def test_no_kernel_image_in_the_log_when_torch_and_flash_attn_cover_the_gpu():
    log = "torch.AcceleratorError: CUDA error: no kernel image is available for execution on the device"
    f = found(gpu_machine_report(), log)["no_kernel_image"]
    assert f.severity == "error" and "another extension" in f.problem


# --- glibc_too_old -------------------------------------------------------------------------------------------

GLIBC_IMPORT_ERROR = (
    "import flash_attn failed: /lib/x86_64-linux-gnu/libc.so.6: version `GLIBC_2.32' not found (required by "
    "/usr/local/lib/python3.11/site-packages/flash_attn_2_cuda.cpython-311-x86_64-linux-gnu.so)"
)


def test_glibc_too_old_for_an_installed_flash_attn_wheel():
    r = torch28_report()
    r["toolchain"]["glibc"] = "2.31"
    r["flash_attn"].update(installed=True, imports=False, version="2.8.3", error=GLIBC_IMPORT_ERROR)
    c = found(r)
    f = c["glibc_too_old"]
    assert f.severity == "error" and "GLIBC_2.32" in f.problem and "glibc 2.31" in f.problem
    assert "FLASH_ATTENTION_FORCE_BUILD=TRUE" in f.fix
    assert "flash_attn_import" not in c  # its generic "reinstall" would not help


def test_glibc_too_old_for_the_upstream_wheel_before_installing_it():
    r = torch28_report()
    r["toolchain"]["glibc"] = "2.31"
    f = found(r)["glibc_too_old"]
    assert "flash_attn-2.8.3+cu12torch2.8cxx11abiTRUE-cp311" in f.problem and ">= 2.32" in f.problem
    assert "FLASH_ATTENTION_FORCE_BUILD=TRUE" in f.fix
    assert "build_oom_risk" in {o.check for o in doctor.run_checks(r) if o.status != "not applicable"}
    # Every build line now compiles instead of letting setup.py fetch that wheel, and none offers the wheel.
    r["toolchain"]["build_modules"]["psutil"] = False
    fix = found(r)["build_isolation"].fix
    assert "FLASH_ATTENTION_FORCE_BUILD=TRUE pip install flash-attn==2.8.3" in fix and ".whl" not in fix


def test_glibc_too_old_for_wheels_installed_elsewhere_and_libstdcxx_in_a_log():
    r = gpu_machine_report()
    r["toolchain"]["glibc"] = "2.27"
    f = found(r)["glibc_too_old"]
    assert "torch (glibc 2.28)" in f.problem and "triton" not in f.problem
    log = "ImportError: /usr/lib/libstdc++.so.6: version `GLIBCXX_3.4.30' not found (required by x.so)"
    f = found(gpu_machine_report(), log)["glibc_too_old"]
    assert "GLIBCXX_3.4.30" in f.problem and "libstdc++" in f.fix


def test_glibc_check_does_not_apply_without_glibc():
    r = gpu_machine_report()
    r["toolchain"]["glibc"] = None
    r["platform"]["libc"] = None
    assert status(r, "glibc_too_old").status == "not applicable"


# --- triton_toolchain ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, problem, fix",
    [
        ({"cc": {"path": None, "from": None, "name": None}}, "no C compiler", "apt-get install gcc"),
        ({"cc": {"path": None, "from": "CC", "name": "clang-19"}}, "CC=clang-19 is not on PATH", "export CC="),
        ({"python_h": {"include": "/usr/include/python3.12", "found": False}}, "no Python.h", "python3.12-dev"),
        ({"libcuda": {"from": "ldconfig -p", "so1_dirs": [], "so_dirs": []}}, "libcuda.so.1 not found",
         "TRITON_LIBCUDA_PATH"),
    ],
)
def test_triton_toolchain_missing_piece(change, problem, fix):
    r = gpu_machine_report()
    r["toolchain"].update(change)
    f = found(r)["triton_toolchain"]
    assert f.severity == "error" and problem in f.problem and fix in f.fix


def test_triton_before_3_6_needs_the_unversioned_libcuda():
    r = gpu_machine_report()
    r["triton"]["version"] = "3.5.1"
    f = found(r)["triton_toolchain"]
    assert "links -lcuda" in f.problem and "ln -s libcuda.so.1 /usr/lib/x86_64-linux-gnu/libcuda.so" in f.fix
    r["toolchain"]["libcuda"]["so_dirs"] = ["/usr/lib/x86_64-linux-gnu"]
    assert "triton_toolchain" not in codes(r)


def test_triton_toolchain_from_the_log():
    log = "RuntimeError: Failed to find C compiler. Please specify via CC environment variable"
    f = found(gpu_machine_report(), log)["triton_toolchain"]
    assert f.severity == "error" and "gcc" in f.fix
    f = found(gpu_machine_report(), "/usr/bin/ld: cannot find -lcuda: No such file")["triton_toolchain"]
    assert "ln -s libcuda.so.1 libcuda.so" in f.fix


# --- range pins (torch >= 2.14 pins triton~=3.8.0) ------------------------------------------------------------

TORCH_2_14_REQUIRES = [  # torch-2.14.0-cp312-cp312-manylinux_2_28_x86_64.whl METADATA, as published on PyPI
    "filelock",
    "cuda-toolkit[cublas,cudart,cufft,cufile,cupti,curand,cusolver,cusparse,nvjitlink,nvrtc,nvtx]==13.0.3; "
    'platform_system == "Linux"',
    'triton~=3.8.0; platform_system == "Linux" and python_version < "3.15"',
    'optree>=0.13.0; extra == "optree"',
]


def test_torch_2_14_range_pin_is_read_from_its_metadata():
    linux = {"platform_system": "Linux", "python_version": "3.12"}
    assert upstream.triton_pin_from_requires(TORCH_2_14_REQUIRES, linux) == (True, "~=3.8.0")
    # Python 3.15: the marker is false, torch requires no triton there (and the matrix is not consulted).
    assert upstream.triton_pin_from_requires(TORCH_2_14_REQUIRES, {**linux, "python_version": "3.15"}) == (True, None)
    assert upstream.triton_pin_from_requires(['triton==3.6.0; platform_system == "Linux"'], linux) == (True, "3.6.0")
    assert upstream.triton_pin_from_requires(["filelock"], linux) == (False, None)


def test_expected_triton_understands_ranges_from_metadata_and_from_the_facts():
    if upstream.triton_pin_from_requires(TORCH_2_14_REQUIRES)[1]:  # this platform satisfies the marker
        assert env.expected_triton("2.14.0", requires=TORCH_2_14_REQUIRES) == "~=3.8.0"
    facts = {"torch": {"2.14.0": {"triton": "~=3.8.0"}, "2.13.0": {"triton": "3.7.1"}}}
    assert env.expected_triton("2.14.0+cpu", requires=[], facts=facts) == "~=3.8.0"
    assert env.expected_triton("2.13.0+cpu", requires=[]) == "3.7.1"  # the shipped facts
    assert env.expected_triton("9.9.0", requires=[]) is None


@pytest.mark.parametrize("triton, ok", [("3.8.0", True), ("3.8.2", True), ("3.9.0", False), ("3.7.1", False)])
def test_pin_matches_ranges_and_exact_pins(triton, ok):
    assert upstream.pin_matches(triton, "~=3.8.0") is ok
    assert upstream.pin_matches(triton, ">=3.8,<3.9") is ok
    assert upstream.pin_matches(triton, "3.8.0") is (triton == "3.8.0")


def test_doctor_reports_a_triton_outside_torch_2_14s_range():
    r = gpu_machine_report()
    r["torch"].update(version="2.14.0", expected_triton="~=3.8.0", requires_triton="~=3.8.0")
    r["triton"]["version"] = "3.9.0"
    f = found(r)["torch_triton_mismatch"]
    assert f.severity == "error" and "pins triton ~=3.8.0" in f.problem
    assert 'pip install "triton~=3.8.0"' in f.fix
    r["triton"]["version"] = "3.8.1"
    assert "torch_triton_mismatch" not in codes(r)


LOCK_2_14 = "torch==2.14.0 \\\n    --hash=sha256:{a}\ntriton==3.9.0 \\\n    --hash=sha256:{a}\n".format(a="a" * 64)


def test_check_lock_flags_a_triton_outside_torchs_range_as_drift():
    res = drift.check_lock(LOCK_2_14, {"torch": "2.14.0", "triton": "3.9.0"}, "cu130", triton_pin="~=3.8.0")
    assert not res["wrong_version"] and res["drift"]
    assert res["torch_triton"] == {"torch": "2.14.0", "triton": "3.9.0", "torch_pins": "~=3.8.0"}
    ok = drift.check_lock(LOCK_2_14.replace("3.9.0", "3.8.1"), {"torch": "2.14.0", "triton": "3.8.1"}, "cu130",
                        triton_pin="~=3.8.0")
    assert not ok["drift"] and ok["torch_triton"] is None


def test_check_lock_cli_uses_the_facts_pin_of_the_locked_torch(tmp_path, monkeypatch, capsys):
    lock = tmp_path / "cell.txt"
    lock.write_text(LOCK_2_14.replace("torch==2.14.0", "torch==2.11.0"))
    monkeypatch.setattr(drift, "installed_distributions", lambda: {"torch": "2.11.0", "triton": "3.9.0"})
    assert cli.main(["--check-lock", str(lock)]) == 1
    assert "triton 3.9.0 is outside torch 2.11.0's pin triton==3.6.0" in capsys.readouterr().out


# --- CLI -----------------------------------------------------------------------------------------------------


def test_cli_explains_a_log_from_a_file_and_from_stdin(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(env, "collect", torch28_report)
    log = tmp_path / "pip.log"
    log.write_text(PIP_ISOLATION_LOG)
    assert cli.main(["doctor", "--log", str(log)]) == 1
    out = capsys.readouterr().out
    assert "[ERROR] build_isolation" in out and "doctor: 1 error(s)" in out
    monkeypatch.setattr("sys.stdin", io.StringIO("Precompiled wheel not found. Building from source..."))
    assert doctor.main(["--log", "-", "--json"]) == 0
    assert [f["code"] for f in json.loads(capsys.readouterr().out)] == ["no_wheel"]
    with pytest.raises(SystemExit):
        doctor.main(["--log", str(tmp_path / "missing.log")])


def test_cli_lists_passed_and_not_applicable_checks(monkeypatch, capsys):
    monkeypatch.setattr(env, "collect", h100_report)  # a report without the toolchain facts (older nsa)
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^passed: torch_missing, torch_triton_mismatch", out, re.M)
    assert re.search(r"^  build_oom_risk +no toolchain facts in this report", out, re.M)
    assert "doctor: nothing wrong found" in out


PIP_INDEX_RETRY_LOG = """\
Looking in indexes: https://pypi.org/simple, http://127.0.0.1:9/whl/cpu
WARNING: Retrying (Retry(total=4, connect=None, read=None, redirect=None, status=None)) after connection broken by \
'NewConnectionError('<pip._vendor.urllib3.connection.HTTPConnection object at 0x7f>: Failed to establish a new \
connection: [Errno 111] Connection refused')': /whl/cpu/torch/
ERROR: Could not find a version that satisfies the requirement torch==2.13.0+cpu (from versions: none)
ERROR: No matching distribution found for torch==2.13.0+cpu
"""
NOX_INDEX_LOG = ("nox > Session cpu_smoke aborted: cell cpu-torch2.13-py311 installs torch from "
                 "http://127.0.0.1:9/whl/cpu, which cannot be reached (127.0.0.1:9: Connection refused). Behind a "
                 "mirror of PyTorch's index set NSA_PYTORCH_INDEX to its base URL, ...")


@pytest.mark.parametrize("log", [PIP_INDEX_RETRY_LOG, NOX_INDEX_LOG])
def test_index_unreachable_from_the_log_even_without_torch(log):
    """The failed install left no torch: the log-only check still explains it (and names NSA_PYTORCH_INDEX)."""
    report = copy.deepcopy(cpu_report())
    report["torch"] = {"installed": False, "error": "No module named 'torch'"}
    f = found(report, log)
    assert "torch_missing" in f
    g = f["index_unreachable"]
    assert g.severity == "error" and "/whl/cpu" in g.problem and "Connection refused" in g.problem
    assert "NSA_PYTORCH_INDEX" in g.fix and "ci.matrix list" in g.fix


def test_index_unreachable_is_quiet_without_such_a_log():
    assert "index_unreachable" not in found(cpu_report(), PIP_ISOLATION_LOG)
    assert "index_unreachable" not in found(cpu_report(), "")


def test_flash_version_named_for_a_source_build_is_the_newest_release():
    """Where no upstream wheel fits (torch 2.11 on CUDA 13), the doctor names the release the source-build cells
    pin (2.8.3.post2), not 2.8.3; where one fits (torch 2.8, CUDA 12), the wheel's version."""
    from nsa_env.doctor.core import Context

    facts = upstream.load()
    assert Context(gpu_machine_report(), facts=facts).flash_version == "2.8.3.post2"
    assert Context(torch28_report(), facts=facts).flash_version == "2.8.3"
