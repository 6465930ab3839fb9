"""Packed sequences (cu_seqlens): ragged and empty sequences equal independent per-sequence calls."""

from __future__ import annotations

import pytest
import torch

from nsa import nsa_attention, nsa_reference

from .helpers import PAPER, SMALL, make_inputs, rel_err, run_poisoned

CU = {
    "ragged-empty": [0, 0, 5, 38, 38, 108, 116, 117],
    "single": [0, 90],
    "trailing-empty": [0, 31, 64, 64, 64],
    "ones": [0, 1, 2, 3, 4, 5],
    "one-real": [0, 0, 0, 41, 41],
}

CASES = [
    # (cu name, config, Hq, Hkv, Dk, Dv)
    ("ragged-empty", SMALL["l8d4s8n4"], 4, 2, 4, 6),
    ("ragged-empty", SMALL["l16d4s8n5i1l1"], 2, 1, 8, 4),
    ("ragged-empty", PAPER, 4, 1, 8, 4),
    ("single", SMALL["l8d4s16n4i0"], 2, 2, 4, 4),
    ("trailing-empty", SMALL["l8d4s8n4i2l0"], 4, 2, 4, 6),
    ("ones", SMALL["l8d4s8n4"], 2, 1, 4, 4),
    ("one-real", SMALL["l8d8s8n3i0l0"], 4, 4, 4, 2),
]


def _per_sequence(fn, cu, *xs):
    """Run fn on every non-empty sequence alone ([1, L, ...]); return the list of results with bounds."""
    return [(s, e, fn(*(x[:, s:e] for x in xs))) for s, e in zip(cu, cu[1:]) if e > s]


@pytest.mark.parametrize("cu_name,cfg,Hq,Hkv,Dk,Dv", CASES)
def test_varlen_equals_per_sequence_calls(gen, cu_name, cfg, Hq, Hkv, Dk, Dv):
    cu = CU[cu_name]
    T = cu[-1]
    q, k, v, g = make_inputs(gen, 1, T, Hq, Hkv, Dk, Dv)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    out, idx = run_poisoned(nsa_attention, q, k, v, g, cfg, backend="torch", cu_seqlens=cu_t,
                            return_indices=True, chunk_size=13)
    ref = nsa_reference(q, k, v, g, cfg, cu_seqlens=cu_t)
    assert torch.equal(idx, ref.indices)
    assert rel_err(out, ref.out) <= 1e-10

    parts = _per_sequence(lambda *x: nsa_attention(*x, cfg, backend="torch", return_indices=True), cu, q, k, v, g)
    ref_parts = _per_sequence(lambda *x: nsa_reference(*x, cfg), cu, q, k, v, g)
    for (s, e, (o_s, i_s)), (_, _, r_s) in zip(parts, ref_parts):
        assert torch.equal(idx[:, s:e], i_s), (s, e)
        assert torch.equal(ref.indices[:, s:e], r_s.indices), (s, e)
        assert rel_err(out[:, s:e], o_s) <= 1e-12, (s, e)
        assert rel_err(ref.out[:, s:e], r_s.out) <= 1e-12, (s, e)
        assert rel_err(o_s, r_s.out) <= 1e-10


def test_varlen_fixed_indices_and_fp32(gen):
    cfg = SMALL["l8d4s8n4"]
    cu = CU["ragged-empty"]
    cu_t = torch.tensor(cu, dtype=torch.int32)
    q, k, v, g = make_inputs(gen, 1, cu[-1], 4, 2, 8, 4, dtype=torch.float32)
    ref = nsa_reference(q, k, v, g, cfg, cu_seqlens=cu_t)
    out = run_poisoned(nsa_attention, q, k, v, g, cfg, backend="torch", cu_seqlens=cu_t,
                       block_indices=ref.indices)
    assert rel_err(out, ref.out) <= 1e-5
    # Fixed indices are local to each sequence: the same per-sequence call with the same rows agrees.
    for s, e in zip(cu, cu[1:]):
        if e > s:
            o_s = nsa_attention(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], cfg, backend="torch",
                                block_indices=ref.indices[:, s:e])
            assert rel_err(out[:, s:e], o_s) <= 1e-5


def test_varlen_all_empty_but_zero_length(gen):
    """T = 0 packed (cu = [0, 0]): an empty result of the right shape, no error."""
    cfg = SMALL["l8d4s8n4"]
    q, k, v, g = make_inputs(gen, 1, 0, 2, 1, 4, 3)
    out, idx = nsa_attention(q, k, v, g, cfg, backend="torch", cu_seqlens=torch.tensor([0, 0], dtype=torch.int32),
                             return_indices=True)
    assert out.shape == (1, 0, 2, 3) and idx.shape == (1, 0, 1, cfg.n_sel)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)], ids=["fp64", "fp32"])
def test_packed_layout_keeps_the_last_compressed_block(gen, dtype, tol):
    """l == d and every length a multiple of d: the packed layout needs exactly T // d compressed slots, the
    last one the final block of the last sequence (whose last token sees it). Outputs, not only shapes,
    against the fp64 reference of each sequence alone."""
    cfg = SMALL["l8d8s8n3i0l0"]
    cu = [0, 16, 16, 40]  # an empty sequence between two whose last tokens complete a block; T = 40
    assert cfg.block_cmp == cfg.stride_cmp and cu[-1] % cfg.stride_cmp == 0
    q, k, v, g = make_inputs(gen, 1, cu[-1], 4, 2, 8, 4, dtype=dtype)
    out, idx = run_poisoned(nsa_attention, q, k, v, g, cfg, backend="torch",
                            cu_seqlens=torch.tensor(cu, dtype=torch.int32), return_indices=True)
    for s, e in zip(cu, cu[1:]):
        if e > s:
            ref = nsa_reference(*(x[:, s:e].double() for x in (q, k, v, g)), cfg)
            assert torch.equal(idx[:, s:e], ref.indices), (s, e)
            assert rel_err(out[:, s:e], ref.out) <= tol, (s, e)
