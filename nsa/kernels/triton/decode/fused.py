"""The fused decode step (Tuning.fused): launches 2-5 of the step as one launch of work items, one item per
program, taken from one queue in an order that respects their dependencies, so that no launch boundary
separates the compressed pass from the scoring, the selection and the combine: the items of a (b, KV head)
start as soon as the items they read have finished, while other (b, KV heads) still stream.

Items, in queue order (within each kind, one (b, KV head) after another):
  1. compressed items (n_split_cmp per (b, KV head)): _cmp_win_program's compressed share: partial + logits;
  2. window items (n_split_win each): _cmp_win_program's window share (no dependency: they stream beside the
     end of the compressed pass and the scoring);
  3. scoring items (n_chunks each): wait until every compressed item of their (b, KV head) is done;
  4. selection items (n_split_sel each): wait until every scoring item of theirs is done;
  5. combine items (Dv tiles each): wait until every window and selection item of theirs is done.
A program takes its item with an atomic ticket (CNT[0]) when it starts, not by its program id. Items are thus
taken in queue order by programs that are running, and an item only waits for items before it in the queue,
so it never waits for an item that no running program holds: the earliest unfinished item has nothing left to
wait for. That holds however many programs are resident at once (and in Triton's interpreter, which runs one
program after another: each finds its items' inputs done).

Measured slower than the five launches in every cell, so it is off by default (H200, paper heads, bf16,
CUDA-graph replay, both in one process, bench/results/h200-cu130-torch2.11/decode-fused/): 64k x 8 49.1 ->
60.8 us, 64k x 1 20.7 -> 33.9, 8k x 8 28.0 -> 34.4, 64k x 32 144.3 -> 179.5 (150.6 with 128 blocks per
scoring item). Its trace (bench/tune_decode.py --trace) at 64k x 1, where every item is resident from the
start: the compressed items end at 10.0 us, the scoring at 16.1, the selection at 25.1, the combine at 31.7:
each dependent hop costs about 3.5 us more than between launches under PDL (score 2.5, selection 6, combine 4.5
there). Neither counters on lines of their own, sleeping between polls, relaxed polls with one acquire, nor the
waits placed after the prologue's loads moved it. At 64k x 8 the 1056 scoring items (33 per (b, KV head))
occupy the program slots from 16.6 to 41.5 us. One item per program rather than a persistent loop over items:
the loop kept every kind's addresses live across iterations (255 registers on sm 9.0, two programs per SM; 158
without it, three) and was slower still (64k x 8 70.3 us).

Counters (int32, zeroed by the append kernel of the same step): CNT[0] the queue head, then per (b, KV head)
bh: CNT[1 + bh] its finished compressed items, CNT[1 + BH + bh] its finished scoring items,
CNT[1 + 2 BH + bh] its finished window and selection items. A finishing item stores its results, then a barrier
of its program and one release increment by one thread (the pattern of CUTLASS's semaphores); a waiting item
polls with acquire loads, which Triton issues from one thread and broadcasts through shared memory behind a
barrier, so every thread of the program reads the results after the acquire.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .cmp_win import _cmp_win_program
from .combine import _combine_program
from .parts import _wait_previous
from .score_topk import _score_chunk
from .sel import _sel_program


@triton.jit
def _arrive(CNT, i, CSTRIDE: tl.constexpr):
    """Count this program's item as finished in counter i, after every one of its threads' stores."""
    tl.debug_barrier()
    tl.atomic_add(CNT + i * CSTRIDE, 1, sem="release")


@triton.jit
def _now():
    """The GPU's global nanosecond timer (CUDA only: the trace of bench/tune_decode.py --trace)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _trace(TR, item, t_start, t_ready, TRACE: tl.constexpr):
    """Row `item` of the trace: start, item taken, end (ns, globaltimer) and the SM."""
    if TRACE:
        sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=True, pack=1)
        tl.store(TR + item * 4, t_start)
        tl.store(TR + item * 4 + 1, t_ready)
        tl.store(TR + item * 4 + 2, _now())
        tl.store(TR + item * 4 + 3, sm.to(tl.int64))


