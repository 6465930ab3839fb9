"""Gradients of the torch backend (q, k, v and gates).

- torch.autograd.gradcheck on small float64 shapes (dense and varlen, with and without fixed indices,
  with and without chunking / activation checkpointing);
- where a branch covers everything, its gradients equal those of dense causal attention (autograd
  through a plain softmax written in the test);
- float32 / bfloat16 gradients against float64 gradients of the same (rounded) inputs, fixed indices;
- rows that see no compressed block (T < block_cmp) give finite gradients.
Tolerances (relative to the largest |fp64 gradient| of each input): fp32 1e-5, bf16 5e-2.
"""

from __future__ import annotations

import pytest
import torch

from nsa import NSAConfig, nsa_attention, nsa_reference

from .helpers import PAPER, SMALL, dense_causal_attention, make_inputs, rel_err

TINY = NSAConfig(block_cmp=4, stride_cmp=2, block_sel=4, n_sel=2, n_init=1, n_local=1, window=3)
FP32_GRAD_TOL = 1e-5
BF16_GRAD_TOL = 5e-2


def _fixed(gen, B, T, Hkv, cfg):
    idx = torch.randint(-1, cfg.n_sel_blocks(T) + 2, (B, T, Hkv, cfg.n_sel), generator=gen, dtype=torch.int32)
    idx[..., -1] = idx[..., 0]
    return idx


GRADCHECK_CASES = [
    # (name, config, T, Hq, Hkv, cu_seqlens, fixed indices, chunk)
    ("dense", SMALL["l8d4s8n4"].with_(window=4, n_sel=3), 14, 2, 1, None, False, None),
    ("dense-fixed", SMALL["l8d4s8n4"].with_(window=4, n_sel=3), 14, 2, 1, None, True, None),
    ("dense-chunked", TINY, 13, 2, 1, None, False, 5),
    ("dense-gqa", TINY, 11, 4, 2, None, False, None),
    ("no-cmp-block", SMALL["l8d4s8n4"], 6, 2, 1, None, False, None),
    ("varlen", TINY, 14, 2, 1, [0, 0, 5, 5, 14], False, None),
    ("varlen-fixed-chunked", TINY, 14, 2, 1, [0, 3, 14], True, 4),
]


@pytest.mark.parametrize("name,cfg,T,Hq,Hkv,cu,fixed,chunk", GRADCHECK_CASES, ids=[c[0] for c in GRADCHECK_CASES])
def test_gradcheck(gen, name, cfg, T, Hq, Hkv, cu, fixed, chunk):
    q, k, v, g = make_inputs(gen, 1, T, Hq, Hkv, 3, 2, requires_grad=True)
    cu_t = torch.tensor(cu, dtype=torch.int32) if cu is not None else None
    idx = _fixed(gen, 1, T, Hkv, cfg) if fixed else None

    def f(q, k, v, g):
        return nsa_attention(q, k, v, g, cfg, backend="torch", cu_seqlens=cu_t, block_indices=idx, chunk_size=chunk)

    # The forward is the oracle's function (so gradcheck checks the derivative of the right function).
    ref = nsa_reference(q, k, v, g, cfg, cu_seqlens=cu_t, block_indices=idx)
    assert rel_err(f(q, k, v, g), ref.out) <= 1e-10
    # Chunked runs recompute every chunk in the backward (checkpointing): check a random projection only.
    assert torch.autograd.gradcheck(f, (q, k, v, g), eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=chunk is not None)


@pytest.mark.parametrize("T", [1, 5, 7])
def test_no_compressed_block_gradients_are_finite(gen, T):
    """T < block_cmp: no row sees a compressed block; gradients are finite and the gate-cmp gradient is 0."""
    cfg = SMALL["l8d4s8n4"]
    q, k, v, g = make_inputs(gen, 2, T, 4, 2, 4, 4, requires_grad=True)
    out = nsa_attention(q, k, v, g, cfg, backend="torch")
    (out * torch.randn(out.shape, generator=gen, dtype=out.dtype)).sum().backward()
    for x in (q, k, v, g):
        assert torch.isfinite(x.grad).all()
    assert (g.grad[..., 0] == 0).all()


