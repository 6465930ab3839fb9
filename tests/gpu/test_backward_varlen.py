"""Gradients through the FA-2 providers (dense and varlen, fp16/bf16) vs the fp64 torch path on the GPU
(itself checked against the reference by the CPU suite), selection indices fixed."""

from __future__ import annotations

import pytest
import torch
from fa2_gpu_helpers import SMALL, cu_tensor, inputs, run, splitkv_refused

from nsa.validation import NSAInputError

pytestmark = pytest.mark.usefixtures("fa2_env")
GTOL = {torch.float16: 1e-2, torch.bfloat16: 6e-2}


def _grads(x, g, w, cfg, backend, cu, idx):
    out = run(*x, g, cfg, backend, cu_seqlens=cu, block_indices=idx)
    return torch.autograd.grad((out.float() * w).sum(), x)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("Dk,Dv", [(64, 64), (192, 128)])
def test_backward_matches(provider, gen, dtype, packed, Dk, Dv):
    lengths = [0, 40, 1, 170, 0, 33] if packed else None
    B, T = (1, sum(lengths)) if packed else (2, 160)
    Hq, Hkv = 8, 2
    cu = cu_tensor(lengths) if packed else None
    x = inputs(gen, B, T, Hq, Hkv, Dk, Dv, dtype, requires_grad=True)
    g = torch.rand(B, T, Hq, 3, generator=gen).to("cuda", dtype)
    w = torch.randn(B, T, Hq, Dv, generator=gen).cuda()
    x64 = [t.detach().double().requires_grad_() for t in x]
    _, idx = run(*[t.detach() for t in x64], g.double(), SMALL, "torch", cu_seqlens=cu, return_indices=True)
    want = _grads(x64, g.double(), w.double(), SMALL, "torch", cu, idx)
    if splitkv_refused(provider, x[0], x[2], cu):
        with pytest.raises(NSAInputError, match="splitkv_lse"):
            _grads(x, g, w, SMALL, provider, cu, idx)
        return
    got = _grads(x, g, w, SMALL, provider, cu, idx)
    for name, a, b in zip("qkv", got, want):
        assert torch.isfinite(a).all(), name
        err = ((a.double() - b).abs().max() / b.abs().max().clamp(min=1)).item()
        assert err < GTOL[dtype], (name, err)
