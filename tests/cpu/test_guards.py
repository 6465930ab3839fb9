"""Every FA-2 guard: device / SM policy, dtype policy, head dim per SM, cu_seqlens contract, min length,
contiguity (copied and counted)."""

from __future__ import annotations

import json

import pytest
import torch

from nsa import NSAInputError, nsa_attention, telemetry
from nsa.branches.fa2_call import last_dim_contiguous
from nsa.plan import rules as guards
from nsa.toggles import Toggles

from . import backend_fakes
from .helpers import SMALL, make_inputs

clean_env = backend_fakes.clean_env
counts = backend_fakes.counts
fakes = backend_fakes.fakes

T0 = Toggles()
CUDA = torch.device("cuda")


@pytest.mark.parametrize("cap,force,want", [((7, 5), False, "sm_unsupported"), ((7, 5), True, "sm_unsupported"),
                                            ((8, 9), False, "ada_policy"), ((8, 9), True, None),
                                            ((8, 0), False, None), ((9, 0), False, None), ((10, 0), False, None)])
def test_device_policy(cap, force, want):
    fail = guards.check_device(CUDA, Toggles(force=force), cap)
    assert (fail.reason if fail else None) == want


def test_cpu_tensors_are_not_cuda():
    assert guards.check_device(torch.device("cpu"), T0).reason == "not_cuda"


@pytest.mark.parametrize("dtype,pref,want,reason", [
    (torch.float16, None, torch.float16, None), (torch.bfloat16, None, torch.bfloat16, None),
    (torch.float32, None, None, "dtype"), (torch.float32, True, torch.float16, None),
    (torch.float32, False, torch.bfloat16, None), (torch.float64, True, None, "dtype")])
def test_dtype_policy(dtype, pref, want, reason):
    got, fail = guards.kernel_dtype(dtype, Toggles(pref_fp16=pref))
    assert got == want and (fail.reason if fail else None) == reason


@pytest.mark.parametrize("dk,dv,cap,grad,force,want", [
    (64, 64, (9, 0), True, False, None), (128, 128, (8, 0), True, False, None),
    (192, 128, (9, 0), True, False, None), (256, 256, (9, 0), True, False, None),
    (256, 256, (8, 0), True, False, None), (256, 256, (8, 6), True, False, "head_dim_sm"),
    (256, 256, (8, 9), True, True, None), (256, 256, (8, 6), False, False, None),
    (192, 192, (8, 6), True, False, None), (100, 100, (9, 0), False, False, "head_dim"),
    (264, 264, (9, 0), False, False, "head_dim"), (64, 320, (9, 0), False, False, "head_dim")])
def test_head_dim_per_sm(dk, dv, cap, grad, force, want):
    fail = guards.check_head_dim(dk, dv, cap, grad, Toggles(force=force))
    assert (fail.reason if fail else None) == want


def _cu(vals, dtype=torch.int32):
    return torch.tensor(vals, dtype=dtype)


@pytest.mark.parametrize("cu,host,total,ok", [
    (_cu([0, 3, 3, 10]), [0, 3, 3, 10], 10, True),
    (_cu([0, 3, 10], torch.int64), [0, 3, 10], 10, False),
    (_cu([1, 3, 10]), [1, 3, 10], 10, False),
    (_cu([0, 5, 3, 10]), [0, 5, 3, 10], 10, False),
    (_cu([0, 3, 9]), [0, 3, 9], 10, False),
    (_cu([0]), [0], 0, False),
    (_cu([[0, 10]]), [0, 10], 10, False),
    (_cu([0, 3, 10]), None, 10, False),
    (_cu([0, 3, 10]), [0, 3], 10, False),
    (_cu([0, 0, 3, 0, 10])[::2], [0, 3, 10], 10, False),  # not contiguous
])
def test_cu_seqlens_contract(cu, host, total, ok):
    fail = guards.check_cu_seqlens(cu, host, total, torch.device("cpu"))
    assert (fail is None) == ok, fail
    if fail:
        assert fail.reason == "cu_seqlens"


def test_cu_seqlens_wrong_device():
    fail = guards.check_cu_seqlens(_cu([0, 4]), [0, 4], 4, torch.device("meta"))
    assert fail.reason == "cu_seqlens" and "meta" in fail.message


def test_min_len_sources(tmp_path, clean_env):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"default": {"win": 100, "cmp": 200},
                                "entries": [{"gpu_class": "sm90", "head_dim": 128, "win": 4096, "cmp": 2048}]}))
    assert guards.min_len("win", 128, (9, 0), T0, path) == (4096, "fa2_thresholds.json sm90 D=128")
    assert guards.min_len("cmp", 64, (9, 0), T0, path)[0] == 200
    assert guards.min_len("cmp", 128, (8, 0), T0, path)[0] == 200
    assert guards.min_len("win", 128, (9, 0), Toggles(min_len_win=7), path) == (7, "NSA_FA2_MIN_LEN_WIN")
    assert guards.check_min_len("win", 4095, 128, (9, 0), T0, path).reason == "below_min_len"
    assert guards.check_min_len("win", 4096, 128, (9, 0), T0, path) is None


