"""Backward of the Triton selected-attention kernel, without atomics: bitwise reproducible dq, dk, dv.

Same contract as the forward (nsa.kernels.triton.selection): q [B, T, Hq, Dk], k [B, T, Hkv, Dk],
v [B, T, Hkv, Dv], indices [B, T, Hkv, n] (local block ids, -1 = none, no repeats in a row), seq_start
[B, T]; o and the forward's LSE [B, T, Hq] (fp32, natural log, -inf = empty row). p is recomputed from the
LSE (exp2 domain); delta = rowsum(dO * O) is computed by the dq kernel (fp32) and read by the dk/dv one.

- dq: one program per (token, batch x KV head, tile of query heads) walks the token's selected blocks as
  the forward does (rows = the G query heads, padded to 16), with a flat pipelinable loop over
  (block, sub-tile) and masks instead of branches (an index of -1 gives an all-false mask); K/V tiles by
  TMA where tma.supported says so.
- dk/dv: through the reverse index (nsa.kernels.triton.reverse_index): each work item is a chunk of at
  most CHUNK_ROWS / G queries of one block; a program stacks QT query tokens x BG heads as the rows of tl.dot,
  recomputes S^T = K_blk q^T, P^T, dP^T = V_blk dO^T, dS^T and accumulates dV += P^T dO and
  dK += dS^T q in fp32 registers over its chunk (masks: u > t, the block tail, padding rows). A block
  longer than the tile is split into sub-tiles (separate work). Persistent programs take the items
  biggest first. A block with one chunk writes dK/dV directly; a block with several writes fp32 partials
  that a second kernel sums in chunk order. No atomics anywhere, so two runs give identical bits.
  The partials' buffer has a static size (no host sync): 2*B*T*Hkv*n / chunk blocks of l' x (Dk + Dv)
  fp32, about B*T*Hq*(Dk + Dv) bytes at the defaults with n*l' = 1024 (1.1 GB at T=64k, Hq=64, D=128);
  only the blocks with several chunks are written.

dq inside the dk/dv kernel instead (dS^T q-rows' K added to an fp32 buffer by relaxed atomics, the dq kernel
reduced to delta, a last kernel converting the buffer) measured slower everywhere (H100, bf16, Hq=64, Hkv=4,
D=128, the whole NSA forward+backward, two rounds): 16 x 4k packed 69.8 / 72.5 -> 97.0 / 96.8 ms with 64-row
tiles and 83.7 / 83.5 with 32-row ones; 64k 110.9 / 113.0 -> 138.2 / 138.9 and 125.7 / 125.3; 8k 12.3 / 12.2 ->
16.8 / 16.9 and 15.0 / 15.3. At 16 x 4k the dk/dv kernel went from 14.4 to 52.8 ms with 64-row tiles: each
(token, block) pair adds 8 KB of fp32 atomics (34 GB per step), far more than the 14.4 ms of the dq kernel it replaces.

Tile sizes, warps, stages and the chunk length are chosen in one place, `bwd_config`, ready for tuning.
Offsets are int64 where a stride times an index can pass 2**31. fp32 inputs use IEEE fp32 dots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..device import on_gpu
from . import tma
from .common import bh_program, selected_tiles, split_dim
from .common import next_pow2 as _np2
from .reverse_index import ITEM_FIELDS, REDUCE_FIELDS, build_reverse_index, plan_work

LOG2E = 1.4426950408889634

# Tile limits and the chunk length; bwd_config derives every launch parameter from them.
DQ_MAX_BLOCK_N = 64  # key tokens per sub-tile in the dq kernel
DQ_MAX_BLOCK_G = 64  # query-head rows per dq program
DKDV_ROWS = 64  # rows of the dk/dv kernel's dots (query tokens x heads)
DKDV_MAX_BLOCK_N = 64  # key tokens per dk/dv sub-tile
CHUNK_ROWS = 16384  # rows (query tokens x G) per work item: bounds one program's work
REDUCE_BLOCK_N = 16
REDUCE_BLOCK_D = 64
PROGRAMS_PER_SM = 8
POISON_OUTPUTS = False  # tests: fill dq/dk/dv with NaN before the kernels (every element must be written)


def bwd_config(G: int, Dk: int, Dv: int, block_sel: int, dtype: torch.dtype, device: torch.device,
               tma: bool = False) -> dict:
    """Launch parameters of the three kernels (constexprs, plus num_warps / num_stages on a GPU).

    Defaults chosen from sm_90 compiles without register spills where possible (ptxas -v); bf16/fp16
    D=128 keeps 64-token sub-tiles for wgmma at the cost of a small spill. The dk/dv warps and chunk rows
    come from bench/tune_sel_bwd.py on an H100 at 64k (4 warps and 16384 rows with 4 programs per SM:
    40.7 ms against 46.3 ms with 8 warps, 2 per SM, 8192 rows); its query loop is not pipelined
    (`--sweep dkdv_tile`, 64k: whole backward 34.9-36.0 ms against 36.2-37.0 with 2 stages; 8k: 4.46
    against 4.61-4.65 ms): the kernel is bound by latency at 255 registers and 2 programs per SM (ncu: L2
    65%, DRAM 46%, SM 27% of peak), and a second stage only adds shared memory. 8 programs per SM are
    as fast or a little faster (34.9 ms against 34.9-36.0 with 4). `tma`: the dq kernel reads K/V tiles
    by TMA (tma.py), with 3 stages where pointer loads had 2 (H100, 64k: whole backward 36.1 ms against
    38.0 with 2 stages and 37.2 with pointer loads). Tune here.
    """
    bdk, bdk2 = split_dim(Dk)  # 192 as 128 + 64 columns (no dot over zero columns)
    bdv = max(16, _np2(Dv))
    width = bdk + bdk2 + bdv
    ieee = dtype == torch.float32
    # fp32 tiles take twice the registers and shared memory: halve them
    dq_bn = min(max(16, _np2(block_sel)), DQ_MAX_BLOCK_N, 32 if ieee and width >= 256 else 64)
    dq_rows = min(DQ_MAX_BLOCK_G, (64 if width < 256 else 32) // (2 if ieee else 1))
    # With TMA copies and one group of up to 16 heads, one warp with 32-token tiles in 2 stages, as in the
    # forward (H200, bf16, G=16, D=128, the dq kernel alone at 64k: 15.2 ms against 16.3 with 4 warps,
    # 64-token tiles and 3 stages, and 15.3 with 2 warps; 8k 2.00 against 2.07;
    # bench/results/h200-cu130-torch2.11/tune_topn_seldq.csv).
    # The paper's Dk=192 / Dv=128 (width 320 as two column tiles): two warps, 32-token tiles in 3 stages (H200,
    # 16k, the dq kernel alone with one 256-column tile: 6.95 ms against 11.03 with 8 warps, 64-token tiles
    # and 1 stage; 4 warps with 64-token tiles in 3 stages 6.96).
    one_warp = tma and not ieee and width <= 256 and G <= 16
    two_warps = tma and not ieee and bdk2 and 256 < width <= 320 and G <= 16
    if one_warp or two_warps:
        dq_bn = min(dq_bn, 32)
    dq = dict(BLOCK_G=min(max(16, _np2(G)), dq_rows), BLOCK_N=dq_bn, BLOCK_DK=bdk, BLOCK_DK2=bdk2, BLOCK_DV=bdv,
              N_SUB=triton.cdiv(block_sel, dq_bn), TMA=tma,
              NUM_STAGES=3 if two_warps else 1 if width > 256 or (ieee and width == 256) else 2 if one_warp
              else 3 if tma and width <= 256 else 2)
    kv_stages = 1
    if ieee or width > 384:
        kv_bn, rows = 32, min(DKDV_ROWS, 32)
    elif bdk2 and width <= 320:
        # The paper's 192 / 128 as two column tiles: 64-token tiles, 32 rows, 2 stages (H200, 16k, the whole
        # selection backward: 11.5 ms against 16.1 with 32-token tiles, 64 rows and 1 stage; 12.2 with 1 stage)
        kv_bn, rows, kv_stages = 64, 32, 2
    elif width > 256:
        kv_bn, rows = 32, DKDV_ROWS
    else:
        kv_bn, rows = 64, DKDV_ROWS
    kv_bn = min(max(16, _np2(block_sel)), DKDV_MAX_BLOCK_N, kv_bn)
    bg = min(_np2(G), rows)
    dkdv = dict(BG=bg, QT=max(1, rows // bg), BLOCK_N=kv_bn, BLOCK_DK=bdk, BLOCK_DK2=bdk2, BLOCK_DV=bdv,
                NUM_STAGES=kv_stages)
    n_sub = triton.cdiv(block_sel, kv_bn)
    red = dict(BLOCK_N=min(REDUCE_BLOCK_N, kv_bn), BLOCK_D=REDUCE_BLOCK_D)
    if on_gpu(device):
        dq.update(num_warps=2 if two_warps else 8 if width > 256 or ieee else 1 if one_warp else 4,
                  num_stages=dq["NUM_STAGES"])
        dkdv.update(num_warps=4, num_stages=dkdv["NUM_STAGES"])
        red.update(num_warps=4)
    chunk = max(1, CHUNK_ROWS // max(G, 1))  # query tokens per work item
    return dict(dq=dq, dkdv=dkdv, reduce=red, n_sub=n_sub, ls_pad=n_sub * kv_bn, chunk=chunk, ieee=ieee)


def _n_programs(device: torch.device) -> int:
    if on_gpu(device):
        return torch.cuda.get_device_properties(device).multi_processor_count * PROGRAMS_PER_SM
    return 4  # Triton's interpreter runs programs one after another


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a.to(b.dtype), b)


@triton.jit
def _store_dq(dq, DQ, DQ2, b, t, heads, rd, gd_ok, sm_scale, sdqb, sdqt, sdqh, sdqd, s2b, s2t, s2h, s2d, t2_lo, t2_hi,
              ACCUMULATE: tl.constexpr):
    """Scale dq [BLOCK_G, D] (columns rd) and store it, adding what DQ (and DQ2 for tokens [t2_lo, t2_hi))
    hold in fp32 when ACCUMULATE."""
    dq_ptr = DQ + b * sdqb + t * sdqt + heads[:, None] * sdqh + rd[None, :] * sdqd
    dq = dq * sm_scale
    if ACCUMULATE:
        dq += tl.load(dq_ptr, mask=gd_ok, other=0.0).to(tl.float32)
        if (t >= t2_lo) & (t < t2_hi):
            dq += tl.load(DQ2 + b * s2b + (t - t2_lo) * s2t + heads[:, None] * s2h + rd[None, :] * s2d,
                          mask=gd_ok, other=0.0).to(tl.float32)
    tl.store(dq_ptr, dq.to(DQ.dtype.element_ty), mask=gd_ok)


@triton.jit
def _sel_bwd_dq_kernel(
    Q, K, V, KD, VD, KD2, IDX, SS, O, DO, LSE, DELTA, DQ, DQ2,
    sqb, sqt, sqh, sqd,
    skb, skt, skh, skd,
    svb, svt, svh, svd,
    sib, sit, sih, sin,
    ssb, sst,
    sob, sot, soh, sod,
    sdob, sdot, sdoh, sdod,
    slb, slt, slh,
    sdqb, sdqt, sdqh, sdqd,
    s2b, s2t, s2h, s2d, t2_lo, t2_hi,
    Hkv, G, Dk, Dv, n_sel, block_sel, qk_scale, sm_scale, q_off,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    N_SUB: tl.constexpr, N_PAD: tl.constexpr, NUM_STAGES: tl.constexpr, IEEE: tl.constexpr, TMA: tl.constexpr = False,
    ACCUMULATE: tl.constexpr = False, BLOCK_DK2: tl.constexpr = 0,
):
    # ACCUMULATE: DQ holds the other branches' dq; add this branch's to it in fp32 (one rounding, no extra pass).
    # DQ2 holds more of them for tokens [t2_lo, t2_hi) (row t - t2_lo), added the same way.
    # BLOCK_DK2 > 0: q, K and dq have a second column tile [BLOCK_DK, BLOCK_DK + BLOCK_DK2) (split_dim).
    SPLIT: tl.constexpr = BLOCK_DK2 > 0
    t = tl.program_id(0).to(tl.int64)
    b, h = bh_program(1, Hkv)
    g0 = tl.program_id(2) * BLOCK_G

    rg = g0 + tl.arange(0, BLOCK_G)
    rn = tl.arange(0, BLOCK_N)
    rdk = tl.arange(0, BLOCK_DK)
    rdv = tl.arange(0, BLOCK_DV)
    g_ok = rg < G
    dk_ok = rdk < Dk
    dv_ok = rdv < Dv
    heads = (h * G + rg).to(tl.int64)

    start = tl.load(SS + b * ssb + t * sst).to(tl.int64)
    pos = t + q_off - start  # q_off: the stream position of row 0 (K/V rows are stream positions)

    q = tl.load(Q + b * sqb + t * sqt + heads[:, None] * sqh + rdk[None, :] * sqd,
                mask=g_ok[:, None] & dk_ok[None, :], other=0.0)
    if SPLIT:
        rdk2 = BLOCK_DK + tl.arange(0, BLOCK_DK2)
        dk2_ok = rdk2 < Dk
        q2 = tl.load(Q + b * sqb + t * sqt + heads[:, None] * sqh + rdk2[None, :] * sqd,
                     mask=g_ok[:, None] & dk2_ok[None, :], other=0.0)
        dq2 = tl.zeros([BLOCK_G, BLOCK_DK2], tl.float32)
    do = tl.load(DO + b * sdob + t * sdot + heads[:, None] * sdoh + rdv[None, :] * sdod,
                 mask=g_ok[:, None] & dv_ok[None, :], other=0.0)
    o = tl.load(O + b * sob + t * sot + heads[:, None] * soh + rdv[None, :] * sod,
                mask=g_ok[:, None] & dv_ok[None, :], other=0.0)
    # delta = rowsum(dO * O) in fp32, stored for the dk/dv kernel (which runs after this one)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
    tl.store(DELTA + b * slb + t * slt + heads * slh, delta, mask=g_ok)
    lse = tl.load(LSE + b * slb + t * slt + heads * slh, mask=g_ok, other=float("-inf"))
    row_ok = g_ok & (lse > float("-inf"))
    lse2 = tl.where(row_ok, lse * 1.4426950408889634, 0.0)

    dq = tl.zeros([BLOCK_G, BLOCK_DK], tl.float32)
    idx_base = IDX + b * sib + t * sit + h * sih
    k_base = K + b * skb + h * skh
    v_base = V + b * svb + h * svh
    # One flat loop over (selected block, sub-tile): no data-dependent branch, so loads can be pipelined. It
    # ends after the last tile with a visible token where the row lists its visible blocks first.
    n_it = selected_tiles(idx_base, sin, n_sel, pos, block_sel, N_PAD, BLOCK_N, N_SUB)
    for it in tl.range(0, n_it, num_stages=NUM_STAGES):
        i = it // N_SUB
        c = (it % N_SUB) * BLOCK_N
        j = tl.load(idx_base + i * sin).to(tl.int64)
        local = j * block_sel + c + rn
        keep = (j >= 0) & (c + rn < block_sel) & (local <= pos)
        tok = start + local
        if TMA:  # tensor-memory copies (tma.py): masked in p below, zeros outside [0, T)
            row0 = (start + j * block_sel + c).to(tl.int32)
            kb = tl.reshape(KD.load([b.to(tl.int32), row0, h.to(tl.int32), 0]), [BLOCK_N, BLOCK_DK])
            vb = tl.reshape(VD.load([b.to(tl.int32), row0, h.to(tl.int32), 0]), [BLOCK_N, BLOCK_DV])
            if SPLIT:
                kb2 = tl.reshape(KD2.load([b.to(tl.int32), row0, h.to(tl.int32), BLOCK_DK]), [BLOCK_N, BLOCK_DK2])
        else:
            kb = tl.load(k_base + tok[:, None] * skt + rdk[None, :] * skd,
                         mask=keep[:, None] & dk_ok[None, :], other=0.0)
            vb = tl.load(v_base + tok[:, None] * svt + rdv[None, :] * svd,
                         mask=keep[:, None] & dv_ok[None, :], other=0.0)
            if SPLIT:
                kb2 = tl.load(k_base + tok[:, None] * skt + rdk2[None, :] * skd,
                              mask=keep[:, None] & dk2_ok[None, :], other=0.0)
        s = _dot(q, tl.trans(kb), IEEE)
        if SPLIT:
            s += _dot(q2, tl.trans(kb2), IEEE)
        dp = _dot(do, tl.trans(vb), IEEE)
        p = tl.where(row_ok[:, None] & keep[None, :], tl.exp2(s * qk_scale - lse2[:, None]), 0.0)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds, kb, IEEE)
        if SPLIT:
            dq2 += _dot(ds, kb2, IEEE)

    _store_dq(dq, DQ, DQ2, b, t, heads, rdk, g_ok[:, None] & dk_ok[None, :], sm_scale, sdqb, sdqt, sdqh, sdqd,
              s2b, s2t, s2h, s2d, t2_lo, t2_hi, ACCUMULATE)
    if SPLIT:
        _store_dq(dq2, DQ, DQ2, b, t, heads, rdk2, g_ok[:, None] & dk2_ok[None, :], sm_scale, sdqb, sdqt, sdqh,
                  sdqd, s2b, s2t, s2h, s2d, t2_lo, t2_hi, ACCUMULATE)


@triton.jit
def _sel_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, PART, ITEMS, N_ITEMS, QUERIES,
    sqb, sqt, sqh, sqd,
    skb, skt, skh, skd,
    svb, svt, svh, svd,
    sdob, sdot, sdoh, sdod,
    slb, slt, slh,
    sdkb, sdkt, sdkh, sdkd,
    sdvb, sdvt, sdvh, sdvd,
    spp, spn,
    Hkv, G, Dk, Dv, qk_scale, sm_scale, q_off,
    BG: tl.constexpr, QT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr, N_SUB: tl.constexpr, NUM_STAGES: tl.constexpr, IEEE: tl.constexpr,
    N_FIELDS: tl.constexpr, BLOCK_DK2: tl.constexpr = 0,
):
    # BLOCK_DK2 > 0: q, K and dK have a second column tile [BLOCK_DK, BLOCK_DK + BLOCK_DK2) (split_dim).
    SPLIT: tl.constexpr = BLOCK_DK2 > 0
    ROWS: tl.constexpr = BG * QT
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    n_work = tl.load(N_ITEMS) * N_SUB
    r = tl.arange(0, ROWS)
    rq = r // BG  # query token of the row within the step
    rgl = r % BG  # head of the row within the head tile
    rn = tl.arange(0, BLOCK_N)
    rdk = tl.arange(0, BLOCK_DK)
    rdv = tl.arange(0, BLOCK_DV)
    dk_ok = rdk < Dk
    dv_ok = rdv < Dv
    if SPLIT:
        rdk2 = BLOCK_DK + tl.arange(0, BLOCK_DK2)
        dk2_ok = rdk2 < Dk
    for w in range(pid, n_work, n_prog):
        item = ITEMS + (w // N_SUB) * N_FIELDS  # w is int64 (n_work, its bound, is)
        c = (w % N_SUB) * BLOCK_N
        bh = tl.load(item)
        s0 = tl.load(item + 1)
        blen = tl.load(item + 2)
        first = tl.load(item + 3)
        end = tl.load(item + 4)
        part = tl.load(item + 5)
        b = bh // Hkv
        h = bh % Hkv
        kin = c + rn < blen
        ktok = s0 + c + rn  # global key tokens of this sub-tile
        kb = tl.load(K + b * skb + ktok[:, None] * skt + h * skh + rdk[None, :] * skd,
                     mask=kin[:, None] & dk_ok[None, :], other=0.0)
        vb = tl.load(V + b * svb + ktok[:, None] * svt + h * svh + rdv[None, :] * svd,
                     mask=kin[:, None] & dv_ok[None, :], other=0.0)
        dk = tl.zeros([BLOCK_N, BLOCK_DK], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
        if SPLIT:
            kb2 = tl.load(K + b * skb + ktok[:, None] * skt + h * skh + rdk2[None, :] * skd,
                          mask=kin[:, None] & dk2_ok[None, :], other=0.0)
            dk2 = tl.zeros([BLOCK_N, BLOCK_DK2], tl.float32)
        for g0 in range(0, G, BG):
            rg = g0 + rgl
            heads = h * G + rg
            for q0 in tl.range(first, end, QT, num_stages=NUM_STAGES):
                li = q0 + rq
                row_ok = (li < end) & (rg < G)
                tq = tl.load(QUERIES + li, mask=row_ok, other=0).to(tl.int64)
                qr = tl.load(Q + b * sqb + tq[:, None] * sqt + heads[:, None] * sqh + rdk[None, :] * sqd,
                             mask=row_ok[:, None] & dk_ok[None, :], other=0.0)
                dor = tl.load(DO + b * sdob + tq[:, None] * sdot + heads[:, None] * sdoh + rdv[None, :] * sdod,
                              mask=row_ok[:, None] & dv_ok[None, :], other=0.0)
                lse = tl.load(LSE + b * slb + tq * slt + heads * slh, mask=row_ok, other=float("-inf"))
                delta = tl.load(DELTA + b * slb + tq * slt + heads * slh, mask=row_ok, other=0.0)
                row_ok = row_ok & (lse > float("-inf"))
                lse2 = tl.where(row_ok, lse * 1.4426950408889634, 0.0)
                valid = kin[:, None] & row_ok[None, :] & (ktok[:, None] <= tq[None, :] + q_off)
                st = _dot(kb, tl.trans(qr), IEEE)  # [BLOCK_N, ROWS]
                if SPLIT:
                    qr2 = tl.load(Q + b * sqb + tq[:, None] * sqt + heads[:, None] * sqh + rdk2[None, :] * sqd,
                                  mask=row_ok[:, None] & dk2_ok[None, :], other=0.0)
                    st += _dot(kb2, tl.trans(qr2), IEEE)
                pt = tl.where(valid, tl.exp2(st * qk_scale - lse2[None, :]), 0.0)
                dv += _dot(pt, dor, IEEE)
                dpt = _dot(vb, tl.trans(dor), IEEE)
                dst = pt * (dpt - delta[None, :])
                dk += _dot(dst, qr, IEEE)
                if SPLIT:
                    dk2 += _dot(dst, qr2, IEEE)
        dk = dk * sm_scale
        # one chunk: write dK/dV; several: an fp32 partial [ls_pad, Dk + Dv] for the reduce kernel
        direct = part < 0
        tl.store(DK + b * sdkb + ktok[:, None] * sdkt + h * sdkh + rdk[None, :] * sdkd,
                 dk.to(DK.dtype.element_ty), mask=direct & kin[:, None] & dk_ok[None, :])
        tl.store(DV + b * sdvb + ktok[:, None] * sdvt + h * sdvh + rdv[None, :] * sdvd,
                 dv.to(DV.dtype.element_ty), mask=direct & kin[:, None] & dv_ok[None, :])
        p_base = PART + tl.maximum(part, 0) * spp + (c + rn)[:, None] * spn
        tl.store(p_base + rdk[None, :], dk, mask=(part >= 0) & dk_ok[None, :])
        tl.store(p_base + Dk + rdv[None, :], dv, mask=(part >= 0) & dv_ok[None, :])
        if SPLIT:
            dk2 = dk2 * sm_scale
            tl.store(DK + b * sdkb + ktok[:, None] * sdkt + h * sdkh + rdk2[None, :] * sdkd,
                     dk2.to(DK.dtype.element_ty), mask=direct & kin[:, None] & dk2_ok[None, :])
            tl.store(p_base + rdk2[None, :], dk2, mask=(part >= 0) & dk2_ok[None, :])


@triton.jit
def _sel_bwd_reduce_kernel(
    PART, DK, DV, RED, N_RED,
    spp, spn,
    sdkb, sdkt, sdkh, sdkd,
    sdvb, sdvt, sdvh, sdvd,
    Hkv, Dk, Dv,
    LS_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, N_FIELDS: tl.constexpr,
):
    """Sum each multi-chunk block's partials in chunk order; tiles of BLOCK_N tokens x BLOCK_D columns."""
    N_T: tl.constexpr = LS_PAD // BLOCK_N
    n_d = tl.cdiv(Dk + Dv, BLOCK_D)
    per_row = N_T * n_d
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    n_work = tl.load(N_RED) * per_row
    rn = tl.arange(0, BLOCK_N)
    rd = tl.arange(0, BLOCK_D)
    for w in range(pid, n_work, n_prog):
        row = RED + (w // per_row) * N_FIELDS  # int64 like n_work
        tile = w % per_row
        n0 = (tile // n_d) * BLOCK_N
        d = (tile % n_d) * BLOCK_D + rd
        bh = tl.load(row)
        s0 = tl.load(row + 1)
        blen = tl.load(row + 2)
        p0 = tl.load(row + 3)
        p1 = tl.load(row + 4)
        b = bh // Hkv
        h = bh % Hkv
        acc = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        for p in range(p0, p1):
            acc += tl.load(PART + p * spp + (n0 + rn)[:, None] * spn + d[None, :], mask=d[None, :] < Dk + Dv,
                           other=0.0)
        tok = s0 + n0 + rn
        tin = n0 + rn < blen
        tl.store(DK + b * sdkb + tok[:, None] * sdkt + h * sdkh + d[None, :] * sdkd, acc.to(DK.dtype.element_ty),
                 mask=tin[:, None] & (d[None, :] < Dk))
        dvc = d - Dk
        tl.store(DV + b * sdvb + tok[:, None] * sdvt + h * sdvh + dvc[None, :] * sdvd, acc.to(DV.dtype.element_ty),
                 mask=tin[:, None] & (dvc[None, :] >= 0) & (dvc[None, :] < Dv))


def _empty(shape, like, dtype=None):
    out = torch.empty(shape, device=like.device, dtype=dtype or like.dtype)
    return out.fill_(float("nan")) if POISON_OUTPUTS else out


def sel_backward(do, q, k, v, o, lse, indices, seq_start, block_sel: int, scale: float, dq_into=None,
                 dq_more=None, q_offset: int = 0, kv_seq_start=None):
    """(dq, dk, dv) in the dtypes of q, k, v. indices: no repeated block in a row (the entry point
    deduplicates). dq_into: a [B, T, Hq, Dk] tensor of q's dtype holding other gradients of q; this
    branch's dq is added to it in place (and it is returned as dq). dq_more: (x, t_lo), more of them for
    tokens [t_lo, t_lo + x.shape[1]) (x [B, n, Hq, Dk], any strides), added too (needs dq_into)."""
    grads, launches = backward_launches(do, q, k, v, o, lse, indices, seq_start, block_sel, scale,
                                        dq_into=dq_into, dq_more=dq_more, q_offset=q_offset,
                                        kv_seq_start=kv_seq_start)
    for kernel, grid, args, kwargs in launches:
        kernel[grid](*args, **kwargs)
    return grads


def backward_launches(do, q, k, v, o, lse, indices, seq_start, block_sel: int, scale: float, cfg=None,
                      n_programs=None, dq_into=None, dq_more=None, q_offset: int = 0, kv_seq_start=None):
    """((dq, dk, dv), launches): the outputs and an iterator of the kernel launches that fill them, in order
    (dq + delta, dk/dv, reduce), each (kernel, grid, args, kwargs). The reverse index and the work plan are
    built when the iterator reaches the dK/dV launch: after the dq kernel has been launched, so their
    small device operations are issued while it runs instead of delaying it (at 8k they are host-bound).
    cfg / n_programs: launch parameters for another device than q's (ahead-of-time compile checks).
    q_offset: q's rows are the stream positions [q_offset, q_offset + T) of k, v's rows; kv_seq_start
    [B, Tk] gives the sequence start of each of k's rows (needed when q_offset > 0; seq_start otherwise)."""
    B, T, Hq, Dk = q.shape
    Hkv, Dv = k.shape[2], v.shape[3]
    if dq_into is not None and (dq_into.shape != q.shape or dq_into.dtype != q.dtype):
        raise ValueError(f"dq_into must be {tuple(q.shape)} {q.dtype}, got {tuple(dq_into.shape)} {dq_into.dtype}")
    dq = _empty(q.shape, q) if dq_into is None else dq_into
    if dq_more is not None and dq_into is None:
        raise ValueError("dq_more needs dq_into")
    dq2, t2_lo = dq_more if dq_more is not None else (dq, 0)
    t2_hi = t2_lo + dq2.shape[1] if dq_more is not None else 0
    dk = _empty(k.shape, k)
    dv = _empty(v.shape, v)
    if B * T * Hq == 0:
        return (dq if dq_into is not None else dq.zero_(), dk.zero_(), dv.zero_()), []
    G = Hq // Hkv
    cfg = cfg or bwd_config(G, Dk, Dv, block_sel, q.dtype, q.device, tma=tma.supported(k, v))
    n_programs = n_programs or _n_programs(q.device)
    lse = lse.contiguous()
    delta = torch.empty_like(lse)  # rowsum(dO * O), written by the dq kernel
    qk_scale = scale * LOG2E
    dqc = cfg["dq"]
    kd, vd = tma.kv_descriptors(dqc.get("TMA", False), k, v, dqc["BLOCK_N"], dqc["BLOCK_DK"], dqc["BLOCK_DV"],
                                "sel_dq")
    kd2 = tma.tail_descriptor(dqc.get("TMA", False), k, dqc["BLOCK_N"], dqc.get("BLOCK_DK2", 0), "sel_dq")
    dq_launch = (_sel_bwd_dq_kernel, (T, B * Hkv, triton.cdiv(G, dqc["BLOCK_G"])), (
        q, k, v, kd, vd, kd2, indices, seq_start, o, do, lse, delta, dq, dq2,
        *q.stride(), *k.stride(), *v.stride(), *indices.stride(), *seq_start.stride(), *o.stride(), *do.stride(),
        *lse.stride(), *dq.stride(), *dq2.stride(), t2_lo, t2_hi,
        Hkv, G, Dk, Dv, indices.shape[3], block_sel, qk_scale, scale, q_offset,
    ), dict(IEEE=cfg["ieee"], ACCUMULATE=dq_into is not None, N_PAD=_np2(indices.shape[3]), **dqc))

    def launches():
        yield dq_launch
        plan = plan_backward(indices, seq_start, block_sel, cfg["chunk"], q_offset, kv_seq_start)
        part = torch.empty(plan.n_partials_bound, cfg["ls_pad"], Dk + Dv, device=q.device, dtype=torch.float32)
        yield (_sel_bwd_dkdv_kernel, (max(1, min(n_programs, plan.items.shape[0] * cfg["n_sub"])),), (
            q, k, v, do, lse, delta, dk, dv, part, plan.items, plan.n_items, plan.queries,
            *q.stride(), *k.stride(), *v.stride(), *do.stride(), *lse.stride(), *dk.stride(), *dv.stride(),
            part.stride(0), part.stride(1),
            Hkv, G, Dk, Dv, qk_scale, scale, q_offset,
        ), dict(N_SUB=cfg["n_sub"], IEEE=cfg["ieee"], N_FIELDS=ITEM_FIELDS, **cfg["dkdv"]))
        yield (_sel_bwd_reduce_kernel, (n_programs,), (
            part, dk, dv, plan.reduce, plan.n_reduce,
            part.stride(0), part.stride(1), *dk.stride(), *dv.stride(),
            Hkv, Dk, Dv,
        ), dict(LS_PAD=cfg["ls_pad"], N_FIELDS=REDUCE_FIELDS, **cfg["reduce"]))

    return (dq, dk, dv), launches()


def plan_backward(indices, seq_start, block_sel: int, chunk: int, q_offset: int = 0, kv_seq_start=None):
    """The reverse index and the dK/dV work plan (device tensors only, no host sync)."""
    return plan_work(build_reverse_index(indices, seq_start, block_sel, q_offset, kv_seq_start), chunk)


__all__ = ["sel_backward", "backward_launches", "plan_backward", "bwd_config"]
