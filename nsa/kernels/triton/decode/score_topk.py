"""Launch 3 of a decode step (grid n_chunks x B*Hkv): the log-sum-exp of each head from the partials, the
selection scores of a chunk of selection blocks, and the chunk's best n - n_init - n_local
non-forced candidates (as many free blocks as a step can select).

One chunk per program: programs taking 2-8 chunks each, the partials' merge once for all of them (commit 57e0445,
bitwise the same candidates), measured slower in every cell (H200, paper heads, bf16, CUDA graphs; bench/results/
h200-cu130-torch2.11/decode-score-cpp/): 64k x 32 139.8 -> 142.1 us (2 chunks), 144.8 (4), 148.1 (8); 128k x 32
227.7 -> 228.8 (2); 64k x 8 50.9 -> 52.4 (2); 8k x 8 28.5 -> 29.4 (2). The launch is not bound by its programs'
fixed costs: fewer programs left its chunks in series."""

from __future__ import annotations

import triton
import triton.language as tl

from .parts import _let_next_start, _wait_previous


@triton.jit
def _head_sum(row, i, n_vis, NB, lse, g_ok):
    """sum over the G heads of exp2(logit - lse) of compressed blocks i (0 where i is not visible). Loaded
    within the scratch row, not only up to n_vis: the load then waits for nothing (t is read in parallel),
    and the logits past n_vis (stale) are dropped by the where."""
    ok = g_ok[:, None] & ((i >= 0) & (i < n_vis))[None, :]
    inb = g_ok[:, None] & ((i >= 0) & (i < NB))[None, :]
    lg = tl.load(row + i[None, :], mask=inb, other=float("-inf"), eviction_policy="evict_first")
    return tl.sum(tl.where(ok, tl.exp2(lg - lse[:, None]), 0.0), 0)


@triton.jit
def _score_topk_kernel(
    POS, SCR, PM, PL, CAND, SCORES,
    Hkv, G, NB, NJ, n_split_cmp, n_parts, n_chunks,
    BLOCK_CMP: tl.constexpr, STRIDE_CMP: tl.constexpr, BLOCK_SEL: tl.constexpr, N_INIT: tl.constexpr,
    N_LOCAL: tl.constexpr, K_FREE: tl.constexpr, N_PAD: tl.constexpr, BLOCK_G: tl.constexpr,
    CHUNK_J: tl.constexpr, SPLIT_PAD: tl.constexpr, PDL: tl.constexpr,
):
    c = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // Hkv
    t = tl.load(POS + b).to(tl.int64)  # the append's, finished before this launch could start
    _wait_previous(PDL)  # the compressed launch's partials and logits
    n_vis = tl.where(t + 1 >= BLOCK_CMP, (t + 1 - BLOCK_CMP) // STRIDE_CMP + 1, 0)
    rg = tl.arange(0, BLOCK_G)
    g_ok = rg < G
    # log-sum-exp (log2 domain) of each head over all compressed blocks, from the split partials. Issuing the
    # logits' loads before it, so that partials and logits share one memory round trip (the offsets outside
    # the contiguous tile below as one reshaped [CHUNK_J, offsets] tile), measured slower: H100, paper heads,
    # this launch 64k x 8 6.2 -> 17.2 us, 64k x 32 19.5 -> 62.8.
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
    row = SCR + (bh * BLOCK_G + rg[:, None]) * NB
    o0: tl.constexpr = R_SEL if (R_SEL & (R_SEL - 1)) == 0 else 0
    if o0 > 0:
        # Offsets o < R_SEL of every block at once: the chunk's R_SEL * CHUNK_J consecutive compressed blocks
        # as one contiguous tile (vector loads, one head sum), folded into blocks by a reshape. Every block
        # still takes the same operations in the same order. H100, paper heads: this launch 64k x 8 12.0 ->
        # 7.6 us, 64k x 32 32.4 -> 23.2 us (64 blocks per chunk; one strided load per offset before).
        e = c * (CHUNK_J * R_SEL) - (R_CMP - 1) + tl.arange(0, CHUNK_J * R_SEL)
        p = _head_sum(row, e, n_vis, NB, lse, g_ok)
        score += tl.sum(tl.reshape(p, [CHUNK_J, R_SEL]), 1)
    for o in tl.static_range(o0, N_OFF):  # the rest (all offsets where R_SEL is not a power of two)
        score += _head_sum(row, j * R_SEL - (R_CMP - 1) + o, n_vis, NB, lse, g_ok)
    _let_next_start(PDL)
    tl.store(SCORES + bh * NJ + j, score, mask=j < NJ)
    jt = t // BLOCK_SEL
    free = (j <= jt) & (j < NJ) & (j >= N_INIT) & (j <= jt - N_LOCAL)  # candidates that are not forced
    bits = score.to(tl.int32, bitcast=True).to(tl.int64)  # scores >= +0: bit order == value order
    jr = tl.arange(0, CHUNK_J)
    key = tl.where(free, (bits << 32) + (2147483647 - j), -1 - jr)  # distinct; non-candidates below 0
    # The chunk's K_FREE best by rank (how many keys are larger), placed by a one-hot sum: one pass, no
    # serial rounds of max-and-remove.
    rank = tl.sum((key[None, :] > key[:, None]).to(tl.int32), 1)
    rk = tl.arange(0, N_PAD)
    cand = tl.sum(tl.where(rank[:, None] == rk[None, :], key[:, None], 0), 0)
    cand = tl.where(cand >= 0, cand, -1)
    tl.store(CAND + (bh * n_chunks + c) * K_FREE + rk, cand, mask=rk < K_FREE)