def test_partially_empty_rows_gradients_are_finite(gen):
    """T > l: rows t < l - 1 see no compressed block while later rows do; no NaN anywhere."""
    cfg = PAPER
    q, k, v, g = make_inputs(gen, 1, 70, 4, 1, 8, 8, dtype=torch.float32, requires_grad=True)
    out = nsa_attention(q, k, v, g, cfg, backend="torch", chunk_size=16)
    out.square().sum().backward()
    for x in (q, k, v, g):
        assert torch.isfinite(x.grad).all()
    assert (g.grad[0, : cfg.block_cmp - 1, :, 0] == 0).all() and (g.grad[0, cfg.block_cmp:, :, 0] != 0).any()


@pytest.mark.parametrize("branch", ["sel", "win"])
@pytest.mark.parametrize("cfg,T,Hq,Hkv", [(PAPER, 100, 4, 2), (SMALL["l8d4s8n4"].with_(window=40, n_sel=5), 40, 4, 1)])
def test_covering_branch_gradients_equal_dense(gen, branch, cfg, T, Hq, Hkv):
    q, k, v, _ = make_inputs(gen, 2, T, Hq, Hkv, 8, 6, requires_grad=True)
    g = torch.zeros(2, T, Hq, 3, dtype=torch.float64)
    g[..., 1 if branch == "sel" else 2] = 1
    g.requires_grad_()
    w = torch.randn(2, T, Hq, 6, generator=gen, dtype=torch.float64)
    out = nsa_attention(q, k, v, g, cfg, backend="torch", chunk_size=17)
    got = torch.autograd.grad((out * w).sum(), (q, k, v, g))
    dense = dense_causal_attention(q, k, v)
    want = torch.autograd.grad((dense * w).sum(), (q, k, v))
    for a, b in zip(got[:3], want):
        assert rel_err(a, b) <= 1e-10
    col = 1 if branch == "sel" else 2
    assert rel_err(got[3][..., col], (dense * w).sum(-1)) <= 1e-10


@pytest.mark.parametrize("chunk", [1, 7, "T"])
def test_gradients_independent_of_chunk_size(gen, chunk):
    cfg = SMALL["l8d4s8n4"]
    T = 45
    x = make_inputs(gen, 2, T, 4, 2, 4, 6, requires_grad=True)
    w = torch.randn(2, T, 4, 6, generator=gen, dtype=torch.float64)
    base = torch.autograd.grad((nsa_attention(*x, cfg, backend="torch", chunk_size=T) * w).sum(), x)
    got = torch.autograd.grad((nsa_attention(*x, cfg, backend="torch", chunk_size=T if chunk == "T" else chunk)
                               * w).sum(), x)
    for a, b in zip(got, base):
        assert rel_err(a, b) <= 1e-12


LOWP_CASES = [
    (SMALL["l8d4s8n4"], 2, 60, 4, 2, 8, 4),
    (PAPER, 1, 200, 4, 1, 16, 8),
]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, FP32_GRAD_TOL), (torch.bfloat16, BF16_GRAD_TOL)],
                         ids=["fp32", "bf16"])
@pytest.mark.parametrize("cfg,B,T,Hq,Hkv,Dk,Dv", LOWP_CASES)
def test_low_precision_gradients_match_fp64(gen, dtype, tol, cfg, B, T, Hq, Hkv, Dk, Dv):
    x = make_inputs(gen, B, T, Hq, Hkv, Dk, Dv, dtype=dtype)
    idx = nsa_reference(*x, cfg).indices
    w = torch.randn(B, T, Hq, Dv, generator=gen, dtype=torch.float64)
    lo = [z.clone().requires_grad_() for z in x]
    hi = [z.double().requires_grad_() for z in x]  # the same rounded values, in fp64
    out_lo = nsa_attention(*lo, cfg, backend="torch", block_indices=idx)
    out_hi = nsa_attention(*hi, cfg, backend="torch", block_indices=idx)
    g_lo = torch.autograd.grad((out_lo * w.to(dtype)).sum(), lo)
    g_hi = torch.autograd.grad((out_hi * w.to(dtype).double()).sum(), hi)
    for name, a, b in zip("qkvg", g_lo, g_hi):
        assert a.dtype == dtype, name
        assert rel_err(a, b) <= tol, name