def test_shipped_thresholds_file_is_valid():
    t = guards.thresholds()
    assert t["schema"] == "nsa-fa2-thresholds/1" and t["default"]["measured"] is False
    assert guards.min_len("win", 128, None, T0)[0] == t["default"]["win"]


def test_contiguity_copy_is_counted(clean_env):
    x = torch.randn(2, 3, 8)[..., ::2]
    y = last_dim_contiguous(x, "win", "torch_flash")
    assert y.stride(-1) == 1 and torch.equal(x, y)
    assert telemetry.snapshot()["events"] == [{"branch": "win", "backend": "torch_flash",
                                               "event": "contiguous_copy", "calls": 1}]
    z = torch.randn(2, 3, 8).transpose(0, 1)  # strided but last dim contiguous: no copy
    assert last_dim_contiguous(z, "win", "torch_flash") is z


def test_noncontiguous_inputs_through_a_provider(fakes, gen):
    cfg = SMALL["l8d4s8n4"]
    q, k, v, g = make_inputs(gen, 1, 30, 4, 2, 16, 16)
    buf = torch.zeros(*q.shape[:-1], 2 * q.shape[-1], dtype=q.dtype)
    buf[..., ::2] = q
    qs = buf[..., ::2]  # stride 2 in the last dim
    assert torch.equal(qs, q) and qs.stride(-1) == 2
    torch.testing.assert_close(nsa_attention(qs, k, v, g, cfg, backend="torch_flash"),
                               nsa_attention(q, k, v, g, cfg, backend="torch"), rtol=1e-12, atol=1e-12)
    ev = {(e["branch"], e["event"]) for e in telemetry.snapshot()["events"]}
    assert ("win", "contiguous_copy") in ev


def test_force_dense_with_packed_input(fakes, gen, clean_env):
    clean_env.setenv("NSA_FA2_FORCE_DENSE", "1")
    q, k, v, g = make_inputs(gen, 1, 20, 2, 1, 16, 16)
    cu = _cu([0, 7, 20])
    with pytest.raises(NSAInputError, match="force_dense_packed"):
        nsa_attention(q, k, v, g, SMALL["l8d4s8n4"], cu_seqlens=cu, backend="torch_flash")
    nsa_attention(q, k, v, g, SMALL["l8d4s8n4"], cu_seqlens=cu)
    assert counts()[("win", "sdpa", "force_dense_packed")] == 1


def test_ada_policy_through_router(fakes, gen, clean_env):
    for p in ("flash_attn", "torch_flash"):
        fakes[p].capability = (8, 9)
    q, k, v, g = make_inputs(gen, 1, 20, 2, 1, 16, 16)
    nsa_attention(q, k, v, g, SMALL["l8d4s8n4"])
    assert counts()[("cmp", "sdpa", "ada_policy")] == 1
    clean_env.setenv("NSA_FA2_FORCE", "1")
    nsa_attention(q, k, v, g, SMALL["l8d4s8n4"])
    assert counts()[("cmp", "flash_attn", "ok")] == 1


def test_splitkv_guard_keeps_head_dim_192_windows_off_torchs_split_kv_path(monkeypatch):
    """torch's FA-2 split-KV combine writes past the LSE at head dim 192: small dense window calls on
    torch_flash take the next provider (reason splitkv_lse); large ones, other head dims, the compressed
    branch, packed input and other providers are untouched."""
    from types import SimpleNamespace

    from nsa.plan import rules

    monkeypatch.setattr(rules, "sm_count", lambda device: 132)
    flash, other = SimpleNamespace(name="torch_flash"), SimpleNamespace(name="flash_attn")

    def ctx(T, Dk=192, Dv=128, B=1, Hq=1, packed=False):
        return SimpleNamespace(T=T, Dk=Dk, Dv=Dv, B=B, Hq=Hq, packed=packed, device=torch.device("cuda"))

    assert rules.check_splitkv(flash, "win", ctx(65)).reason == "splitkv_lse"
    assert rules.check_splitkv(flash, "win", ctx(64 * 263)) is not None  # 263 row blocks < 264
    assert rules.check_splitkv(flash, "win", ctx(64 * 264)) is None
    assert rules.check_splitkv(flash, "win", ctx(65, B=2, Hq=132)) is None
    assert rules.check_splitkv(flash, "win", ctx(65, Dk=128)) is None
    assert rules.check_splitkv(flash, "cmp", ctx(65)) is None
    assert rules.check_splitkv(flash, "win", ctx(65, packed=True)) is None
    assert rules.check_splitkv(other, "win", ctx(65)) is None
    assert rules.check_splitkv(flash, "win", ctx(64)) is None  # one key block: never split
