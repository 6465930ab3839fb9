"""Launch 4 of a decode step (grid (n_split_sel + n_split_win) x B*Hkv): each selection program merges the
chunks' candidates with the forced blocks and attends its share of the selected blocks (program 0 writes
the indices); the window programs attend their share of the window ring."""

from __future__ import annotations

import triton
import triton.language as tl

from .parts import (
    _attend_tile,
    _let_next_start,
    _query_tile,
    _store_partial,
    _token_row,
    _wait_previous,
    _window_partial,
)


@triton.jit
def _merge_candidates(CAND, bh, t, n_cand, BLOCK_SEL: tl.constexpr, N_INIT: tl.constexpr, N_LOCAL: tl.constexpr,
                      N_SEL: tl.constexpr, N_PAD: tl.constexpr, NC_PAD: tl.constexpr):
    """The selected blocks of one (b, KV head) [N_PAD]: the forced ones (first n_init, the n_local ending at
    t // l') and the best of the chunks' candidates (the global top-n of the candidates is the top-n of the
    chunks' top-n), ascending, -1 padded."""
    jt = t // BLOCK_SEL
    a = tl.minimum(jt + 1, N_INIT)  # forced blocks: [0, a) and [c0, jt]
    c0 = tl.maximum(a, jt - N_LOCAL + 1)
    n_forced = a + tl.maximum(jt - c0 + 1, 0)
    need = N_SEL - n_forced
    rk = tl.arange(0, N_PAD)
    sel = tl.where(rk < a, rk.to(tl.int64), -1)
    sel = tl.where((rk >= a) & (rk < n_forced), c0 + rk - a, sel)
    # The best `need` candidates, one per round (keys are unique; -1 = none). Neither a rank-based merge
    # (all pairs compared) nor four winners per round (a top-4 reduction) measured faster for the 272
    # candidates of a 64k context: the selection program's time goes to its memory round trips. Nor did
    # tl.sort (bitonic) of the padded 512 keys: H100, paper heads, 64k x 8, this launch 17.3 -> 49.8 us. The
    # merge is about 3 us of the launch's 17 (without it, blocks fixed: 14.4 us); the attention about 7. Nor did
    # ranking the first 4 candidates of every chunk all against all (exact where no chunk holds more than 4 of
    # the winners, else these rounds): [32, 256] int64 comparison tiles per step of 32, 64k x 8 merge 5.9 ->
    # 40 us per program, 64k x 1 4.4 -> 17 (per-program timestamps; the check held in every program). Nor did
    # tl.topk (a bitonic top-16) of the padded keys: steps 64k x 8 60.8 -> 61.2 us, 64k x 1 21.0 -> 21.9, 64k x 32
    # 180.4 -> 186.3; only 8k x 8, with an eighth as many candidates, gained (30.2 -> 29.2). Nor did giving each
    # program its slots of the rank order (forced blocks, then the free ones best first), so that it merges only
    # as far as its own slots and the first programs load while the last still merge: steps 64k x 8 58.7 / 58.4
    # -> 57.4 / 57.2 us and 128k x 8 92.4 / 92.5 -> 91.2 / 92.3, but 64k x 1 20.2 / 20.1 -> 20.5 / 20.9 and 64k x 32
    # 180.9 / 180.4 -> 182.0 / 182.7 (old and new code alternating).
    rc = tl.arange(0, NC_PAD)
    keys = tl.load(CAND + bh * n_cand + rc, mask=rc < n_cand, other=-1)
    for r in range(0, need):
        kmax = tl.max(keys, 0)
        sel = tl.where((rk == n_forced + r) & (kmax >= 0), 2147483647 - (kmax & 4294967295), sel)
        keys = tl.where(keys == kmax, -1, keys)
    # ascending, -1 at the end: rank of each entry, then place it
    sk = tl.where(sel >= 0, sel, 1073741824 + rk)
    rank = tl.sum((sk[None, :] < sk[:, None]).to(tl.int32), 1)
    return tl.sum(tl.where(rank[:, None] == rk[None, :], sel[:, None], 0), 0)


