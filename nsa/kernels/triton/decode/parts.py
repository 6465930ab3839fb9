"""Jit helpers the decode launches share: the prologue of an attention program (its sequence, KV head, query
tile and position), one tile of keys into the online-softmax state, a program's partial (max, sum,
unnormalised acc) stored and, in the combine, loaded and merged, and the window ring's share of a program
(launch 2, or launch 4 with Tuning.window_with_sel)."""

from __future__ import annotations

import triton
import triton.language as tl

from ..common import pv_dot, qk_dot, softmax_step

try:  # grid dependency control: programmatic dependent launch (Triton 3.4 and later; sm 9.0 and later)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAS_GDC = True
except ImportError:  # an older Triton: the launcher never sets PDL, and these are never traced
    HAS_GDC = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass


@triton.jit
def _wait_previous(PDL: tl.constexpr):
    """Under programmatic dependent launch (PDL), a launch of the step may start while the one before it is
    still running; this waits until that one has finished and its writes are visible. A program reads before
    this call only what was written before the previous launch started: a launch starts once every program of
    the one before it has called _let_next_start, which they do after their own wait."""
    if PDL:
        gdc_wait()


@triton.jit
def _let_next_start(PDL: tl.constexpr):
    """Under PDL, let the step's next launch start (once every program of this one has called this or ended).
    Called after a program's main loop (the append, a tiny launch, calls it first thing): the next launch's
    programs then take the SM slots this launch frees, not slots beside it where they would only wait
    (called right after the wait, the 64k x 32 step ran 7% slower on an H100)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def _query_tile(Q, POS, bh, sq_b, sq_h, Hkv, G, Dk, Dv, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, WAIT: tl.constexpr):
    """The prologue of an attention program of (b, KV head) bh (launches 2 and 4): b, h, the query tile q
    [BLOCK_G, BLOCK_DK] of the KV head's G query heads (zero past G and Dk), the position t (int64), the
    ranges over heads, keys and head dims and their masks. WAIT: the position is written by the launch just
    before (_wait_previous between the query, a step input, and the position)."""
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
    _wait_previous(WAIT)
    t = tl.load(POS + b).to(tl.int64)
    return b, h, q, t, rg, rn, rdk, rdv, g_ok, dk_ok, dv_ok


@triton.jit
def _attend_tile(q, k_ptrs, v_ptrs, k_mask, v_mask, valid, m_i, l_i, acc, qk_scale, IEEE: tl.constexpr):
    """Online-softmax update of (m_i, l_i, acc) [G] [G] [G, Dv] with one tile of keys; returns the logits too.
    V is loaded together with K: where the loop is not software-pipelined (the selection programs), the two
    loads then share one memory round trip."""
    k = tl.load(k_ptrs, mask=k_mask, other=0.0)
    v = tl.load(v_ptrs, mask=v_mask, other=0.0)
    s = qk_dot(q, k, IEEE)
    s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
    p, alpha, m_new, l_i = softmax_step(s, m_i, l_i, True)
    acc = acc * alpha[:, None] + pv_dot(p, v, IEEE)
    return s, m_new, l_i, acc


@triton.jit
def _store_partial(PM, PL, PACC, part, m_i, l_i, acc, rg, rdv, BLOCK_G: tl.constexpr, BLOCK_DV: tl.constexpr):
    """A program's partial, marked evict-last: later launches of the step read it (the scores, the combine), and
    the compressed pass's stream of K/V would otherwise push it out of L2 first."""
    tl.store(PM + part * BLOCK_G + rg, m_i, eviction_policy="evict_last")
    tl.store(PL + part * BLOCK_G + rg, l_i, eviction_policy="evict_last")
    tl.store(PACC + (part * BLOCK_G + rg[:, None]) * BLOCK_DV + rdv[None, :], acc, eviction_policy="evict_last")


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
    a_p): the normalised output [G, DV_TILE] (0 if empty). An online fold of one [G, DV_TILE] partial at a
    time instead (unrolled by CHUNK, each thread folding only its own elements, no reduction across threads)
    measured slower: H100, paper heads, the combine launch 64k x 1 4.6 -> 11.7 us, 64k x 8 6.4 -> 8.6."""
    m, lsum, acc = _fold_parts(tl.full([BLOCK_G], float("-inf"), tl.float32), tl.zeros([BLOCK_G], tl.float32),
                               tl.zeros([BLOCK_G, DV_TILE], tl.float32), m_p, l_p, a_p)
    for c0 in range(p0 + CHUNK, p1, CHUNK):
        m_p, l_p, a_p = _load_parts(PM, PL, PACC, bh, n_parts, c0, p1, rg, rdv, dv_ok, BLOCK_G, BLOCK_DV, CHUNK)
        m, lsum, acc = _fold_parts(m, lsum, acc, m_p, l_p, a_p)
    return acc / tl.where(lsum > 0, lsum, 1.0)[:, None]


@triton.jit
def _token_row(BT, sbt, b, u, h, Hkv, max_len, mask, PAGE: tl.constexpr, PAGED: tl.constexpr):
    """Row of raw K/V (in units of D) holding position u (scalar or vector) of sequence b, KV head h: contiguous
    [B, max_len, Hkv, D], or paged [pages, PAGE, Hkv, D] through the block table BT (row stride sbt); int64.
    Masked positions (past the length: their page may not exist) read no table entry and give row 0."""
    if PAGED:
        page = tl.load(BT + b * sbt + u // PAGE, mask=mask, other=0).to(tl.int64)
        return (page * PAGE + u % PAGE) * Hkv + h
    else:
        return (b * max_len + u) * Hkv + h


@triton.jit
def _cmp_row(BT, sbt, b, i, h, Hkv, NB, mask, STRIDE_CMP: tl.constexpr, PAGE: tl.constexpr, PAGED: tl.constexpr):
    """Row of the compressed K/V holding block i of sequence b, KV head h: contiguous [B, NB, Hkv, D], or paged
    [pages, PAGE // STRIDE_CMP, Hkv, D] (block i lives in the page of its first token, i * STRIDE_CMP); int64."""
    if PAGED:
        start = i * STRIDE_CMP
        page = tl.load(BT + b * sbt + start // PAGE, mask=mask, other=0).to(tl.int64)
        return (page * (PAGE // STRIDE_CMP) + (start % PAGE) // STRIDE_CMP) * Hkv + h
    else:
        return (b * NB + i) * Hkv + h
