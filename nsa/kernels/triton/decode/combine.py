"""Launch 5 of a decode step (grid B*Hkv x Dv tiles): merges each branch's partials, applies the gates,
writes o and publishes cache_seqlens[b] = t + 1 (the only write to the lengths).

EARLY (Tuning.early_combine; the plan's default where the combine has at most 2 programs per SM): the launch
starts while the selection programs run and merges the compressed and window partials before it waits for
theirs (nsa.kernels.triton.decode.workspace.plan_combine has the measurements).

Many small programs, not one per (b, KV head): folding this launch into the selection launch, where the last
program of each (b, KV head) to finish (an atomic ticket) merged all its partials, measured twice as slow
(H100, paper heads, bf16, CUDA-graph replay: 64k x 8 60.6 -> 120.5 us, 8k x 8 30.5 -> 80.7; 106-128 us at
64k x 8 with 16-64 columns per pass): one program's serial merge of 23 partials x 128 columns costs more than
this launch, whose 512 programs each merge 8 columns. Nor was a flat row per (head, column), partials loaded
as [chunk, G x 8] tiles with each head's max and sum repeated over its columns, faster: 64k x 8 this launch
6.4 -> 13.5 us, 64k x 32 8.9 -> 27.3. Launched without PDL (after the selection launch has
completed) it ends no sooner: 64k x 8 61.1-61.7 us per step with PDL, 61.9-64.8 without."""

from __future__ import annotations

import triton
import triton.language as tl

from .parts import _load_parts, _merge_parts, _wait_previous


@triton.jit
def _combine_kernel(
    POS, SEQ, PM, PL, PACC, GATES, OUT,
    sg_b, sg_h, sg_c, so_b, so_h, Hkv, G, Dv, n_parts, n_cmp_parts, n_win_parts,
    BLOCK_G: tl.constexpr, BLOCK_DV: tl.constexpr, DV_TILE: tl.constexpr, CHUNK_CMP: tl.constexpr,
    CHUNK_WIN: tl.constexpr, CHUNK_SEL: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr = False,
):
    bh = tl.program_id(0).to(tl.int64)
    dt = tl.program_id(1)
    b = bh // Hkv
    h = bh % Hkv
    rg = tl.arange(0, BLOCK_G)
    rdv = dt * DV_TILE + tl.arange(0, DV_TILE)
    g_ok = rg < G
    dv_ok = rdv < Dv
    heads = h * G + rg
    gp = GATES + b * sg_b + heads * sg_h
    g_cmp = tl.load(gp, mask=g_ok, other=0.0).to(tl.float32)
    g_sel = tl.load(gp + sg_c, mask=g_ok, other=0.0).to(tl.float32)
    g_win = tl.load(gp + 2 * sg_c, mask=g_ok, other=0.0).to(tl.float32)
    p1 = n_cmp_parts + n_win_parts
    if EARLY:
        # Launched as the selection programs start (they let it start right after their own wait), not as they
        # end: the compressed and window partials (earlier launches, complete before the selection programs'
        # wait returned) are merged while the selection runs; after the wait only its partials remain.
        mc, lc, ac = _load_parts(PM, PL, PACC, bh, n_parts, 0, n_cmp_parts, rg, rdv, dv_ok, BLOCK_G, BLOCK_DV,
                                 CHUNK_CMP)
        mw, lw, aw = _load_parts(PM, PL, PACC, bh, n_parts, n_cmp_parts, p1, rg, rdv, dv_ok, BLOCK_G, BLOCK_DV,
                                 CHUNK_WIN)
        o_cmp = _merge_parts(PM, PL, PACC, bh, n_parts, 0, n_cmp_parts, mc, lc, ac, rg, rdv, dv_ok, BLOCK_G, DV_TILE,
                             BLOCK_DV, CHUNK_CMP)
        o_win = _merge_parts(PM, PL, PACC, bh, n_parts, n_cmp_parts, p1, mw, lw, aw, rg, rdv, dv_ok, BLOCK_G,
                             DV_TILE, BLOCK_DV, CHUNK_WIN)
        _wait_previous(PDL)
        ms, ls, as_ = _load_parts(PM, PL, PACC, bh, n_parts, p1, n_parts, rg, rdv, dv_ok, BLOCK_G, BLOCK_DV,
                                  CHUNK_SEL)
    else:
        _wait_previous(PDL)  # the partials of the selection launch (the gates are a step input)
        # The first chunk of each branch's partials [cmp | win | sel] is loaded before any arithmetic: one memory
        # round trip for the three (usually every partial), not one per branch; the merge is latency-bound.
        mc, lc, ac = _load_parts(PM, PL, PACC, bh, n_parts, 0, n_cmp_parts, rg, rdv, dv_ok, BLOCK_G, BLOCK_DV,
                                 CHUNK_CMP)
        mw, lw, aw = _load_parts(PM, PL, PACC, bh, n_parts, n_cmp_parts, p1, rg, rdv, dv_ok, BLOCK_G, BLOCK_DV,
                                 CHUNK_WIN)
        ms, ls, as_ = _load_parts(PM, PL, PACC, bh, n_parts, p1, n_parts, rg, rdv, dv_ok, BLOCK_G, BLOCK_DV,
                                  CHUNK_SEL)
        o_cmp = _merge_parts(PM, PL, PACC, bh, n_parts, 0, n_cmp_parts, mc, lc, ac, rg, rdv, dv_ok, BLOCK_G,
                             DV_TILE, BLOCK_DV, CHUNK_CMP)
        o_win = _merge_parts(PM, PL, PACC, bh, n_parts, n_cmp_parts, p1, mw, lw, aw, rg, rdv, dv_ok, BLOCK_G,
                             DV_TILE, BLOCK_DV, CHUNK_WIN)
    # Both paths add the same sums in the same order, so they give the same bits.
    o_sel = _merge_parts(PM, PL, PACC, bh, n_parts, p1, n_parts, ms, ls, as_, rg, rdv, dv_ok, BLOCK_G, DV_TILE,
                         BLOCK_DV, CHUNK_SEL)
    o = g_cmp[:, None] * o_cmp + g_sel[:, None] * o_sel + g_win[:, None] * o_win
    tl.store(OUT + b * so_b + heads[:, None] * so_h + rdv[None, :], o.to(OUT.dtype.element_ty),
             mask=g_ok[:, None] & dv_ok[None, :])
    if h == 0:
        if dt == 0:
            tl.store(SEQ + b, tl.load(POS + b) + 1)
