"""Triton kernels of one NSA decode step: one new token per sequence, ragged positions, five launches.

Contract (same function as nsa.decode's torch step): the cache (nsa.NSACache) holds sequence b's
cache_seqlens[b] tokens; the step appends its new token at position t_b = cache_seqlens[b] and returns
o [B, 1, Hq, Dv] = g_cmp * o_cmp + g_sel * o_sel + g_win * o_win for that token, then cache_seqlens += 1.

Every program handles all G query heads of one KV head (the G rows of tl.dot, padded to 16), so each K/V
row is loaded once per group. Softmax state is fp32 in the exp2 domain (logits * scale * log2(e)).

1. append (grid B x Hkv): writes the token into the raw K/V, the window ring and the raw compression ring;
   if a compressed block completes at t (t - l + 1 >= 0 and (t - l + 1) % d == 0), writes its mean
   (compress="mlp": the launcher runs phi in torch right after). Saves t in the workspace (`pos`).
2. compressed attention (grid n_split_cmp x B*Hkv), flash-decoding style: a program takes a contiguous
   share of the visible compressed blocks and writes its partial (max, sum, unnormalised acc); it also
   keeps the raw logits of its blocks in a scratch row [G, max_blocks] (fp32) for the selection scores.
3. scores + top-n candidates (grid n_chunks x B*Hkv): the log-sum-exp of each head from the partials, then
   for a chunk of selection blocks j: score[j] = sum over the compressed blocks overlapping j (fixed
   order) of sum over the G heads (one reduction, the same for every block) of exp2(logit - lse). Every
   block's score goes through the same operations in the same order, so mathematically equal inputs give
   bitwise-equal scores. The chunk's best n non-forced candidates, as int64 keys (score bits << 32 |
   (2^31 - 1 - j)): larger key = higher score, then lower index, exactly the tie rule of top_n_blocks.
4. selected + window attention (grid (n_split_sel + n_split_win) x B*Hkv): each selection program merges
   the chunks' candidates (the global top-n of the candidates is the top-n of the chunks' top-n), adds the
   forced blocks (first n_init, the n_local ending at t // l'), sorts the set ascending, then attends its
   share of the selected blocks (tokens u <= t). Program 0 writes the indices [B, 1, Hkv, n_sel] (ascending,
   -1 padded). The window programs attend their share of the window ring's slots, partials like step 2.
   (Tuning.window_with_sel=False moves them into step 2's launch.)
5. combine (grid B*Hkv x Dv tiles): merges each branch's partials, applies the gates, writes o, and
   publishes cache_seqlens[b] = t + 1 (the only write to the lengths).

Grids, splits and buffers depend on the cache's capacity only (DecodeWorkspace, made once per cache and
head count): the step allocates nothing but its output (and not even that with out=), never reads the
device back, and can be captured in a CUDA graph and replayed at every later position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


def _np2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@triton.jit
def _attend_tile(q, k_ptrs, v_ptrs, k_mask, v_mask, valid, m_i, l_i, acc, qk_scale, IEEE: tl.constexpr):
    """Online-softmax update of (m_i, l_i, acc) [G] [G] [G, Dv] with one tile of keys; returns the logits too.
    V is loaded together with K: where the loop is not software-pipelined (the selection programs), the two
    loads then share one memory round trip."""
    k = tl.load(k_ptrs, mask=k_mask, other=0.0)
    v = tl.load(v_ptrs, mask=v_mask, other=0.0)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return s, m_new, l_i, acc


@triton.jit
def _store_partial(PM, PL, PACC, part, m_i, l_i, acc, rg, rdv, BLOCK_G: tl.constexpr, BLOCK_DV: tl.constexpr):
    tl.store(PM + part * BLOCK_G + rg, m_i)
    tl.store(PL + part * BLOCK_G + rg, l_i)
    tl.store(PACC + (part * BLOCK_G + rg[:, None]) * BLOCK_DV + rdv[None, :], acc)


@triton.jit
def _append_kernel(
    SEQ, POS, KN, VN, KCN, VCN, KWN, VWN, KSEL, VSEL, KWIN, VWIN, KRAW, VRAW, KCMP, VCMP,
    skn_b, skn_h, svn_b, svn_h, skc_b, skc_h, svc_b, svc_h, skw_b, skw_h, svw_b, svw_h,
    Hkv, Dk, Dv, max_len, W, NB,
    BLOCK_CMP: tl.constexpr, STRIDE_CMP: tl.constexpr, BLOCK_L: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, AVG: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    t = tl.load(SEQ + b).to(tl.int64)
    if h == 0:
        tl.store(POS + b, t.to(tl.int32))
    rdk = tl.arange(0, BLOCK_DK)
    rdv = tl.arange(0, BLOCK_DV)
    mk = rdk < Dk
    mv = rdv < Dv
    k = tl.load(KN + b * skn_b + h * skn_h + rdk, mask=mk)
    v = tl.load(VN + b * svn_b + h * svn_h + rdv, mask=mv)
    kc = tl.load(KCN + b * skc_b + h * skc_h + rdk, mask=mk)
    vc = tl.load(VCN + b * svc_b + h * svc_h + rdv, mask=mv)
    kw = tl.load(KWN + b * skw_b + h * skw_h + rdk, mask=mk)
    vw = tl.load(VWN + b * svw_b + h * svw_h + rdv, mask=mv)
    tl.store(KSEL + ((b * max_len + t) * Hkv + h) * Dk + rdk, k, mask=mk)
    tl.store(VSEL + ((b * max_len + t) * Hkv + h) * Dv + rdv, v, mask=mv)
    sw = t % W
    tl.store(KWIN + ((b * W + sw) * Hkv + h) * Dk + rdk, kw, mask=mk)
    tl.store(VWIN + ((b * W + sw) * Hkv + h) * Dv + rdv, vw, mask=mv)
    sc = t % BLOCK_CMP
    tl.store(KRAW + ((b * BLOCK_CMP + sc) * Hkv + h) * Dk + rdk, kc, mask=mk)
    tl.store(VRAW + ((b * BLOCK_CMP + sc) * Hkv + h) * Dv + rdv, vc, mask=mv)
    if AVG:
        rel = t + 1 - BLOCK_CMP
        if rel >= 0:
            if rel % STRIDE_CMP == 0:
                i = rel // STRIDE_CMP
                rl = tl.arange(0, BLOCK_L)
                # the ring as it is after this token: the new one from registers (not re-read), the rest loaded
                old = (rl < BLOCK_CMP) & (rl != sc)
                kr = tl.load(KRAW + ((b * BLOCK_CMP + rl[:, None]) * Hkv + h) * Dk + rdk[None, :],
                             mask=old[:, None] & mk[None, :], other=0.0).to(tl.float32)
                kr = tl.where((rl == sc)[:, None], kc.to(tl.float32)[None, :], kr)
                vr = tl.load(VRAW + ((b * BLOCK_CMP + rl[:, None]) * Hkv + h) * Dv + rdv[None, :],
                             mask=old[:, None] & mv[None, :], other=0.0).to(tl.float32)
                vr = tl.where((rl == sc)[:, None], vc.to(tl.float32)[None, :], vr)
                km = tl.sum(kr, 0) / BLOCK_CMP
                vm = tl.sum(vr, 0) / BLOCK_CMP
                tl.store(KCMP + ((b * NB + i) * Hkv + h) * Dk + rdk, km.to(KCMP.dtype.element_ty), mask=mk)
                tl.store(VCMP + ((b * NB + i) * Hkv + h) * Dv + rdv, vm.to(VCMP.dtype.element_ty), mask=mv)


@triton.jit
def _window_partial(q, t, KWIN, VWIN, b, h, w, Hkv, Dk, Dv, W, slots_per_split, qk_scale, rg, rn, rdk, rdv, dk_ok,
                    dv_ok, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr, IEEE: tl.constexpr):
    """(m, l, acc) of window program w: its share of the ring's slots (every slot < min(t + 1, W) is a token of
    the window; their order does not matter to the softmax)."""
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    lo = w * slots_per_split
    hi = tl.minimum(lo + slots_per_split, tl.minimum(t + 1, W))
    for n0 in range(lo, hi, BLOCK_N):
        idx = n0 + rn
        ok = idx < hi
        row = (b * W + idx) * Hkv + h
        _, m_i, l_i, acc = _attend_tile(
            q, KWIN + row[:, None] * Dk + rdk[None, :], VWIN + row[:, None] * Dv + rdv[None, :],
            ok[:, None] & dk_ok[None, :], ok[:, None] & dv_ok[None, :], ok, m_i, l_i, acc, qk_scale, IEEE)
    return m_i, l_i, acc


@triton.jit
def _cmp_win_kernel(
    Q, POS, KCMP, VCMP, KWIN, VWIN, SCR, PM, PL, PACC,
    sq_b, sq_h, Hkv, G, Dk, Dv, NB, W, n_split_cmp, blocks_per_split, slots_per_split, n_parts, qk_scale,
    BLOCK_CMP: tl.constexpr, STRIDE_CMP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, IEEE: tl.constexpr,
):
    sp = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // Hkv
    h = bh % Hkv
    rg = tl.arange(0, BLOCK_G)
    rn = tl.arange(0, BLOCK_N)
    rdk = tl.arange(0, BLOCK_DK)
    rdv = tl.arange(0, BLOCK_DV)
    g_ok = rg < G
    dk_ok = rdk < Dk
    dv_ok = rdv < Dv
    q = tl.load(Q + b * sq_b + (h * G + rg[:, None]) * sq_h + rdk[None, :], mask=g_ok[:, None] & dk_ok[None, :],
                other=0.0)
    t = tl.load(POS + b).to(tl.int64)
    if sp < n_split_cmp:
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
        n_vis = tl.where(t + 1 >= BLOCK_CMP, (t + 1 - BLOCK_CMP) // STRIDE_CMP + 1, 0)
        lo = sp * blocks_per_split
        hi = tl.minimum(lo + blocks_per_split, n_vis)
        for n0 in range(lo, hi, BLOCK_N):
            idx = n0 + rn
            ok = idx < hi
            row = (b * NB + idx) * Hkv + h
            s, m_i, l_i, acc = _attend_tile(
                q, KCMP + row[:, None] * Dk + rdk[None, :], VCMP + row[:, None] * Dv + rdv[None, :],
                ok[:, None] & dk_ok[None, :], ok[:, None] & dv_ok[None, :], ok, m_i, l_i, acc, qk_scale, IEEE)
            tl.store(SCR + (bh * BLOCK_G + rg[:, None]) * NB + idx[None, :], s, mask=g_ok[:, None] & ok[None, :])
    else:  # window programs, when the launcher gives them to this kernel (Tuning.window_with_sel=False)
        m_i, l_i, acc = _window_partial(q, t, KWIN, VWIN, b, h, sp - n_split_cmp, Hkv, Dk, Dv, W, slots_per_split,
                                        qk_scale, rg, rn, rdk, rdv, dk_ok, dv_ok, BLOCK_G, BLOCK_N, BLOCK_DV, IEEE)
    _store_partial(PM, PL, PACC, bh * n_parts + sp, m_i, l_i, acc, rg, rdv, BLOCK_G, BLOCK_DV)


@triton.jit
def _score_topk_kernel(
    POS, SCR, PM, PL, CAND, SCORES,
    Hkv, G, NB, NJ, n_split_cmp, n_parts, n_chunks,
    BLOCK_CMP: tl.constexpr, STRIDE_CMP: tl.constexpr, BLOCK_SEL: tl.constexpr, N_INIT: tl.constexpr,
    N_LOCAL: tl.constexpr, N_SEL: tl.constexpr, N_PAD: tl.constexpr, BLOCK_G: tl.constexpr,
    CHUNK_J: tl.constexpr, SPLIT_PAD: tl.constexpr,
):
    c = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // Hkv
    t = tl.load(POS + b).to(tl.int64)
    n_vis = tl.where(t + 1 >= BLOCK_CMP, (t + 1 - BLOCK_CMP) // STRIDE_CMP + 1, 0)
    rg = tl.arange(0, BLOCK_G)
    g_ok = rg < G
    # log-sum-exp (log2 domain) of each head over all compressed blocks, from the split partials
    rs = tl.arange(0, SPLIT_PAD)
    s_ok = rs < n_split_cmp
    pm = tl.load(PM + (bh * n_parts + rs[:, None]) * BLOCK_G + rg[None, :], mask=s_ok[:, None], other=float("-inf"))
    pl = tl.load(PL + (bh * n_parts + rs[:, None]) * BLOCK_G + rg[None, :], mask=s_ok[:, None], other=0.0)
    m = tl.max(pm, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    lsum = tl.sum(pl * tl.exp2(pm - m[None, :]), 0)
    lse = tl.where(lsum > 0, m + tl.log2(tl.where(lsum > 0, lsum, 1.0)), 0.0)
    # scores of this chunk's selection blocks: compressed block i overlaps block j iff
    # j*l'/d - l/d + 1 <= i <= (j+1)*l'/d - 1, i.e. N_OFF consecutive blocks, summed in a fixed order
    R_SEL: tl.constexpr = BLOCK_SEL // STRIDE_CMP
    R_CMP: tl.constexpr = BLOCK_CMP // STRIDE_CMP
    N_OFF: tl.constexpr = R_SEL + R_CMP - 1
    j = c * CHUNK_J + tl.arange(0, CHUNK_J)
    score = tl.zeros([CHUNK_J], tl.float32)
    for o in tl.static_range(N_OFF):
        i = j * R_SEL - (R_CMP - 1) + o
        ok = g_ok[:, None] & ((i >= 0) & (i < n_vis))[None, :]
        # Loaded within the scratch row, not only up to n_vis: the load then waits for nothing (t is read in
        # parallel), and the logits past n_vis (stale) are dropped by the where.
        inb = g_ok[:, None] & ((i >= 0) & (i < NB))[None, :]
        lg = tl.load(SCR + (bh * BLOCK_G + rg[:, None]) * NB + i[None, :], mask=inb, other=float("-inf"))
        p = tl.where(ok, tl.exp2(lg - lse[:, None]), 0.0)
        score += tl.sum(p, 0)
    tl.store(SCORES + bh * NJ + j, score, mask=j < NJ)
    jt = t // BLOCK_SEL
    free = (j <= jt) & (j < NJ) & (j >= N_INIT) & (j <= jt - N_LOCAL)  # candidates that are not forced
    bits = score.to(tl.int32, bitcast=True).to(tl.int64)  # scores >= +0: bit order == value order
    jr = tl.arange(0, CHUNK_J)
    key = tl.where(free, (bits << 32) + (2147483647 - j), -1 - jr)  # distinct; non-candidates below 0
    # The chunk's N_SEL best by rank (how many keys are larger), placed by a one-hot sum: one pass, no
    # serial rounds of max-and-remove.
    rank = tl.sum((key[None, :] > key[:, None]).to(tl.int32), 1)
    rk = tl.arange(0, N_PAD)
    cand = tl.sum(tl.where(rank[:, None] == rk[None, :], key[:, None], 0), 0)
    cand = tl.where(cand >= 0, cand, -1)
    tl.store(CAND + (bh * n_chunks + c) * N_SEL + rk, cand, mask=rk < N_SEL)


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
    # candidates of a 64k context: the selection program's time goes to its memory round trips.
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
    slots_per_prog, slots_per_split, qk_scale,
    BLOCK_SEL: tl.constexpr, N_INIT: tl.constexpr, N_LOCAL: tl.constexpr, N_SEL: tl.constexpr,
    N_PAD: tl.constexpr, NC_PAD: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, IEEE: tl.constexpr,
):
    sp = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // Hkv
    h = bh % Hkv
    rg = tl.arange(0, BLOCK_G)
    rn = tl.arange(0, BLOCK_N)
    rdk = tl.arange(0, BLOCK_DK)
    rdv = tl.arange(0, BLOCK_DV)
    g_ok = rg < G
    dk_ok = rdk < Dk
    dv_ok = rdv < Dv
    q = tl.load(Q + b * sq_b + (h * G + rg[:, None]) * sq_h + rdk[None, :], mask=g_ok[:, None] & dk_ok[None, :],
                other=0.0)
    t = tl.load(POS + b).to(tl.int64)
    if sp >= n_split_sel:  # window programs (Tuning.window_with_sel): no merge, they start at once
        m_i, l_i, acc = _window_partial(q, t, KWIN, VWIN, b, h, sp - n_split_sel, Hkv, Dk, Dv, W, slots_per_split,
                                        qk_scale, rg, rn, rdk, rdv, dk_ok, dv_ok, BLOCK_G, BLOCK_N, BLOCK_DV, IEEE)
        _store_partial(PM, PL, PACC, bh * n_parts + n_split_cmp + sp - n_split_sel, m_i, l_i, acc, rg, rdv, BLOCK_G,
                       BLOCK_DV)
    else:
        # Every program merges the candidates itself: measured faster than one merge per (b, KV head) behind an
        # atomic ticket in the scoring kernel (the merge is a serial chain; repeating it in parallel costs little).
        srt = _merge_candidates(CAND, bh, t, n_cand, BLOCK_SEL, N_INIT, N_LOCAL, N_SEL, N_PAD, NC_PAD)
        rk = tl.arange(0, N_PAD)
        if sp == 0:
            tl.store(IDX + b * si_b + h * si_h + rk, srt.to(tl.int32), mask=rk < N_SEL)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
        r_lo = sp * slots_per_prog
        r_hi = tl.minimum(r_lo + slots_per_prog, N_SEL)
        for r in range(r_lo, r_hi):
            jb = tl.sum(tl.where(rk == r, srt, 0)).to(tl.int64)
            if jb >= 0:
                for c in range(0, BLOCK_SEL, BLOCK_N):
                    u = jb * BLOCK_SEL + c + rn
                    ok = (c + rn < BLOCK_SEL) & (u <= t)
                    row = (b * max_len + u) * Hkv + h
                    _, m_i, l_i, acc = _attend_tile(
                        q, KSEL + row[:, None] * Dk + rdk[None, :], VSEL + row[:, None] * Dv + rdv[None, :],
                        ok[:, None] & dk_ok[None, :], ok[:, None] & dv_ok[None, :], ok, m_i, l_i, acc, qk_scale,
                        IEEE)
        _store_partial(PM, PL, PACC, bh * n_parts + part0 + sp, m_i, l_i, acc, rg, rdv, BLOCK_G, BLOCK_DV)


@triton.jit
def _load_parts(PM, PL, PACC, bh, n_parts, c0, p1, rg, rdv, dv_ok, BLOCK_G: tl.constexpr, BLOCK_DV: tl.constexpr,
                CHUNK: tl.constexpr):
    """Partials [c0, min(c0 + CHUNK, p1)) of one (b, KV head): m, l [CHUNK, G] and acc [CHUNK, G, DV_TILE]."""
    rp = c0 + tl.arange(0, CHUNK)
    ok = rp < p1
    part = bh * n_parts + rp
    m_p = tl.load(PM + part[:, None] * BLOCK_G + rg[None, :], mask=ok[:, None], other=float("-inf"))
    l_p = tl.load(PL + part[:, None] * BLOCK_G + rg[None, :], mask=ok[:, None], other=0.0)
    a_p = tl.load(PACC + (part[:, None, None] * BLOCK_G + rg[None, :, None]) * BLOCK_DV + rdv[None, None, :],
                  mask=ok[:, None, None] & dv_ok[None, None, :], other=0.0)
    return m_p, l_p, a_p


@triton.jit
def _fold_parts(m, lsum, acc, m_p, l_p, a_p):
    """Online-softmax fold of loaded partials into (m, lsum, acc); empty partials (m = -inf) add nothing."""
    m_new = tl.maximum(m, tl.max(m_p, 0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_safe)
    beta = tl.exp2(m_p - m_safe[None, :])  # [chunk, G]
    lsum = lsum * alpha + tl.sum(l_p * beta, 0)
    acc = acc * alpha[:, None] + tl.sum(a_p * beta[:, :, None], 0)
    return m_new, lsum, acc


@triton.jit
def _merge_parts(PM, PL, PACC, bh, n_parts, p0, p1, m_p, l_p, a_p, rg, rdv, dv_ok, BLOCK_G: tl.constexpr,
                 DV_TILE: tl.constexpr, BLOCK_DV: tl.constexpr, CHUNK: tl.constexpr):
    """Softmax-merge partials [p0, p1) of one (b, KV head), the first CHUNK of them already loaded (m_p, l_p,
    a_p): the normalised output [G, DV_TILE] (0 if empty)."""
    m, lsum, acc = _fold_parts(tl.full([BLOCK_G], float("-inf"), tl.float32), tl.zeros([BLOCK_G], tl.float32),
                               tl.zeros([BLOCK_G, DV_TILE], tl.float32), m_p, l_p, a_p)
    for c0 in range(p0 + CHUNK, p1, CHUNK):
        m_p, l_p, a_p = _load_parts(PM, PL, PACC, bh, n_parts, c0, p1, rg, rdv, dv_ok, BLOCK_G, BLOCK_DV, CHUNK)
        m, lsum, acc = _fold_parts(m, lsum, acc, m_p, l_p, a_p)
    return acc / tl.where(lsum > 0, lsum, 1.0)[:, None]


@triton.jit
def _combine_kernel(
    POS, SEQ, PM, PL, PACC, GATES, OUT,
    sg_b, sg_h, sg_c, so_b, so_h, Hkv, G, Dv, n_parts, n_cmp_parts, n_win_parts,
    BLOCK_G: tl.constexpr, BLOCK_DV: tl.constexpr, DV_TILE: tl.constexpr, CHUNK_CMP: tl.constexpr,
    CHUNK_WIN: tl.constexpr, CHUNK_SEL: tl.constexpr,
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
    # The first chunk of each branch's partials [cmp | win | sel] is loaded before any arithmetic: one memory
    # round trip for the three (usually every partial), not one per branch; the merge is latency-bound.
    mc, lc, ac = _load_parts(PM, PL, PACC, bh, n_parts, 0, n_cmp_parts, rg, rdv, dv_ok, BLOCK_G, BLOCK_DV,
                             CHUNK_CMP)
    mw, lw, aw = _load_parts(PM, PL, PACC, bh, n_parts, n_cmp_parts, p1, rg, rdv, dv_ok, BLOCK_G, BLOCK_DV,
                             CHUNK_WIN)
    ms, ls, as_ = _load_parts(PM, PL, PACC, bh, n_parts, p1, n_parts, rg, rdv, dv_ok, BLOCK_G, BLOCK_DV,
                              CHUNK_SEL)
    o_cmp = _merge_parts(PM, PL, PACC, bh, n_parts, 0, n_cmp_parts, mc, lc, ac, rg, rdv, dv_ok, BLOCK_G, DV_TILE,
                         BLOCK_DV, CHUNK_CMP)
    o_win = _merge_parts(PM, PL, PACC, bh, n_parts, n_cmp_parts, p1, mw, lw, aw, rg, rdv, dv_ok, BLOCK_G, DV_TILE,
                         BLOCK_DV, CHUNK_WIN)
    o_sel = _merge_parts(PM, PL, PACC, bh, n_parts, p1, n_parts, ms, ls, as_, rg, rdv, dv_ok, BLOCK_G, DV_TILE,
                         BLOCK_DV, CHUNK_SEL)
    o = g_cmp[:, None] * o_cmp + g_sel[:, None] * o_sel + g_win[:, None] * o_win
    tl.store(OUT + b * so_b + heads[:, None] * so_h + rdv[None, :], o.to(OUT.dtype.element_ty),
             mask=g_ok[:, None] & dv_ok[None, :])
    if h == 0:
        if dt == 0:
            tl.store(SEQ + b, tl.load(POS + b) + 1)


# --- launcher ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Tuning:
    """How the step is split and launched (None: the default).
    target_programs: programs per launch to aim for (default: 4 per SM).
    block_n: keys per tile (default 64, 32 for head dims > 128).
    tiles_per_program: key tiles of every compressed and window program (default: from target_programs,
        at least min_tiles).
    min_tiles: the least key tiles per compressed / window program (default 3: one-tile programs left many
        partials to merge; H100, paper heads: 8k x 8 38.9 -> 35.4 us, 64k x 1 29.0 -> 26.6 us per step).
    chunk_j: selection blocks per scoring program (default: up to 64).
    sel_splits: selection programs per (b, KV head) (default: about 2 per SM in all, at most n_sel).
    dv_tile: output columns per combine program (default 8).
    part_chunk: partials per combine load and branch (default 256 / padded G).
    warps_*: warps of each kernel; stages_cmp: pipeline depth of the compressed/window loop (default 2,
        fewer where shared memory is short).
    target_cmp: compressed programs per launch, at most (default on CUDA: 3 per SM, one wave of the programs
        an SM holds at once; with target_programs set: that, rounded up per (b, KV head)).
    cmp_align: compressed blocks per program are a multiple of this (default block_n: whole tiles; 16 gave
        64k x 8 12 programs of 5.5 tiles per (b, KV head) instead of 11 of 6, and measured no faster).
    window_with_sel: the window's programs run in the selection launch (default), else in the compressed one.
        The window needs no scores; beside the selection programs, which wait on the candidate merge, its
        memory traffic overlaps theirs instead of lengthening the compressed launch, the longest of the step.
    Tests shrink the sizes to exercise many splits on tiny shapes; bench/tune_decode.py sweeps the rest."""

    target_programs: int | None = None
    block_n: int | None = None
    chunk_j: int | None = None
    dv_tile: int | None = None
    warps_cmp: int = 4
    warps_score: int = 4
    warps_sel: int = 4
    warps_combine: int = 4
    stages_cmp: int | None = None
    part_chunk: int | None = None
    sel_splits: int | None = None
    tiles_per_program: int | None = None
    min_tiles: int = 3
    target_cmp: int | None = None
    cmp_align: int | None = None
    window_with_sel: bool = True


TUNING = Tuning()


class DecodeWorkspace:
    """Split plan and preallocated buffers of the decode step for one cache and query-head count."""

    def __init__(self, cache, Hq: int, tuning: Tuning):
        cfg = cache.config
        B, Hkv, Dk, Dv = cache.batch, cache.n_kv_heads, cache.d_k, cache.d_v
        device = cache.device
        self.G = Hq // Hkv
        self.BLOCK_G = max(16, _np2(self.G))
        self.BLOCK_DK = max(16, _np2(Dk))
        self.BLOCK_DV = max(16, _np2(Dv))
        self.BLOCK_N = tuning.block_n or (64 if max(self.BLOCK_DK, self.BLOCK_DV) <= 128 else 32)
        self.BLOCK_N_SEL = min(max(16, _np2(cfg.block_sel)), self.BLOCK_N)
        BH = B * Hkv
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0
        target = tuning.target_programs or (4 * sms if sms else 64)
        self.target_programs = target
        per_bh = max(1, _cdiv(target, BH))
        # Compressed launch: one wave of the three programs an SM holds (2 pipeline stages, 146 registers on
        # sm_90), not a second, partial wave (H100, paper heads, 64k x 8: 32.6 -> 30.2 us; 4 per SM: 36.0).
        target_cmp = tuning.target_cmp or (3 * sms if sms and not tuning.target_programs else None)
        per_bh_cmp = max(1, target_cmp // BH) if target_cmp else per_bh
        bn = self.BLOCK_N
        NB = cache.cmp_capacity
        W = cache.window_slots
        if tuning.tiles_per_program:  # every compressed and window program the same work: no long stragglers
            self.blocks_per_split = self.slots_per_split = tuning.tiles_per_program * bn
        else:  # about target_programs in all, at least min_tiles tiles each
            n_split = min(per_bh_cmp, _cdiv(NB, bn))
            align = tuning.cmp_align or bn  # shares of cmp_align blocks: even shares (the last tile masked)
            self.blocks_per_split = max(_cdiv(_cdiv(NB, n_split), align) * align, tuning.min_tiles * bn)
            n_split = min(per_bh, _cdiv(W, bn))
            self.slots_per_split = max(_cdiv(_cdiv(W, n_split), bn), tuning.min_tiles) * bn
        self.n_split_cmp = _cdiv(NB, self.blocks_per_split)
        self.n_split_win = _cdiv(W, self.slots_per_split)
        # Selection: about 2 programs per SM (each merges the candidates itself, so fewer, longer programs
        # measured faster than the 4 per SM of the other branches).
        sel_splits = tuning.sel_splits or max(1, _cdiv(target // 2, BH))
        self.slots_per_prog = _cdiv(cfg.n_sel, min(sel_splits, cfg.n_sel))
        self.n_split_sel = _cdiv(cfg.n_sel, self.slots_per_prog)
        self.n_parts = self.n_split_cmp + self.n_split_win + self.n_split_sel
        self.window_with_sel = tuning.window_with_sel
        win = self.n_split_win
        self.grid_cmp = self.n_split_cmp + (0 if self.window_with_sel else win)
        self.grid_sel = self.n_split_sel + (win if self.window_with_sel else 0)
        self.NJ = cfg.n_sel_blocks(cache.max_len)
        # 64 selection blocks per scoring program: many programs even for one sequence, and a cheap rank-based
        # top-n per chunk (64 x 64 comparisons).
        cj = tuning.chunk_j or min(64, max(16, _np2(self.NJ)))
        cj = max(cj, _np2(cfg.n_sel))
        cj = max(cj, _np2(_cdiv(self.NJ * cfg.n_sel, 4096)))  # at most 4096 candidates to merge
        self.CHUNK_J = cj
        self.n_chunks = _cdiv(self.NJ, cj)
        self.N_PAD = _np2(cfg.n_sel)
        self.n_cand = self.n_chunks * cfg.n_sel
        self.NC_PAD = _np2(self.n_cand)
        self.SPLIT_PAD = _np2(self.n_split_cmp)
        self.BLOCK_L = _np2(cfg.block_cmp)
        # Combine: many programs (the merge is latency-bound), each loading [chunk, G, DV_TILE] fp32 tiles of
        # partials, one per branch, at most part_chunk partials (default 16 x 16 / padded G) per load. Wider
        # tiles (32 x 16 x 16) spilled registers and ran twice as long.
        self.DV_TILE = min(tuning.dv_tile or 8, self.BLOCK_DV)
        cap = tuning.part_chunk or max(1, 256 // self.BLOCK_G)
        self.CHUNK_CMP, self.CHUNK_WIN, self.CHUNK_SEL = (
            max(2, min(_np2(n), cap)) for n in (self.n_split_cmp, self.n_split_win, self.n_split_sel))
        self.tuning = tuning
        if device.type == "cuda":
            smem, elem, low = _max_shared_mem(device), cache.k_sel.element_size(), cache.dtype != torch.float32
            kv_row = (self.BLOCK_DK + self.BLOCK_DV) * elem
            # 2 stages: three programs fit an SM (3 stages left room for one, and measured 15% slower)
            self.stages_cmp = tuning.stages_cmp or min(2, _stages(self.BLOCK_N * kv_row, smem, low))
            self.stages_sel = _stages(self.BLOCK_N_SEL * kv_row, smem, low)
            if self.window_with_sel:  # its window loop is pipelined like the compressed one
                self.stages_sel = min(self.stages_sel, self.stages_cmp)
        f32 = dict(device=device, dtype=torch.float32)
        self.pos = torch.zeros(B, dtype=torch.int32, device=device)
        self.pm = torch.empty(BH, self.n_parts, self.BLOCK_G, **f32)
        self.pl = torch.empty(BH, self.n_parts, self.BLOCK_G, **f32)
        self.pacc = torch.empty(BH, self.n_parts, self.BLOCK_G, self.BLOCK_DV, **f32)
        self.scratch = torch.empty(BH, self.BLOCK_G, NB, **f32)
        self.cand = torch.empty(BH, self.n_cand, dtype=torch.int64, device=device)
        self.scores = torch.zeros(BH, self.NJ, **f32)
        self.indices = torch.empty(B, 1, Hkv, cfg.n_sel, dtype=torch.int32, device=device)

    def describe(self) -> str:
        """The split plan, e.g. "cmp17x256/win8x64/sel16x1/chunks5x256" (programs x items per program)."""
        win = "+win" if self.window_with_sel else ""
        return (f"cmp{self.n_split_cmp}x{self.blocks_per_split}/win{self.n_split_win}x{self.slots_per_split}/"
                f"sel{self.n_split_sel}x{self.slots_per_prog}{win}/chunks{self.n_chunks}x{self.CHUNK_J}")


def _max_shared_mem(device) -> int:
    """Opt-in shared memory per program of the device (bytes), as Triton's own resource checks see it."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        return int(triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"])
    except (AttributeError, KeyError, TypeError):  # a Triton without the query: size for sm86-class GPUs
        return 99 * 1024


