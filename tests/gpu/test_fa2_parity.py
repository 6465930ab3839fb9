"""FA-2 providers (dense input) vs the fp64 reference, per branch (one-hot gates), fp16 and bf16; and
backend="auto" served by FA-2 with zero fallbacks."""

from __future__ import annotations

import pytest
import torch
from fa2_gpu_helpers import (
    PAPER,
    SMALL,
    TOL,
    assert_fa2_served,
    branch_err,
    inputs,
    one_hot_gates,
    oracle,
    run,
    run_unless_refused,
)

pytestmark = pytest.mark.usefixtures("fa2_env")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("T,Hq,Hkv,Dk,Dv", [(1, 4, 1, 64, 64), (20, 4, 2, 64, 64), (200, 8, 2, 128, 128),
                                            (333, 16, 1, 192, 128)])
@pytest.mark.parametrize("branch", ["cmp", "win"])
def test_branch_parity_dense(provider, gen, dtype, T, Hq, Hkv, Dk, Dv, branch):
    q, k, v = inputs(gen, 2, T, Hq, Hkv, Dk, Dv, dtype)
    g = one_hot_gates(2, T, Hq, branch, dtype)
    want, idx = oracle(q, k, v, g, SMALL)
    got = run_unless_refused(q, k, v, g, SMALL, provider, block_indices=idx.cuda())
    if got is None:
        return
    assert torch.isfinite(got).all()
    assert branch_err(got, want) < TOL[dtype], branch_err(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_full_output_and_auto_routing(provider, gen, dtype, fa2_env):
    if provider != "flash_attn":  # auto prefers flash_attn when installed
        from nsa import plan

        if plan.PROVIDERS["flash_attn"].availability(torch.device("cuda"), False)[0]:
            pytest.skip("flash_attn installed: auto routes there")
    T, Hq, Hkv = 300, 16, 2
    q, k, v = inputs(gen, 1, T, Hq, Hkv, 128, 128, dtype)
    g = torch.rand(1, T, Hq, 3, generator=gen).to("cuda", dtype)
    want, idx = oracle(q, k, v, g, PAPER.with_(window=128))
    got = run(q, k, v, g, PAPER.with_(window=128), "auto", block_indices=idx.cuda())
    assert branch_err(got, want) < TOL[dtype]
    # auto on Hopper: the dense core runs the window on NSA's Triton kernels (tests/gpu/test_window_gpu.py)
    assert_fa2_served(provider, branches=("win",), also=("triton_window",))
    # dense D=128 on sm 9.0+: the compressed branch goes to cuDNN attention first (nsa.kernels.fa2.torch_cudnn)
    assert_fa2_served("torch_cudnn" if torch.cuda.get_device_capability() >= (9, 0) else provider, branches=("cmp",))


def test_cmp_lse_gives_reference_indices(provider, gen):
    """Selection from the FA-2 LSE: index agreement with the fp64 reference (near-ties may differ)."""
    T = 512
    q, k, v = inputs(gen, 1, T, 8, 2, 128, 128, torch.bfloat16)
    g = one_hot_gates(1, T, 8, "sel", torch.bfloat16)
    _, idx_ref = oracle(q, k, v, g, SMALL)
    _, idx = run(q, k, v, g, SMALL, provider, return_indices=True)
    agree = (idx.cpu().sort(-1).values == idx_ref.sort(-1).values).float().mean().item()
    assert agree > 0.97, agree
