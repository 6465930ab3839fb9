"""Functional decode: prefill(T) equals prefill(T - k) followed by k nsa_decode steps.

float64 to 1e-12 (and the same block indices); the decoded outputs also equal the oracle. Cases cross
compressed-block completions (t with (t - l + 1) % d == 0), selection-block ends, wrap the window ring
(T > window) and start from an empty cache (T - k = 0).
"""

from __future__ import annotations

import pytest
import torch

from nsa import NSACache, NSAInputError, nsa_attention, nsa_decode, nsa_prefill, nsa_reference

from .helpers import PAPER, SMALL, make_inputs, rel_err

CASES = [
    # (config name, B, T, k decode steps, Hq, Hkv, Dk, Dv)
    ("l8d4s8n4", 2, 40, 40, 4, 2, 4, 6),  # T - k = 0: every token decoded, window 16 wraps
    ("l8d4s8n4", 1, 45, 13, 2, 1, 8, 4),
    ("l8d4s16n4i0", 2, 70, 31, 4, 1, 4, 4),
    ("l8d4s8n4i2l0", 1, 50, 49, 2, 2, 4, 8),  # prefill of one token
    ("l8d8s8n3i0l0", 2, 35, 20, 4, 4, 6, 4),
    ("l16d4s8n5i1l1", 1, 60, 30, 8, 2, 4, 4),
    ("paper", 1, 560, 24, 4, 1, 8, 4),  # window 512 wraps during the decode steps
    ("paper", 1, 100, 40, 16, 1, 8, 8),  # G = 16, crosses l = 32 completions at t = 47, 63, ...
]


def _cfg(name):
    return PAPER if name == "paper" else SMALL[name]


def _decode_all(q, k, v, g, cfg, P, *, dtype=torch.float64, **extra):
    """Prefill the first P tokens into a fresh cache, then decode the rest one at a time."""
    B, T, Hq, Dk = q.shape
    Hkv, Dv = k.shape[2], v.shape[3]
    cache = NSACache(cfg, B, T, Hkv, Dk, Dv, dtype=dtype)
    outs, idxs, n_cmp = [], [], []
    if P > 0:
        sl = lambda x: x[:, :P]  # noqa: E731
        ex = {n: (tuple(map(sl, val)) if n in ("kv_cmp", "kv_win") else val) for n, val in extra.items()}
        outs.append(nsa_prefill(sl(q), sl(k), sl(v), sl(g), cache, backend="torch", **ex))
        assert cache.length == P
    for t in range(P, T):
        sl = lambda x, t=t: x[:, t:t + 1]  # noqa: E731
        ex = {n: (tuple(map(sl, val)) if n in ("kv_cmp", "kv_win") else val) for n, val in extra.items()}
        o, i = nsa_decode(sl(q), sl(k), sl(v), sl(g), cache, return_indices=True, **ex)
        assert o.shape == (B, 1, Hq, Dv) and i.shape == (B, 1, Hkv, cfg.n_sel)
        outs.append(o)
        idxs.append(i)
        n_cmp.append(cache.n_cmp)
    return torch.cat(outs, dim=1), torch.cat(idxs, dim=1), n_cmp


@pytest.mark.parametrize("name,B,T,k_steps,Hq,Hkv,Dk,Dv", CASES)
def test_decode_equals_prefill_fp64(gen, name, B, T, k_steps, Hq, Hkv, Dk, Dv):
    cfg = _cfg(name)
    q, k, v, g = make_inputs(gen, B, T, Hq, Hkv, Dk, Dv)
    full, full_idx = nsa_attention(q, k, v, g, cfg, backend="torch", return_indices=True)
    P = T - k_steps
    out, idx, n_cmp = _decode_all(q, k, v, g, cfg, P)
    assert rel_err(out, full) <= 1e-12
    assert torch.equal(idx, full_idx[:, P:])
    # Compressed blocks complete exactly at t with t - l + 1 >= 0 and (t - l + 1) % d == 0.
    assert n_cmp == [cfg.n_cmp_blocks(t + 1) for t in range(P, T)]
    # And the decoded tokens are the oracle's.
    ref = nsa_reference(q, k, v, g, cfg)
    assert rel_err(out[:, P:], ref.out[:, P:]) <= 1e-10
    assert torch.equal(idx, ref.indices[:, P:])


def test_decode_fp32(gen):
    cfg = SMALL["l8d4s8n4"]
    q, k, v, g = make_inputs(gen, 2, 60, 4, 2, 8, 4, dtype=torch.float32)
    full, full_idx = nsa_attention(q, k, v, g, cfg, backend="torch", return_indices=True)
    out, idx, _ = _decode_all(q, k, v, g, cfg, 20, dtype=torch.float32)
    assert out.dtype == torch.float32
    same = (idx == full_idx[:, 20:]).all(dim=-1).all(dim=-1)  # [B, T - P] rows with identical blocks
    assert same.float().mean() >= 0.95
    assert rel_err(out[:, :20], full[:, :20]) <= 1e-6
    assert rel_err(out[:, 20:][same], full[:, 20:][same]) <= 1e-5


