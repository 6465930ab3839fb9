"""Launch 2 of a decode step (grid n_split_cmp x B*Hkv): compressed attention, flash-decoding style: each
program a contiguous share of the visible compressed blocks, its partial, and the raw logits of its blocks
in a scratch row for the selection scores (and the window's programs when Tuning.window_with_sel=False).

Keys and values are read together here, although the scores need only the keys. Reading the keys alone
(logits, max, sum) and the values in later programs that take the logits from the scratch row measured
slower in every cell (H200, paper heads, bf16, CUDA graphs). With the values in the scoring launch, 64k x 8
went from 57.0 to 60.5 us and 64k x 32 from 159.7 to 170.4. With the values in the selection launch, 64k x 8
went from 52.2 to 54.1 us. The key pass did halve (23.8 -> 13.6 us at 64k x 8), but the launch that took the
values grew by more than that: the value traffic added to the step's bytes rather than overlapping the
scoring. Nor did it pay with the values and the window in the scoring launch, letting the selection launch start
as they started, its programs waiting for their own (b, KV head)'s scores on a flag (release by each scoring
program, acquire in the selection) and for the rest only at their end (H100, paper heads, bf16, CUDA graphs,
two rounds): 64k x 8 58.7 / 58.3 -> 68.6 / 68.6 us, 8k x 8 30.0 -> 34.6, 64k x 1 20.6 -> 25.7, 64k x 32 182.8 ->
214.2. The keys' pass fell from 30.1 to 18.4 us at 64k x 8, but the scoring launch, now 1,504 programs sized by the
values' registers, took 29.6 us instead of 6.3, and the selection launch could start only once its last programs
had started, at 44 us.

Where this launch stands: at 64k x 8 (H100, paper heads, bf16) it reads the 64 MiB of compressed K/V and writes
4 MiB of logits in 30.4 us (ncu: DRAM 2.33 TB/s, 70% of peak; 352 programs of 4 warps at 138 registers, 15.6%
achieved occupancy). torch.sum of a plain 64 MiB bf16 tensor, replayed in a CUDA graph, read no faster (29.4 us,
2.28 TB/s), but bench/bench_decode.py's streaming read kernel (`read_floor_ms`) reads 64 MiB at 2.82 TB/s: about
23 us, so this launch has some 6 us to gain at most. The rest of the step is its later launches (ncu, each alone:
scores 9.2 us, selection and window 17.1 us at 1.47 TB/s, combine 8.3 us), which only overlapping them with this
stream can hide."""

from __future__ import annotations

import triton
import triton.language as tl

from .parts import _attend_tile, _cmp_row, _let_next_start, _query_tile, _store_partial, _window_partial


@triton.jit
def _cmp_win_kernel(
    Q, POS, KCMP, VCMP, KWIN, VWIN, SCR, PM, PL, PACC,
    sq_b, sq_h, Hkv, G, Dk, Dv, NB, W, n_split_cmp, blocks_per_split, slots_per_split, n_parts, qk_scale, BT, sbt,
    BLOCK_CMP: tl.constexpr, STRIDE_CMP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, IEEE: tl.constexpr, PAGE: tl.constexpr, PAGED: tl.constexpr,
    PDL: tl.constexpr,
):
    sp = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b, h, q, t, rg, rn, rdk, rdv, g_ok, dk_ok, dv_ok = _query_tile(Q, POS, bh, sq_b, sq_h, Hkv, G, Dk, Dv, BLOCK_G,
                                                                   BLOCK_N, BLOCK_DK, BLOCK_DV, PDL)
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
            row = _cmp_row(BT, sbt, b, idx, h, Hkv, NB, ok, STRIDE_CMP, PAGE, PAGED)
            s, m_i, l_i, acc = _attend_tile(
                q, KCMP + row[:, None] * Dk + rdk[None, :], VCMP + row[:, None] * Dv + rdv[None, :],
                ok[:, None] & dk_ok[None, :], ok[:, None] & dv_ok[None, :], ok, m_i, l_i, acc, qk_scale, IEEE)
            # Evict-last: the scoring launch reads these logits right after this one. Unmarked, the stream of
            # K/V evicted them to HBM first (a write and a read back of 8 MiB at 64k x 8). H100, paper heads, bf16,
            # CUDA graphs, old and new code alternating twice: 64k x 8 61.2 / 61.2 -> 59.4 / 58.6 us per step;
            # 64k x 32 and 128k x 8 unchanged. Marking the K/V loads evict-first as well changed nothing more.
            tl.store(SCR + (bh * BLOCK_G + rg[:, None]) * NB + idx[None, :], s, mask=g_ok[:, None] & ok[None, :],
                     eviction_policy="evict_last")
    else:  # window programs, when the launcher gives them to this kernel (Tuning.window_with_sel=False)
        m_i, l_i, acc = _window_partial(q, t, KWIN, VWIN, b, h, sp - n_split_cmp, Hkv, Dk, Dv, W, slots_per_split,
                                        qk_scale, rg, rn, rdk, rdv, dk_ok, dv_ok, BLOCK_G, BLOCK_N, BLOCK_DV, IEEE)
    _let_next_start(PDL)
    _store_partial(PM, PL, PACC, bh * n_parts + sp, m_i, l_i, acc, rg, rdv, BLOCK_G, BLOCK_DV)
