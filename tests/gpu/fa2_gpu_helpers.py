"""Shared helpers of the GPU tests: inputs, per-branch outputs through one-hot gates, tolerances."""

from __future__ import annotations

import torch

from nsa import NSAConfig, nsa_attention, nsa_reference, telemetry

PAPER = NSAConfig()
SMALL = NSAConfig(block_cmp=32, stride_cmp=16, block_sel=64, n_sel=4, n_init=1, n_local=2, window=64)
TOL = {torch.float16: 4e-3, torch.bfloat16: 3e-2}
BRANCH_GATE = {"cmp": 0, "sel": 1, "win": 2}


def inputs(gen, B, T, Hq, Hkv, Dk, Dv, dtype, device="cuda", requires_grad=False):
    xs = [torch.randn(B, T, Hq, Dk, generator=gen, dtype=torch.float64),
          torch.randn(B, T, Hkv, Dk, generator=gen, dtype=torch.float64),
          torch.randn(B, T, Hkv, Dv, generator=gen, dtype=torch.float64)]
    xs = [x.to(device, dtype) for x in xs]
    if requires_grad:
        xs = [x.requires_grad_() for x in xs]
    return xs


def one_hot_gates(B, T, Hq, branch, dtype, device="cuda"):
    g = torch.zeros(B, T, Hq, 3, dtype=dtype, device=device)
    g[..., BRANCH_GATE[branch]] = 1
    return g


def cu_tensor(lengths, device="cuda"):
    import itertools

    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


def oracle(q, k, v, g, cfg, cu=None, idx=None):
    """fp64 reference on the CPU (nsa.reference): (out, indices)."""
    cpu = [x.detach().cpu().double() for x in (q, k, v, g)]
    res = nsa_reference(*cpu, cfg, cu_seqlens=None if cu is None else cu.cpu(),
                        block_indices=None if idx is None else idx.cpu())
    return res.out, res.indices


def branch_err(got, want):
    """max |got - want| / max(1, max |want|)."""
    got, want = got.detach().double().cpu(), want.double().cpu()
    return ((got - want).abs().max() / want.abs().max().clamp(min=1.0)).item() if want.numel() else 0.0


def assert_fa2_served(provider, branches=("cmp", "win"), forced=False, also=()):
    """Only `provider` (or one of `also`) served each of `branches`, with no fallback on them."""
    snap = telemetry.snapshot()
    for b in branches:
        served = telemetry.served(b)
        assert served and set(served) <= {provider, *also}, (f"{b} served by {served}, want only {provider}"
                                                             f"{' or ' + ', '.join(also) if also else ''}: "
                                                             f"{snap['counts']}")
    # Zero fallbacks on the branches under test (the sel branch has its own routing and thresholds).
    fallbacks = [r for r in snap["counts"] if r["branch"] in branches and not telemetry.is_normal(r["reason"])]
    assert not fallbacks, snap["counts"]


def run(q, k, v, g, cfg, backend, **kw):
    return nsa_attention(q, k, v, g, cfg, backend=backend, **kw)


def splitkv_refused(backend, q, v, cu=None) -> bool:
    """Whether forcing `backend` refuses this call's sliding branch: torch's FA-2 split-KV path at head dim
    192 writes past its LSE (nsa.plan.rules.check_splitkv), so small dense calls there raise NSAInputError."""
    from types import SimpleNamespace

    from nsa.plan import rules

    B, T, Hq, Dk = q.shape
    ctx = SimpleNamespace(B=B, T=T, Hq=Hq, Dk=Dk, Dv=v.shape[-1], packed=cu is not None, device=q.device)
    return rules.check_splitkv(SimpleNamespace(name=backend), "win", ctx) is not None


def run_unless_refused(q, k, v, g, cfg, backend, **kw):
    """run(), or None after checking that a call splitkv_refused() refuses raises NSAInputError naming why."""
    import pytest

    from nsa.validation import NSAInputError

    if splitkv_refused(backend, q, v, kw.get("cu_seqlens")):
        with pytest.raises(NSAInputError, match="splitkv_lse"):
            run(q, k, v, g, cfg, backend, **kw)
        return None
    return run(q, k, v, g, cfg, backend, **kw)