def test_decode_with_branch_kv_and_compress_fn(gen):
    cfg = SMALL["l8d4s8n4"].with_(compress="mlp")
    w = torch.randn(cfg.block_cmp, generator=gen, dtype=torch.float64)
    phi = (lambda x: torch.einsum("nlhd,l->nhd", x, w.to(x.dtype)),
           lambda x: torch.einsum("nlhd,l->nhd", x, w.to(x.dtype)).sin())
    q, k, v, g = make_inputs(gen, 1, 42, 4, 2, 4, 6)
    _, kc, vc, _ = make_inputs(gen, 1, 42, 4, 2, 4, 6)
    _, kw, vw, _ = make_inputs(gen, 1, 42, 4, 2, 4, 6)
    extra = dict(kv_cmp=(kc, vc), kv_win=(kw, vw), compress_fn=phi)
    ref = nsa_reference(q, k, v, g, cfg, **extra)
    out, idx, _ = _decode_all(q, k, v, g, cfg, 11, **extra)
    assert rel_err(out, ref.out) <= 1e-10
    assert torch.equal(idx, ref.indices[:, 11:])


def test_prefill_of_empty_prompt(gen):
    cfg = SMALL["l8d4s8n4"]
    q, k, v, g = make_inputs(gen, 1, 12, 2, 1, 4, 4)
    cache = NSACache(cfg, 1, 12, 1, 4, 4, dtype=torch.float64)
    o0 = nsa_prefill(q[:, :0], k[:, :0], v[:, :0], g[:, :0], cache, backend="torch")
    assert o0.shape == (1, 0, 2, 4) and cache.length == 0
    outs = [nsa_decode(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1], cache) for t in range(12)]
    assert rel_err(torch.cat(outs, 1), nsa_reference(q, k, v, g, cfg).out) <= 1e-10


def test_decode_bad_inputs(gen):
    cfg = SMALL["l8d4s8n4"]
    q, k, v, g = make_inputs(gen, 1, 4, 2, 1, 4, 4)
    cache = NSACache(cfg, 1, 3, 1, 4, 4, dtype=torch.float64)
    with pytest.raises(NSAInputError, match="T"):
        nsa_decode(q[:, :2], k[:, :2], v[:, :2], g[:, :2], cache)
    nsa_prefill(q[:, :3], k[:, :3], v[:, :3], g[:, :3], cache, backend="torch")
    with pytest.raises(NSAInputError, match="max_len"):
        nsa_decode(q[:, 3:], k[:, 3:], v[:, 3:], g[:, 3:], cache)
    with pytest.raises(NSAInputError, match="cache"):
        nsa_prefill(q[:, :1], k[:, :1], v[:, :1], g[:, :1], cache)
    with pytest.raises(NSAInputError, match="config"):
        nsa_decode(q[:, :1], k[:, :1], v[:, :1], g[:, :1], NSACache(cfg, 1, 8, 1, 4, 4, dtype=torch.float64),
                   config=cfg.with_(window=8))
    with pytest.raises(NSAInputError, match="k"):
        nsa_decode(q[:, :1], k[:, :1], v[:, :1], g[:, :1], NSACache(cfg, 1, 8, 2, 4, 4, dtype=torch.float64))


def test_decode_rejects_dtype_other_than_the_cache(gen):
    """float64 inputs into a float32 cache must be an error, not a silent cast (validation.py: never cast)."""
    cfg = SMALL["l8d4s8n4"]
    q, k, v, g = make_inputs(gen, 1, 1, 2, 1, 4, 4)
    cache = NSACache(cfg, 1, 8, 1, 4, 4)  # default dtype float32
    with pytest.raises(NSAInputError, match="dtype"):
        nsa_decode(q, k, v, g, cache)


def test_decode_bf16_within_tolerance(gen):
    """bf16: decode equals prefill within bf16 tolerance (2e-2 relative) on rows with the same blocks."""
    cfg = SMALL["l8d4s16n4i0"]
    q, k, v, g = make_inputs(gen, 1, 64, 4, 2, 8, 8, dtype=torch.bfloat16)
    full, full_idx = nsa_attention(q, k, v, g, cfg, backend="torch", return_indices=True)
    out, idx, _ = _decode_all(q, k, v, g, cfg, 24, dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    same = (idx == full_idx[:, 24:]).all(dim=-1).all(dim=-1)
    assert same.float().mean() >= 0.9
    assert rel_err(out[:, 24:][same], full[:, 24:][same]) <= 2e-2
