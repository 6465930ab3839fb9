"""Fixtures of the backend tests: emulated FA-2 providers installed into the planner through its test hooks
(nsa.hooks.HOOKS; CPU, fp64)."""

from __future__ import annotations

import pytest
import torch

from nsa import plan, telemetry
from nsa.hooks import HOOKS
from nsa.kernels.fa2.flash_attn import FlashAttnProvider
from nsa.kernels.fa2.torch_cudnn import TorchCudnnProvider
from nsa.kernels.fa2.torch_flash import TorchFlashProvider
from nsa.plan.providers import SdpaProvider

from . import fa2_emulation as emulate

ENV = ("NSA_USE_FA2", "NSA_USE_FA2_WIN", "NSA_USE_FA2_CMP", "NSA_FA2_MIN_LEN_WIN", "NSA_FA2_MIN_LEN_CMP",
       "NSA_FA2_FORCE", "NSA_FA2_FORCE_VARLEN", "NSA_FA2_FORCE_DENSE", "NSA_FA2_PREF_FP16", "NSA_DEBUG_TIMING",
       "NSA_SDPA_CHUNK", "NSA_USE_CUDNN", "NSA_TRITON_WINDOW", "NSA_TRITON_CMP_MAX_LEN", "NSA_TORCH_CHUNK_BUDGET")


def emulated(name: str, dtypes=(torch.float64, torch.float32, torch.float16, torch.bfloat16)):
    prov = (TorchFlashProvider(kernel=emulate.aten_flash_attention_forward) if name == "torch_flash"
            else FlashAttnProvider(module=emulate.FakeFlashAttnModule))
    prov.allow_cpu = True
    prov.kernel_dtypes = dtypes
    return prov


def emulated_cudnn(capability=(9, 0), dtypes=(torch.float64, torch.float32, torch.float16, torch.bfloat16)):
    """torch_cudnn on CPU: the emulated cuDNN op, a pretended GPU of `capability`."""
    prov = TorchCudnnProvider(kernel=emulate.aten_cudnn_attention, kernel_bwd=emulate.aten_cudnn_attention_backward)
    prov.allow_cpu = True
    prov.capability = capability
    prov.kernel_dtypes = dtypes
    prov.cudnn_version = 90100  # a cuDNN 9 without the wide head dims
    return prov


@pytest.fixture
def clean_env(monkeypatch):
    for var in ENV:
        monkeypatch.delenv(var, raising=False)
    telemetry.reset()
    yield monkeypatch
    telemetry.reset()


@pytest.fixture
def fakes(clean_env):
    """All three providers available on CPU: flash_attn and torch_flash emulated, sdpa real."""
    provs = {"flash_attn": emulated("flash_attn"), "torch_flash": emulated("torch_flash"), "sdpa": SdpaProvider()}
    provs["sdpa"].available_override = (True, "test")
    clean_env.setattr(HOOKS, "providers", provs)
    clean_env.setenv("NSA_FA2_MIN_LEN_WIN", "1")
    clean_env.setenv("NSA_FA2_MIN_LEN_CMP", "1")
    return provs


def counts() -> dict:
    return {(r["branch"], r["backend"], r["reason"]): r["calls"] for r in telemetry.snapshot()["counts"]}


def allow_fused(monkeypatch):
    """Emulated FA-2 providers for cmp/win, the Triton kernels allowed on CPU (Triton's interpreter, which the
    caller has made importable: tests/cpu/interp.py): "auto" plans the fused executor and its dense core."""
    providers = {"flash_attn": emulated("flash_attn"), "torch_flash": emulated("torch_flash"),
                 "sdpa": plan.PROVIDERS["sdpa"]}
    monkeypatch.setattr(HOOKS, "providers", providers)
    monkeypatch.setenv("NSA_FA2_MIN_LEN_WIN", "1")
    monkeypatch.setenv("NSA_FA2_MIN_LEN_CMP", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for prov in plan.TRITON.values():
        monkeypatch.setattr(prov, "allow_cpu", True)
    return monkeypatch
