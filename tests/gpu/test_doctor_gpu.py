"""The doctor on a real GPU machine: the fat-binary reader agrees with torch's own list of compiled
architectures on libtorch_cuda.so, and a machine whose GPU suites pass shows no error, with the kernel-image,
Triton-toolchain and glibc checks run (not skipped) and passed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nsa_env import doctor
from nsa_env import report as env
from nsa_env.cuda_archs import fatbin_archs, runs_on

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]


def test_fatbin_reader_agrees_with_torchs_arch_list():
    lib = Path(torch.__file__).parent / "lib" / "libtorch_cuda.so"
    assert lib.exists(), f"{lib} missing: where does this torch keep its CUDA kernels?"
    archs = fatbin_archs(lib)
    declared = {a for a in torch.cuda.get_arch_list() if a.startswith("sm_")}
    assert declared and declared <= set(archs["sass"]), (declared, archs)
    major, minor = torch.cuda.get_device_capability(0)
    cap = f"{major}.{minor}"
    assert runs_on(archs["sass"] + archs["ptx"], cap)


def test_doctor_finds_no_error_on_a_working_gpu_machine():
    report = env.collect()
    assert report["torch"]["arch_list"], "torch.cuda.get_arch_list() is empty on a GPU machine"
    outcomes = {o.check: o for o in doctor.run_checks(report)}
    errors = [f for o in outcomes.values() for f in o.findings if f.severity == "error"]
    assert errors == [], errors
    for code in ("no_kernel_image", "triton_toolchain", "glibc_too_old"):
        assert outcomes[code].status == "passed", (code, outcomes[code])
    fa = report["flash_attn"]
    if fa["installed"]:
        assert fa["archs"], fa["archs_error"]
