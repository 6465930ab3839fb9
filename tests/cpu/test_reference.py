"""The fp64 oracle (nsa.nsa_reference) against computations written independently here.

- dense causal attention (explicit triangular mask) where a branch covers everything: the sliding
  branch when window >= T, the selected branch when n_sel * block_sel >= T;
- hand-computed compressed-branch cases (T = l: one block, seen only by the last query);
- an explicit per-query, per-head loop over the semantics (nsa-semantics.md, steps 1-6) on small T.
"""

from __future__ import annotations

import math

import pytest
import torch

from nsa import NSAConfig, nsa_reference

from .helpers import PAPER, SMALL, dense_causal_attention, make_inputs, rel_err

TOL = 1e-12


# --------------------------------------------------------------------------------------------------
# An explicit loop over the semantics, one query and one head at a time (slow; small T only).
# --------------------------------------------------------------------------------------------------

def _softmax_attend(qv, keys, values, scale):
    """qv [D], keys [N, D], values [N, Dv] -> [Dv] and the probabilities [N]; N == 0 gives zeros."""
    if keys.shape[0] == 0:
        return values.new_zeros(values.shape[-1]), values.new_zeros(0)
    p = torch.softmax((keys @ qv) * scale, dim=0)
    return p @ values, p


def loop_nsa(q, k, v, g, cfg: NSAConfig, fixed=None):
    """One sequence, float64: q [T, Hq, Dk], k [T, Hkv, Dk], v [T, Hkv, Dv], g [T, Hq, 3].

    fixed: optional [T, Hkv, n] block ids replacing the top-n step (-1 ignored, repeats count once).
    Returns out, o_cmp, o_sel, o_win [T, Hq, Dv] and the chosen block lists [T][Hkv].
    """
    T, Hq, Dk = q.shape
    Hkv, Dv = k.shape[1], v.shape[2]
    G = Hq // Hkv
    scale = cfg.softmax_scale(Dk)
    l, d, ls, w = cfg.block_cmp, cfg.stride_cmp, cfg.block_sel, cfg.window
    cmp_blocks = []  # (first token, last token) of each compressed block
    i = 0
    while i * d + l <= T:
        cmp_blocks.append((i * d, i * d + l - 1))
        i += 1
    k_cmp = [k[a:b + 1].mean(dim=0) for a, b in cmp_blocks]  # each [Hkv, Dk]
    v_cmp = [v[a:b + 1].mean(dim=0) for a, b in cmp_blocks]
    n_blocks = math.ceil(T / ls)
    o = {name: torch.zeros(T, Hq, Dv, dtype=torch.float64) for name in ("cmp", "sel", "win")}
    chosen_all = []
    for t in range(T):
        scores = [[0.0] * n_blocks for _ in range(Hkv)]
        visible = [c for c, (a, b) in enumerate(cmp_blocks) if b <= t]
        for h in range(Hq):
            kh = h // G
            keys = torch.stack([k_cmp[c][kh] for c in visible]) if visible else q.new_zeros(0, Dk)
            vals = torch.stack([v_cmp[c][kh] for c in visible]) if visible else q.new_zeros(0, Dv)
            o["cmp"][t, h], p = _softmax_attend(q[t, h], keys, vals, scale)
            for c, pc in zip(visible, p.tolist()):
                a, b = cmp_blocks[c]
                for j in range(n_blocks):
                    if a < (j + 1) * ls and b >= j * ls:  # token ranges overlap
                        scores[kh][j] += pc
        chosen_t = []
        for kh in range(Hkv):
            if fixed is not None:
                chosen = sorted({int(j) for j in fixed[t, kh].tolist() if j >= 0})
            else:
                j_t = t // ls
                cands = list(range(j_t + 1))
                if len(cands) <= cfg.n_sel:
                    chosen = cands
                else:
                    forced = [j for j in cands if j < cfg.n_init or j_t - cfg.n_local < j <= j_t]
                    rest = sorted((j for j in cands if j not in forced), key=lambda j: (-scores[kh][j], j))
                    chosen = sorted(forced + rest[: cfg.n_sel - len(forced)])
            chosen_t.append(chosen)
        chosen_all.append(chosen_t)
        for h in range(Hq):
            kh = h // G
            toks = [u for u in range(t + 1) if u // ls in chosen_t[kh]]
            o["sel"][t, h], _ = _softmax_attend(q[t, h], k[toks, kh], v[toks, kh], scale)
            toks = list(range(max(0, t - w + 1), t + 1))
            o["win"][t, h], _ = _softmax_attend(q[t, h], k[toks, kh], v[toks, kh], scale)
    out = g[..., 0:1] * o["cmp"] + g[..., 1:2] * o["sel"] + g[..., 2:3] * o["win"]
    return out, o["cmp"], o["sel"], o["win"], chosen_all


def _indices_as_lists(idx):
    """[T, Hkv, n] int (-1 padded) -> [T][Hkv] lists; also checks ascending order and padding at the end."""
    rows = []
    for t in range(idx.shape[0]):
        row = []
        for h in range(idx.shape[1]):
            vals = idx[t, h].tolist()
            kept = [j for j in vals if j >= 0]
            assert vals == kept + [-1] * (len(vals) - len(kept)), f"t={t} h={h}: -1 padding not at the end: {vals}"
            assert kept == sorted(set(kept)), f"t={t} h={h}: not ascending/unique: {vals}"
            row.append(kept)
        rows.append(row)
    return rows


LOOP_CASES = [
    # (config name, T, Hq, Hkv, Dk, Dv)
    ("l8d4s8n4", 1, 2, 1, 4, 3),
    ("l8d4s8n4", 7, 2, 2, 4, 4),
    ("l8d4s8n4", 8, 4, 2, 4, 3),
    ("l8d4s8n4", 61, 4, 2, 5, 3),
    ("l8d4s16n4i0", 120, 4, 1, 4, 6),
    ("l8d4s8n4i2l0", 57, 2, 1, 4, 4),
    ("l8d8s8n3i0l0", 45, 4, 4, 3, 5),
    ("l16d4s8n5i1l1", 66, 4, 2, 4, 4),
]


@pytest.mark.parametrize("name,T,Hq,Hkv,Dk,Dv", LOOP_CASES)
def test_reference_matches_explicit_loop(gen, name, T, Hq, Hkv, Dk, Dv):
    cfg = SMALL[name]
    B = 2
    q, k, v, g = make_inputs(gen, B, T, Hq, Hkv, Dk, Dv)
    ref = nsa_reference(q, k, v, g, cfg)
    assert ref.indices.shape == (B, T, Hkv, cfg.n_sel) and ref.indices.dtype == torch.int32
    for b in range(B):
        out, o_cmp, o_sel, o_win, chosen = loop_nsa(q[b], k[b], v[b], g[b], cfg)
        assert _indices_as_lists(ref.indices[b]) == chosen
        for got, want in ((ref.o_cmp[b], o_cmp), (ref.o_sel[b], o_sel), (ref.o_win[b], o_win), (ref.out[b], out)):
            assert rel_err(got, want) <= TOL


def test_reference_ties_go_to_lower_index(gen):
    """q = 0: every visible compressed block gets the same probability, so many block scores tie."""
    cfg = SMALL["l8d4s8n4i2l0"].with_(n_init=0, n_sel=3)
    T = 64
    q, k, v, g = make_inputs(gen, 1, T, 2, 2, 4, 4)
    q = torch.zeros_like(q)
    ref = nsa_reference(q, k, v, g, cfg)
    *_, chosen = loop_nsa(q[0], k[0], v[0], g[0], cfg)
    assert _indices_as_lists(ref.indices[0]) == chosen
    # With equal probabilities, interior blocks (overlapped by 3 compressed blocks) outscore block 0
    # (overlapped by 2 only once more blocks exist); ties among interior blocks go to the lowest ids.
    assert chosen[T - 1][0] == [1, 2, 3]


def _messy_indices(gen, B, T, Hkv, n, n_blocks):
    """Random block ids with -1 padding, repeats, future blocks and ids past the last block."""
    idx = torch.randint(-1, n_blocks + 3, (B, T, Hkv, n), generator=gen, dtype=torch.int32)
    idx[..., -1] = idx[..., 0]  # a repeat in every row
    idx[:, ::3, :, 1] = -1
    idx[:, 1::5] = -1  # rows that select nothing at all
    return idx


@pytest.mark.parametrize("name,T,Hq,Hkv", [("l8d4s8n4", 40, 4, 2), ("l16d4s8n5i1l1", 33, 2, 1)])
def test_reference_fixed_indices_match_explicit_loop(gen, name, T, Hq, Hkv):
    cfg = SMALL[name]
    q, k, v, g = make_inputs(gen, 1, T, Hq, Hkv, 4, 3)
    fixed = _messy_indices(gen, 1, T, Hkv, cfg.n_sel, cfg.n_sel_blocks(T))
    ref = nsa_reference(q, k, v, g, cfg, block_indices=fixed)
    out, o_cmp, o_sel, o_win, chosen = loop_nsa(q[0], k[0], v[0], g[0], cfg, fixed=fixed[0])
    assert _indices_as_lists(ref.indices[0]) == chosen
    assert rel_err(ref.o_sel[0], o_sel) <= TOL
    assert rel_err(ref.out[0], out) <= TOL
    # Rows given nothing but -1 output exactly 0 in the selected branch.
    empty = (fixed[0] < 0).all(dim=-1)  # [T, Hkv]
    rows = empty.repeat_interleave(Hq // Hkv, dim=1)
    assert rows.any() and (ref.o_sel[0][rows] == 0).all()


# --------------------------------------------------------------------------------------------------
# Where a branch covers everything it is plain dense causal attention.
# --------------------------------------------------------------------------------------------------

COVER_CASES = [
    # (config, T, Hq, Hkv, Dk, Dv)
    (SMALL["l8d4s8n4"].with_(window=40, n_sel=5), 37, 2, 1, 8, 8),
    (SMALL["l8d4s16n4i0"].with_(window=64), 64, 4, 2, 6, 5),
    (SMALL["l8d4s8n4i2l0"].with_(window=16, n_sel=2), 16, 4, 4, 4, 7),
    (PAPER, 300, 16, 1, 12, 8),  # the paper's G = 16; w = 512 and n * l' = 1024 both cover T
    (PAPER, 65, 8, 2, 16, 8),
    (PAPER, 1, 4, 1, 8, 8),
]


@pytest.mark.parametrize("cfg,T,Hq,Hkv,Dk,Dv", COVER_CASES)
def test_covering_branches_equal_dense_causal_attention(gen, cfg, T, Hq, Hkv, Dk, Dv):
    assert cfg.window >= T and cfg.n_sel * cfg.block_sel >= T
    q, k, v, g = make_inputs(gen, 2, T, Hq, Hkv, Dk, Dv)
    dense = dense_causal_attention(q, k, v)
    ref = nsa_reference(q, k, v, g, cfg)
    assert rel_err(ref.o_win, dense) <= TOL
    assert rel_err(ref.o_sel, dense) <= TOL
    # Gate order is (cmp, sel, win): a one-hot gate on sel or win gives dense attention as the output.
    for which in (1, 2):
        onehot = torch.zeros_like(g)
        onehot[..., which] = 1
        assert rel_err(nsa_reference(q, k, v, onehot, cfg).out, dense) <= TOL


@pytest.mark.parametrize("T,w", [(50, 50), (50, 80), (70, 9)])
def test_window_branch_is_banded_attention(gen, T, w):
    cfg = SMALL["l8d4s8n4"].with_(window=w)
    q, k, v, g = make_inputs(gen, 1, T, 4, 2, 5, 6)
    want = dense_causal_attention(q, k, v, window=w)
    assert rel_err(nsa_reference(q, k, v, g, cfg).o_win, want) <= TOL


def test_selection_covering_via_top_n(gen):
    """n * l' >= T but window small: the selected branch alone is still full causal attention."""
    cfg = NSAConfig(block_cmp=8, stride_cmp=4, block_sel=8, n_sel=6, n_init=1, n_local=1, window=4)
    q, k, v, g = make_inputs(gen, 1, 48, 2, 2, 4, 4)
    ref = nsa_reference(q, k, v, g, cfg)
    assert rel_err(ref.o_sel, dense_causal_attention(q, k, v)) <= TOL
    assert rel_err(ref.o_win, dense_causal_attention(q, k, v)) > 1e-3  # the window does not cover


# --------------------------------------------------------------------------------------------------
# Compressed branch by hand.
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cfg", [PAPER, SMALL["l8d4s8n4"], SMALL["l16d4s8n5i1l1"]], ids=["paper", "l8", "l16"])
def test_compressed_single_block_by_hand(gen, cfg):
    """T = l: one block (the mean of all tokens), seen by the last query only, with probability 1."""
    T, Hq, Hkv = cfg.block_cmp, 4, 2
    q, k, v, g = make_inputs(gen, 1, T, Hq, Hkv, 8, 5)
    ref = nsa_reference(q, k, v, g, cfg)
    assert (ref.o_cmp[0, : T - 1] == 0).all()
    want = v[0].mean(dim=0).repeat_interleave(Hq // Hkv, dim=0)  # [Hq, Dv], head h reads KV head h // G
    assert rel_err(ref.o_cmp[0, T - 1], want) <= TOL


@pytest.mark.parametrize("cfg", [PAPER, SMALL["l8d4s8n4"]], ids=["paper", "l8"])
def test_no_compressed_block_gives_exact_zero(gen, cfg):
    T = cfg.block_cmp - 1
    q, k, v, g = make_inputs(gen, 2, T, 2, 1, 8, 8)
    ref = nsa_reference(q, k, v, g, cfg)
    assert (ref.o_cmp == 0).all()
    assert torch.isfinite(ref.out).all()


def test_compressed_two_blocks_by_hand(gen):
    """T = l + d: blocks [0, l) and [d, l + d); query l-1 sees the first, query l+d-1 sees both."""
    cfg = SMALL["l8d4s8n4"]
    l, d = cfg.block_cmp, cfg.stride_cmp
    T = l + d
    q, k, v, g = make_inputs(gen, 1, T, 1, 1, 4, 3)
    ref = nsa_reference(q, k, v, g, cfg)
    k0, k1 = k[0, :l, 0].mean(0), k[0, d:l + d, 0].mean(0)
    v0, v1 = v[0, :l, 0].mean(0), v[0, d:l + d, 0].mean(0)
    for t in range(T):
        got = ref.o_cmp[0, t, 0]
        if t < l - 1:
            assert (got == 0).all()
        elif t < l + d - 1:
            assert rel_err(got, v0) <= TOL
        else:
            s0, s1 = (q[0, t, 0] @ k0 / 2), (q[0, t, 0] @ k1 / 2)  # scale 1/sqrt(4)
            p0 = 1 / (1 + math.exp(float(s1 - s0)))
            assert rel_err(got, p0 * v0 + (1 - p0) * v1) <= TOL


def test_explicit_scale_is_used(gen):
    cfg = SMALL["l8d4s8n4"].with_(window=32, scale=0.3)
    q, k, v, g = make_inputs(gen, 1, 20, 2, 1, 4, 4)
    ref = nsa_reference(q, k, v, g, cfg)
    assert rel_err(ref.o_win, dense_causal_attention(q, k, v, scale=0.3)) <= TOL
