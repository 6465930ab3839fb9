"""Decode vs prefill on the GPU, and the torch backend on the GPU vs the fp64 oracle.

- nsa_prefill(P tokens) + nsa_decode steps on CUDA equal nsa_attention over the whole sequence on CUDA
  (bf16 and fp32), on every row whose selected blocks agree (fp32: all but a few rows; a block choice that
  flips on a near-tie changes the output legitimately);
- nsa_attention (backend "torch", and "auto", which may route branches to FA-2) on CUDA, with the block
  indices fixed to the oracle's, equals nsa.nsa_reference (float64 on CPU of the same rounded inputs),
  dense and packed (cu_seqlens).
Tolerances are max|diff| / max|ref|: fp32 5e-5, bf16 3e-2 (bf16 outputs carry 2^-8 rounding).
NSA_GPU_TEST_DEVICE=cpu runs the same checks on CPU (to check the test itself without a GPU).
"""

from __future__ import annotations

import os

import pytest
import torch

from nsa import NSACache, NSAConfig, nsa_attention, nsa_decode, nsa_prefill, nsa_reference

DEVICE = os.environ.get("NSA_GPU_TEST_DEVICE", "cuda")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
TOL = {torch.float32: 5e-5, torch.bfloat16: 3e-2}
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
CONFIGS = {
    "paper": NSAConfig(),  # l=32, d=16, l'=64, n=16, w=512
    "small": NSAConfig(block_cmp=16, stride_cmp=8, block_sel=16, n_sel=6, n_init=1, n_local=2, window=64),
}


def make_inputs(gen, B, T, Hq, Hkv, D, dtype):
    q = torch.randn(B, T, Hq, D, generator=gen)
    k = torch.randn(B, T, Hkv, D, generator=gen)
    v = torch.randn(B, T, Hkv, D, generator=gen)
    g = torch.rand(B, T, Hq, 3, generator=gen)
    return [x.to(DEVICE, dtype) for x in (q, k, v, g)]


def rel_err(got, want):
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    assert got.shape == want.shape, (got.shape, want.shape)
    if got.numel() == 0:
        return 0.0
    d = (got - want).abs().max()
    return float("inf") if torch.isnan(d) else float(d / want.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,B,T,P,Hq,Hkv,D", [
    ("small", 2, 200, 120, 8, 2, 32),   # window 64 wraps, many compressed-block completions while decoding
    ("paper", 1, 700, 640, 16, 2, 64),  # window 512 wraps during the decode steps
    ("small", 1, 90, 0, 4, 4, 16),      # every token decoded from an empty cache
])
def test_decode_matches_prefill_gpu(gen, dtype, name, B, T, P, Hq, Hkv, D):
    cfg = CONFIGS[name]
    q, k, v, g = make_inputs(gen, B, T, Hq, Hkv, D, dtype)
    full, full_idx = nsa_attention(q, k, v, g, cfg, return_indices=True)
    cache = NSACache(cfg, B, T, Hkv, D, D, device=DEVICE, dtype=dtype)
    outs, idxs = [], []
    if P:
        pre = nsa_prefill(q[:, :P], k[:, :P], v[:, :P], g[:, :P], cache)
        assert rel_err(pre, full[:, :P]) <= TOL[dtype]
    for t in range(P, T):
        o, i = nsa_decode(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1], cache, return_indices=True)
        assert o.device.type == torch.device(DEVICE).type and o.dtype == dtype
        outs.append(o)
        idxs.append(i)
    out, idx = torch.cat(outs, 1), torch.cat(idxs, 1)
    assert torch.isfinite(out.float()).all()
    same = (idx == full_idx[:, P:]).all(dim=-1).all(dim=-1)  # [B, T - P]: rows with identical blocks
    assert same.float().mean() >= (0.97 if dtype == torch.float32 else 0.85), "selection differs on many rows"
    assert rel_err(out[same], full[:, P:][same]) <= TOL[dtype]
    # The decoded rows are also the oracle's (same rounded inputs in float64), where the blocks agree.
    ref = nsa_reference(q, k, v, g, cfg)
    agree = (idx.cpu() == ref.indices[:, P:]).all(dim=-1).all(dim=-1)
    assert rel_err(out.cpu()[agree], ref.out[:, P:][agree]) <= TOL[dtype]


ORACLE_CASES = {
    # name: (config, B, T, Hq, Hkv, D, cu_seqlens). T > n_sel * block_sel in "paper": selection is sparse.
    "paper-dense": ("paper", 1, 1100, 4, 1, 64, None),
    "small-dense": ("small", 2, 300, 8, 2, 32, None),
    "small-varlen": ("small", 1, 300, 8, 2, 32, [0, 17, 100, 101, 260, 300]),  # short, 1-token, long sequences
    "paper-varlen": ("paper", 1, 1400, 2, 1, 128, [0, 1100, 1400]),
}
_ORACLE: dict = {}


def oracle_case(case, dtype):
    """Inputs (rounded to dtype, on CPU) and the fp64 oracle's result, computed once per case and dtype."""
    key = (case, dtype)
    if key not in _ORACLE:
        name, B, T, Hq, Hkv, D, cu = ORACLE_CASES[case]
        gen = torch.Generator().manual_seed(sum(map(ord, case)))
        xs = [torch.randn(B, T, Hq, D, generator=gen), torch.randn(B, T, Hkv, D, generator=gen),
              torch.randn(B, T, Hkv, D, generator=gen), torch.rand(B, T, Hq, 3, generator=gen)]
        xs = [x.to(dtype) for x in xs]
        cu_t = torch.tensor(cu, dtype=torch.int32) if cu is not None else None
        _ORACLE[key] = (xs, cu_t, nsa_reference(*xs, CONFIGS[name], cu_seqlens=cu_t))
    return _ORACLE[key]


@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(ORACLE_CASES))
def test_cuda_vs_fp64_oracle_fixed_indices(case, dtype, backend):
    cfg = CONFIGS[ORACLE_CASES[case][0]]
    xs, cu_cpu, ref = oracle_case(case, dtype)
    q, k, v, g = (x.to(DEVICE) for x in xs)
    cu_dev = cu_cpu.to(DEVICE) if cu_cpu is not None else None
    out = nsa_attention(q, k, v, g, cfg, cu_seqlens=cu_dev, block_indices=ref.indices.to(DEVICE), backend=backend)
    assert out.device.type == torch.device(DEVICE).type and out.dtype == dtype
    assert torch.isfinite(out.float()).all()
    assert rel_err(out, ref.out) <= TOL[dtype]
    if dtype == torch.float32:  # and without fixed indices the blocks picked are the oracle's
        got, idx = nsa_attention(q, k, v, g, cfg, cu_seqlens=cu_dev, backend=backend, return_indices=True)
        same = (idx.cpu() == ref.indices).all(dim=-1).all(dim=-1)
        assert same.float().mean() >= 0.97
        assert rel_err(got.cpu()[same], ref.out[same]) <= TOL[dtype]