@triton.jit
def _step_kernel(
    Q, POS, SEQ, KCMP, VCMP, KWIN, VWIN, KSEL, VSEL, SCR, PM, PL, PACC, CAND, SCORES, IDX, GATES, OUT, CNT, TR,
    sq_b, sq_h, si_b, si_h, sg_b, sg_h, sg_c, so_b, so_h,
    Hkv, G, Dk, Dv, NB, W, max_len, NJ, BH, n_split_cmp, n_split_win, n_chunks, n_split_sel, n_dv_tiles, n_parts,
    n_cand, blocks_per_split, slots_per_split, slots_per_prog, qk_scale, BT, sbt,
    BLOCK_CMP: tl.constexpr, STRIDE_CMP: tl.constexpr, BLOCK_SEL: tl.constexpr, N_INIT: tl.constexpr,
    N_LOCAL: tl.constexpr, N_SEL: tl.constexpr, K_FREE: tl.constexpr, N_PAD: tl.constexpr, NC_PAD: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_N_SEL: tl.constexpr, BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr, CHUNK_J: tl.constexpr, SPLIT_PAD: tl.constexpr, DV_TILE: tl.constexpr,
    CHUNK_CMP: tl.constexpr, CHUNK_WIN: tl.constexpr, CHUNK_SEL: tl.constexpr, IEEE: tl.constexpr,
    PAGE: tl.constexpr, PAGED: tl.constexpr, PDL: tl.constexpr, CSTRIDE: tl.constexpr, NAP_NS: tl.constexpr,
    TRACE: tl.constexpr,
):
    _wait_previous(PDL)  # the append: the new token in the cache, the position, the counters zeroed
    e_cmp = BH * n_split_cmp
    e_win = e_cmp + BH * n_split_win
    e_score = e_win + BH * n_chunks
    e_sel = e_score + BH * n_split_sel
    n_items = e_sel + BH * n_dv_tiles
    # The item is the program's place in the queue, not its program id: the order in which programs start
    # is the hardware's, the order of the items is the queue's.
    t_start = _now() if TRACE else 0
    item = tl.atomic_add(CNT, 1, sem="relaxed")  # the queue head: counter 0
    t_ready = _now() if TRACE else 0
    if item < n_items:
        if item < e_win:
            if item < e_cmp:
                bh = item // n_split_cmp
                sp = item % n_split_cmp
                done = 1 + bh
            else:
                bh = (item - e_cmp) // n_split_win
                sp = n_split_cmp + (item - e_cmp) % n_split_win
                done = 1 + 2 * BH + bh
            _cmp_win_program(
                Q, POS, KCMP, VCMP, KWIN, VWIN, SCR, PM, PL, PACC, sp, bh.to(tl.int64),
                sq_b, sq_h, Hkv, G, Dk, Dv, NB, W, n_split_cmp, blocks_per_split, slots_per_split, n_parts, qk_scale,
                BT, sbt, BLOCK_CMP, STRIDE_CMP, BLOCK_G, BLOCK_N, BLOCK_DK, BLOCK_DV, IEEE, PAGE, PAGED, False)
            _arrive(CNT, done, CSTRIDE)
        elif item < e_score:
            bh = (item - e_win) // n_chunks
            _score_chunk(POS, SCR, PM, PL, CAND, SCORES, (item - e_win) % n_chunks, bh.to(tl.int64),
                         Hkv, G, NB, NJ, n_split_cmp, n_parts, n_chunks, BLOCK_CMP, STRIDE_CMP, BLOCK_SEL, N_INIT,
                         N_LOCAL, K_FREE, N_PAD, BLOCK_G, CHUNK_J, SPLIT_PAD, False,
                         CNT, 1 + bh, n_split_cmp, CSTRIDE, True, NAP_NS)
            _arrive(CNT, 1 + BH + bh, CSTRIDE)
        elif item < e_sel:
            bh = (item - e_score) // n_split_sel
            _sel_program(Q, POS, CAND, KSEL, VSEL, IDX, PM, PL, PACC, (item - e_score) % n_split_sel,
                         bh.to(tl.int64), sq_b, sq_h, si_b, si_h, Hkv, G, Dk, Dv, max_len, n_cand, n_parts,
                         n_split_cmp + n_split_win, slots_per_prog, qk_scale, BT, sbt, BLOCK_SEL, N_INIT, N_LOCAL,
                         N_SEL, N_PAD, NC_PAD, BLOCK_G, BLOCK_N_SEL, BLOCK_DK, BLOCK_DV, IEEE, PAGE, PAGED, False,
                         False, CNT, 1 + BH + bh, n_chunks, CSTRIDE, True, NAP_NS)
            _arrive(CNT, 1 + 2 * BH + bh, CSTRIDE)
        else:
            bh = (item - e_sel) // n_dv_tiles
            _combine_program(POS, SEQ, PM, PL, PACC, GATES, OUT, bh.to(tl.int64), (item - e_sel) % n_dv_tiles,
                             sg_b, sg_h, sg_c, so_b, so_h, Hkv, G, Dv, n_parts, n_split_cmp, n_split_win,
                             BLOCK_G, BLOCK_DV, DV_TILE, CHUNK_CMP, CHUNK_WIN, CHUNK_SEL, False, False,
                             CNT, 1 + 2 * BH + bh, n_split_win + n_split_sel, CSTRIDE, True, NAP_NS)
        _trace(TR, item, t_start, t_ready, TRACE)