def _stages(tile_bytes: int, smem: int, low_precision: bool) -> int:
    """Pipeline depth of a K/V tile loop: 3 for 16-bit tiles (2 for fp32), fewer where shared memory is short
    (32 KiB kept for everything else the kernel stages)."""
    fit = max(1, (smem - 32 * 1024) // tile_bytes)
    return int(min(3 if low_precision else 2, fit))


def _last_dim_contiguous(x):
    return x if x.stride(-1) == 1 else x.contiguous()


def _launch_opts(device, warps: int, ws=None, stages: str | None = None) -> dict:
    """Launch options on CUDA (the interpreter takes none); `stages` names the workspace's pipeline depth."""
    if device.type != "cuda":
        return {}
    return {"num_warps": warps} if stages is None else {"num_warps": warps, "num_stages": getattr(ws, stages)}


def workspace_for(cache, Hq: int, tuning: Tuning | None = None) -> DecodeWorkspace:
    tuning = tuning or TUNING
    return cache.workspace(("triton_decode", Hq, tuning), lambda: DecodeWorkspace(cache, Hq, tuning))


def decode_step_triton(q, gates, cache, tokens, compress_fn=None, *, out=None, want_indices=False):
    """Run the five kernels (module doc). tokens: the validated (k, v, kc, vc, kw, vw) [B, 1, Hkv, D].

    Returns (o [B, 1, Hq, Dv] in q's dtype, indices int32 [B, 1, Hkv, n_sel]). The indices tensor is a
    fresh one when want_indices, else the workspace's (overwritten by the next step). Publishes the new
    lengths on the device (cache_seqlens += 1); the caller updates the host copy.
    """
    cfg = cache.config
    B, _, Hq, Dk = q.shape
    Hkv, Dv = cache.n_kv_heads, cache.d_v
    ws = workspace_for(cache, Hq)
    device = q.device
    q = _last_dim_contiguous(q)
    gates = _last_dim_contiguous(gates)
    k, v, kc, vc, kw, vw = (_last_dim_contiguous(x) for x in tokens)
    if out is None:
        out = torch.empty(B, 1, Hq, Dv, device=device, dtype=q.dtype)
    idx = torch.empty(B, 1, Hkv, cfg.n_sel, dtype=torch.int32, device=device) if want_indices else ws.indices
    qk_scale = cfg.softmax_scale(Dk) * LOG2E
    ieee = q.dtype == torch.float32
    NB, W = cache.cmp_capacity, cache.window_slots
    BH = B * Hkv
    _append_kernel[(B, Hkv)](
        cache.cache_seqlens, ws.pos, k, v, kc, vc, kw, vw,
        cache.k_sel, cache.v_sel, cache.k_win, cache.v_win, cache.k_raw_cmp, cache.v_raw_cmp, cache.k_cmp, cache.v_cmp,
        k.stride(0), k.stride(2), v.stride(0), v.stride(2), kc.stride(0), kc.stride(2), vc.stride(0), vc.stride(2),
        kw.stride(0), kw.stride(2), vw.stride(0), vw.stride(2),
        Hkv, Dk, Dv, cache.max_len, W, NB,
        BLOCK_CMP=cfg.block_cmp, STRIDE_CMP=cfg.stride_cmp, BLOCK_L=ws.BLOCK_L, BLOCK_DK=ws.BLOCK_DK,
        BLOCK_DV=ws.BLOCK_DV, AVG=compress_fn is None, **_launch_opts(device, 2),
    )
    if compress_fn is not None:  # phi is a torch module: the block completed at t (if any), from the raw ring
        cache.compress_step(compress_fn)
    _cmp_win_kernel[(ws.grid_cmp, BH)](
        q, ws.pos, cache.k_cmp, cache.v_cmp, cache.k_win, cache.v_win, ws.scratch, ws.pm, ws.pl, ws.pacc,
        q.stride(0), q.stride(2), Hkv, ws.G, Dk, Dv, NB, W, ws.n_split_cmp, ws.blocks_per_split, ws.slots_per_split,
        ws.n_parts, qk_scale,
        BLOCK_CMP=cfg.block_cmp, STRIDE_CMP=cfg.stride_cmp, BLOCK_G=ws.BLOCK_G, BLOCK_N=ws.BLOCK_N,
        BLOCK_DK=ws.BLOCK_DK, BLOCK_DV=ws.BLOCK_DV, IEEE=ieee,
        **_launch_opts(device, ws.tuning.warps_cmp, ws, "stages_cmp"),
    )
    _score_topk_kernel[(ws.n_chunks, BH)](
        ws.pos, ws.scratch, ws.pm, ws.pl, ws.cand, ws.scores,
        Hkv, ws.G, NB, ws.NJ, ws.n_split_cmp, ws.n_parts, ws.n_chunks,
        BLOCK_CMP=cfg.block_cmp, STRIDE_CMP=cfg.stride_cmp, BLOCK_SEL=cfg.block_sel, N_INIT=cfg.n_init,
        N_LOCAL=cfg.n_local, N_SEL=cfg.n_sel, N_PAD=ws.N_PAD, BLOCK_G=ws.BLOCK_G, CHUNK_J=ws.CHUNK_J,
        SPLIT_PAD=ws.SPLIT_PAD, **_launch_opts(device, ws.tuning.warps_score),
    )
    _sel_kernel[(ws.grid_sel, BH)](
        q, ws.pos, ws.cand, cache.k_sel, cache.v_sel, cache.k_win, cache.v_win, idx, ws.pm, ws.pl, ws.pacc,
        q.stride(0), q.stride(2), idx.stride(0), idx.stride(2), Hkv, ws.G, Dk, Dv, cache.max_len, W, ws.n_cand,
        ws.n_parts, ws.n_split_cmp + ws.n_split_win, ws.n_split_sel, ws.n_split_cmp, ws.slots_per_prog,
        ws.slots_per_split, qk_scale,
        BLOCK_SEL=cfg.block_sel, N_INIT=cfg.n_init, N_LOCAL=cfg.n_local, N_SEL=cfg.n_sel, N_PAD=ws.N_PAD,
        NC_PAD=ws.NC_PAD, BLOCK_G=ws.BLOCK_G, BLOCK_N=ws.BLOCK_N_SEL, BLOCK_DK=ws.BLOCK_DK, BLOCK_DV=ws.BLOCK_DV,
        IEEE=ieee, **_launch_opts(device, ws.tuning.warps_sel, ws, "stages_sel"),
    )
    _combine_kernel[(BH, _cdiv(Dv, ws.DV_TILE))](
        ws.pos, cache.cache_seqlens, ws.pm, ws.pl, ws.pacc, gates, out,
        gates.stride(0), gates.stride(2), gates.stride(3), out.stride(0), out.stride(2), Hkv, ws.G, Dv, ws.n_parts,
        ws.n_split_cmp, ws.n_split_win,
        BLOCK_G=ws.BLOCK_G, BLOCK_DV=ws.BLOCK_DV, DV_TILE=ws.DV_TILE, CHUNK_CMP=ws.CHUNK_CMP, CHUNK_WIN=ws.CHUNK_WIN,
        CHUNK_SEL=ws.CHUNK_SEL,
        **_launch_opts(device, ws.tuning.warps_combine),
    )
    return out, idx


__all__ = ["DecodeWorkspace", "Tuning", "TUNING", "decode_step_triton", "workspace_for"]
