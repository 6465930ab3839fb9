"""Reports as nsa_env.report.collect() makes them on other machines, for the env and doctor tests: each test
changes one fact of a healthy report to simulate a failure."""

from __future__ import annotations

import copy

from nsa_env import report as env


def h100_report() -> dict:
    """A healthy lent GPU machine, as collect() would report it."""
    return {
        "schema": env.SCHEMA,
        "python": {"version": "3.12.3", "implementation": "CPython", "executable": "/usr/bin/python3"},
        "platform": {"system": "Linux", "machine": "x86_64", "libc": "glibc 2.39"},
        "torch": {
            "installed": True,
            "imports": True,
            "version": "2.11.0+cu130",
            "cuda": "13.0",
            "cudnn": 91900,
            "cxx11abi": True,
            "requires_triton": "3.6.0",
            "expected_triton": "3.6.0",
            "error": None,
        },
        "gpus": [
            {
                "index": 0,
                "name": "NVIDIA H100 80GB HBM3",
                "sm": "9.0",
                "memory_gib": 79.2,
                "multiprocessors": 132,
            }
        ],
        "driver": {"version": "580.159.04", "cuda": "13.0"},
        "triton": {
            "installed": True,
            "version": "3.6.0",
            "imports": True,
            "error": None,
            "interpreter": False,
        },
        "flash_attn": {
            "installed": True,
            "version": "2.8.3",
            "imports": True,
            "error": None,
            "runnable": True,
            "reason": "ok",
            "varlen_runnable": True,
            "varlen_reason": "flash_attn 2.8.3 varlen",
        },
        "torch_flash_varlen": {"available": True, "reason": "torch 2.11.0+cu130 varlen_attn"},
        "torch_cudnn_op": {"available": True, "reason": "ok"},
        "sdpa": {"function": True, "flash_enabled": True},
        "env": {},
        "cell": "cu130-torch2.11-py312",
    }


def cpu_report() -> dict:
    r = h100_report()
    r["torch"].update(
        version="2.13.0+cpu", cuda=None, cudnn=None, requires_triton=None, expected_triton="3.7.1"
    )
    r["gpus"], r["driver"] = [], {"version": None, "cuda": None}
    r["triton"].update(version="3.7.1")
    r["flash_attn"] = {
        "installed": False,
        "version": None,
        "imports": False,
        "error": "flash-attn is not installed",
        "runnable": False,
        "reason": "flash-attn is not installed",
        "varlen_runnable": False,
        "varlen_reason": "flash-attn is not installed",
    }
    r["torch_flash_varlen"] = {"available": False, "reason": "torch 2.13.0+cpu is a CPU build"}
    r["torch_cudnn_op"] = {"available": False, "reason": "no CUDA device"}
    return r


def gpu_machine_report() -> dict:
    """The lent GPU machine in full: torch 2.11.0+cu130 (FA-2 built in), no flash-attn, a healthy toolchain."""
    r = h100_report()
    r["torch"]["arch_list"] = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]
    r["flash_attn"] = copy.deepcopy(cpu_report()["flash_attn"])
    r["flash_attn"].update(archs=None, archs_error="flash-attn is not installed")
    r["torch_flash_op"] = {"available": True, "reason": "torch 2.11.0+cu130 _flash_attention_forward"}
    r["toolchain"] = {
        "cpus": 16,
        "mem_available_gib": 120.0,
        "env": {},
        "cc": {"path": "/usr/bin/gcc", "from": "PATH", "name": "gcc"},
        "python_h": {"include": "/usr/include/python3.12", "found": True},
        "cuda_home": {"path": "/usr/local/cuda", "from": "nvcc on PATH", "nvcc": "/usr/local/cuda/bin/nvcc",
                      "nvcc_version": "13.0", "headers": True, "toolkits": ["/usr/local/cuda", "/usr/local/cuda-13.0"]},
        "libcuda": {"from": "ldconfig -p", "so1_dirs": ["/usr/lib/x86_64-linux-gnu"], "so_dirs": []},
        "build_modules": {m: True for m in ("torch", "setuptools", "wheel", "packaging", "psutil", "ninja")},
        "glibc": "2.39",
        "wheel_glibc": {"torch": "2.28", "triton": "2.27", "numpy": "2.27"},
    }
    return r


def torch28_report() -> dict:
    """A CUDA 12.8 / torch 2.8 / Python 3.11 machine: upstream publishes a flash-attn wheel for it, and torch
    has no built-in FA-2 varlen, so flash-attn is what NSA's FA-2 paths need."""
    r = gpu_machine_report()
    r["python"]["version"] = "3.11.9"
    r["torch"].update(version="2.8.0+cu128", cuda="12.8", expected_triton="3.4.0",
                      arch_list=["sm_80", "sm_86", "sm_90", "sm_100", "sm_120"])
    r["triton"]["version"] = "3.4.0"
    r["torch_flash_op"] = r["torch_flash_varlen"] = {"available": False, "reason": "torch 2.8 has no varlen_attn"}
    r["driver"]["cuda"] = "12.8"
    r["toolchain"]["cuda_home"].update(nvcc_version="12.8", path="/usr/local/cuda-12.8")
    # triton 3.4 links -lcuda: the unversioned libcuda.so must be there too (a CUDA devel image has it).
    r["toolchain"]["libcuda"]["so_dirs"] = list(r["toolchain"]["libcuda"]["so1_dirs"])
    return r