@triton.jit
def _sel_kernel(
    Q, POS, CAND, KSEL, VSEL, KWIN, VWIN, IDX, PM, PL, PACC,
    sq_b, sq_h, si_b, si_h, Hkv, G, Dk, Dv, max_len, W, n_cand, n_parts, part0, n_split_sel, n_split_cmp,
    slots_per_prog, slots_per_split, qk_scale, BT, sbt,
    BLOCK_SEL: tl.constexpr, N_INIT: tl.constexpr, N_LOCAL: tl.constexpr, N_SEL: tl.constexpr,
    N_PAD: tl.constexpr, NC_PAD: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, IEEE: tl.constexpr, PAGE: tl.constexpr, PAGED: tl.constexpr,
    PDL: tl.constexpr, EARLY_NEXT: tl.constexpr = False,
):
    sp = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b, h, q, t, rg, rn, rdk, rdv, g_ok, dk_ok, dv_ok = _query_tile(Q, POS, bh, sq_b, sq_h, Hkv, G, Dk, Dv, BLOCK_G,
                                                                   BLOCK_N, BLOCK_DK, BLOCK_DV, False)
    # Under PDL this launch starts once the scoring programs run, after the compressed launch has finished: the
    # query, the position and the window ring (the append's) are ready; the candidates are not.
    if sp >= n_split_sel:  # window programs (Tuning.window_with_sel): no merge, they start at once
        # they read nothing of the scoring launch: they run beside it, without waiting
        m_i, l_i, acc = _window_partial(q, t, KWIN, VWIN, b, h, sp - n_split_sel, Hkv, Dk, Dv, W, slots_per_split,
                                        qk_scale, rg, rn, rdk, rdv, dk_ok, dv_ok, BLOCK_G, BLOCK_N, BLOCK_DV, IEEE)
        _let_next_start(PDL)
        _store_partial(PM, PL, PACC, bh * n_parts + n_split_cmp + sp - n_split_sel, m_i, l_i, acc, rg, rdv, BLOCK_G,
                       BLOCK_DV)
    else:
        # Every program merges the candidates itself: measured faster than one merge per (b, KV head) behind an
        # atomic ticket in the scoring kernel (the merge is a serial chain; repeating it in parallel costs little).
        _wait_previous(PDL)
        if EARLY_NEXT:  # the early combine (combine.py): it starts now and merges the other branches meanwhile
            _let_next_start(PDL)
        srt = _merge_candidates(CAND, bh, t, n_cand, BLOCK_SEL, N_INIT, N_LOCAL, N_SEL, N_PAD, NC_PAD)
        rk = tl.arange(0, N_PAD)
        if sp == 0:
            tl.store(IDX + b * si_b + h * si_h + rk, srt.to(tl.int32), mask=rk < N_SEL)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
        # The selected blocks are a prefix of srt (-1 after them): one flat loop over this program's (block,
        # key tile) pairs, with no branch in it, so that Triton software-pipelines it (the next tile's K/V
        # loads in flight while this one is attended); the nested loop with `if block >= 0` was not (H100,
        # paper heads, 64k x 32: this launch 50.3 -> 43.2 us).
        N_TILES: tl.constexpr = (BLOCK_SEL + BLOCK_N - 1) // BLOCK_N
        n_valid = tl.sum((srt >= 0).to(tl.int32))
        r_lo = sp * slots_per_prog
        r_hi = tl.minimum(tl.minimum(r_lo + slots_per_prog, N_SEL), n_valid)
        for it in range(r_lo * N_TILES, r_hi * N_TILES):
            r = it // N_TILES
            c = (it % N_TILES) * BLOCK_N
            jb = tl.sum(tl.where(rk == r, srt, 0)).to(tl.int64)
            u = jb * BLOCK_SEL + c + rn
            ok = (c + rn < BLOCK_SEL) & (u <= t)
            row = _token_row(BT, sbt, b, u, h, Hkv, max_len, ok, PAGE, PAGED)
            _, m_i, l_i, acc = _attend_tile(
                q, KSEL + row[:, None] * Dk + rdk[None, :], VSEL + row[:, None] * Dv + rdv[None, :],
                ok[:, None] & dk_ok[None, :], ok[:, None] & dv_ok[None, :], ok, m_i, l_i, acc, qk_scale, IEEE)
        if not EARLY_NEXT:
            _let_next_start(PDL)
        _store_partial(PM, PL, PACC, bh * n_parts + part0 + sp, m_i, l_i, acc, rg, rdv, BLOCK_G, BLOCK_DV)
