"""Forward of NSA's selected attention (Triton): o and the log-sum-exp for the backward.

Group-centric: one program per (TOKENS consecutive tokens, batch x KV head, tile of query heads). The G
query heads of a KV head are the rows of tl.dot (padded to BLOCK_G >= 16), so each selected K/V block
is loaded once per token and group. A program may walk TOKENS consecutive tokens in turn (fewer, longer
programs); they share the forced blocks, but the pipelined copies bypass L1 (ncu at 64k: 0.4% L1 hits),
so the kernel is bound by L2 bandwidth over the gathered K/V, not by reuse (ncu, H100, 16k, one warp with
64-token TMA tiles in 2 stages: L2 throughput 80% of peak, SM 26%; tile length, stages and programs per SM
move it by 1-2% at 64k, bench/tune_kernels.py).

Reading each forced block once for several tokens (the first n_init and the n_local ending at the own
block are the same for every token of a selection block) would cut the gathered bytes by up to 3/16 at
the paper's settings. Two forms were measured on an H100 at 64k and both were slower than this kernel
(16.7 ms): the forced blocks first for 2-4 tokens' rows at once, then each token's walk (22.8 ms at
best), and the same with the tokens' walks batched as 3-D dots (23.8 ms at best). Both need 4 warps and
keep a multi-token softmax state live, so fewer programs fit per SM and the L2 throughput dropped to about
52% (ncu).

Short sequences share far more: at 4k, 2 / 4 / 8 consecutive tokens' random selections have a union of 19.9 /
26.1 / 30.6 blocks (0.70 / 0.46 / 0.27 of the separate loads, 1.41 / 1.85 / 2.17x the rows x blocks of the
dots). A walk over the sorted union of P tokens' blocks, each K/V tile loaded once for P x 16 rows masked by
membership, was still no faster (H100, bf16, Hq=64, Hkv=4, D=128, random top-n indices, this kernel alone,
two rounds): 16 x 4k packed 11.14-11.21 ms against 11.31 at best (4 tokens, 64-token tiles, 4 warps, 2 stages)
and 13.4 (2 tokens, 16-token tiles, one warp); 8k 1.75-1.97 against 1.97; 64k 16.0-16.3 against 18.4 at best.
The 64-row dots of the union cost what its saved copies did.

The block loop is flat and branch-free so Triton can software-pipeline it (num_stages: the K/V tiles of
the next blocks are copied asynchronously while the current one is computed, by TMA on Hopper: tma.py).
Iteration `it` takes block it // N_SUB and its sub-tile it % N_SUB (blocks longer than BLOCK_N); a -1 id
or a token after the query is masked (in the loads, or in the scores of a TMA tile). The walk stops after
the last tile that holds a visible token where the row lists its visible blocks first (common.selected_tiles:
the top-n step's rows, whose tokens early in a sequence see fewer than n blocks). V is loaded after the
first dot, so the K and V tiles are never live at once.
Online softmax in fp32, exp2 domain. Offsets are int64 where a stride times an index can pass 2**31.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..device import device_capability
from . import tma
from .combine import _gates, _segment_off
from .common import bh_program, load_tile, pv_dot, qk_dot, selected_tiles, softmax_step, split_dim
from .common import next_pow2 as _np2

LOG2E = 1.4426950408889634


@triton.jit
def _combine_row(o, GT, A, A2, W, OUT, b, t, heads, rd, g_ok, gd_ok, a_lo, a_hi, a2_hi, sg0, sg1, sg2, sg3,
                 sa0, sa1, sa2, sa3, sb0, sb1, sb2, sb3, s0, s1, s2, s3):
    """The gate combine of one token's heads, with the combine kernel's helpers and arithmetic (fp32 on the
    branch outputs in their stored dtype): out = g_cmp * o_cmp + g_sel * o + g_win * o_win, with o_cmp in
    two token segments [a_lo, a_hi) and [a_hi, a2_hi) (0 outside); OUT and W have o's strides (s0..s3)."""
    g0, g1, g2 = _gates(GT, b, t, heads, g_ok, sg0, sg1, sg2, sg3)
    off, in1 = _segment_off(b, t, heads, a_lo, a_hi, sa0, sa1, sa2)
    a = tl.load(A + off[:, None] + rd[None, :] * sa3, mask=gd_ok & in1, other=0.0).to(tl.float32)
    off, in2 = _segment_off(b, t, heads, a_hi, a2_hi, sb0, sb1, sb2)
    a += tl.load(A2 + off[:, None] + rd[None, :] * sb3, mask=gd_ok & in2, other=0.0).to(tl.float32)
    w = tl.load(W + b * s0 + t * s1 + heads[:, None] * s2 + rd[None, :] * s3, mask=gd_ok, other=0.0)
    out = g0 * a + g1 * o.to(tl.float32) + g2 * w.to(tl.float32)
    tl.store(OUT + b * s0 + t * s1 + heads[:, None] * s2 + rd[None, :] * s3, out.to(OUT.dtype.element_ty),
             mask=gd_ok)


@triton.jit
def _sel_fwd_kernel(
    Q, K, V, KD, VD, KD2, IDX, SS, O, LSE,
    sqb, sqt, sqh, sqd,
    skb, skt, skh, skd,
    svb, svt, svh, svd,
    sib, sit, sih, sin,
    ssb, sst,
    sob, sot, soh, sod,
    slb, slt, slh,
    T, Hkv, G, Dk, Dv, n_sel, block_sel, qk_scale, q_off,
    GT, A, A2, W, OUT, a_lo, a_hi, a2_hi,
    sg0, sg1, sg2, sg3, sa0, sa1, sa2, sa3, sb0, sb1, sb2, sb3,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    N_SUB: tl.constexpr, N_PAD: tl.constexpr, TOKENS: tl.constexpr, STAGES: tl.constexpr, EVEN_DK: tl.constexpr,
    EVEN_DV: tl.constexpr, IEEE: tl.constexpr, TMA: tl.constexpr = False, COMBINE: tl.constexpr = False,
    BLOCK_DK2: tl.constexpr = 0, EVEN_DK2: tl.constexpr = True,
):
    # BLOCK_DK2 > 0: q and K have a second column tile [BLOCK_DK, BLOCK_DK + BLOCK_DK2) (split_dim), its own
    # dot added to the logits; KD2 is its TMA descriptor.
    SPLIT: tl.constexpr = BLOCK_DK2 > 0
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
    k_base = K + b * skb + h * skh + rdk[None, :] * skd
    v_base = V + b * svb + h * svh + rdv[None, :] * svd
    if SPLIT:
        rdk2 = BLOCK_DK + tl.arange(0, BLOCK_DK2)
        dk2_ok = rdk2 < Dk
        k2_base = K + b * skb + h * skh + rdk2[None, :] * skd

    for tt in range(TOKENS):
        t = (tl.program_id(0) * TOKENS + tt).to(tl.int64)
        if t < T:
            start = tl.load(SS + b * ssb + t * sst).to(tl.int64)
            pos = t + q_off - start  # q_off: the stream position of row 0 (K/V rows are stream positions)
            q = tl.load(Q + b * sqb + t * sqt + heads[:, None] * sqh + rdk[None, :] * sqd,
                        mask=g_ok[:, None] & dk_ok[None, :], other=0.0)
            if SPLIT:
                q2 = tl.load(Q + b * sqb + t * sqt + heads[:, None] * sqh + rdk2[None, :] * sqd,
                             mask=g_ok[:, None] & dk2_ok[None, :], other=0.0)
            idx_base = IDX + b * sib + t * sit + h * sih
            m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_G], tl.float32)
            acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
            n_it = selected_tiles(idx_base, sin, n_sel, pos, block_sel, N_PAD, BLOCK_N, N_SUB)
            for it in tl.range(0, n_it, num_stages=STAGES):
                i = it // N_SUB
                c = (it - i * N_SUB) * BLOCK_N
                j = tl.load(idx_base + i * sin).to(tl.int64)
                local = j * block_sel + c + rn
                keep = (j >= 0) & (c + rn < block_sel) & (local <= pos)
                tok = start + local
                row0 = (start + j * block_sel + c).to(tl.int32)  # the tile's first row, for a TMA copy
                kb = load_tile(KD, k_base + tok[:, None] * skt, b, row0, h, keep, dk_ok, BLOCK_N, BLOCK_DK, TMA,
                               EVEN_DK)
                s = qk_dot(q, kb, IEEE)
                if SPLIT:
                    kb2 = load_tile(KD2, k2_base + tok[:, None] * skt, b, row0, h, keep, dk2_ok, BLOCK_N, BLOCK_DK2,
                                    TMA, EVEN_DK2, BLOCK_DK)
                    s += qk_dot(q2, kb2, IEEE)
                s = tl.where(keep[None, :], s * qk_scale, float("-inf"))
                p, alpha, m_new, l_i = softmax_step(s, m_i, l_i, True)
                # V after the first dot: K and V tiles are not live at once
                vb = load_tile(VD, v_base + tok[:, None] * svt, b, row0, h, keep, dv_ok, BLOCK_N, BLOCK_DV, TMA,
                               EVEN_DV)
                acc = acc * alpha[:, None] + pv_dot(p, vb, IEEE)
                m_i = m_new
            has = l_i > 0
            o = (acc / tl.where(has, l_i, 1.0)[:, None]).to(O.dtype.element_ty)
            gd_ok = g_ok[:, None] & dv_ok[None, :]
            tl.store(O + b * sob + t * sot + heads[:, None] * soh + rdv[None, :] * sod, o, mask=gd_ok)
            lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
            tl.store(LSE + b * slb + t * slt + heads * slh, lse, mask=g_ok)
            if COMBINE:
                _combine_row(o, GT, A, A2, W, OUT, b, t, heads, rdv, g_ok, gd_ok, a_lo, a_hi, a2_hi, sg0, sg1, sg2,
                             sg3, sa0, sa1, sa2, sa3, sb0, sb1, sb2, sb3, sob, sot, soh, sod)


def launch_config(G: int, Dk: int, Dv: int, block_sel: int, dtype, max_block_g: int = 64,
                  max_block_n: int = 64, tma: bool = False, combine: bool = False, capability=None) -> dict:
    """Tile sizes, tokens per program, warps, pipeline depth and TMA copies for one shape (H100, G=16,
    D=128, 8k-64k, bench/tune_kernels.py, tune_topn_sel.csv and tune_sel_fwd.csv): with pointer loads 2
    tokens per program, 3 stages, 4 warps; with TMA copies 1 token and 1 warp for up to 16 heads (64k: 16.5
    ms against 16.8 with 4 warps and 3 stages; 8k: 1.82 against 1.96 ms), in 16-token tiles with 3 stages
    (64k: 16.4-16.7 ms against 16.7-16.9 with 64-token tiles and 2 stages; 8k: 1.72-1.74 against 1.83-1.84
    ms). With the gate combine in the epilogue, 32-token tiles (H200, 64k: 13.65 ms against 13.86 with
    16-token tiles and 14.00 with 32-token tiles in 2 stages; 8k: 1.66 against 1.73).

    capability: the GPU's (None: sm 9.0's table). sm 8.x has entries of its own where these do not fit it:
    fp32 with more than 16 heads per group (64-row q tiles) needs 180-213 KB of shared memory per block in
    64-token tiles, past the A100's 163 KB, and at D=128 ptxas keeps 32 registers and spills 32 KB with 4
    warps; 32-token tiles with 8 warps need 57-140 KB and spill at most 820 bytes for D = 64-256
    (bench/triton_compile_check.py --arch 80; chosen by compile resources, not yet timed on an A100).

    Dk that is not a power of two runs as two column tiles (split_dim: 192 as 128 + 64). The paper's
    Dk=192 / Dv=128 with TMA copies: one warp, 32-token tiles, 2 stages (H200, 16k, this kernel alone: 4.08
    ms against 4.23-4.54 with 16-token tiles, 4.33 with two warps, 4.61 with four and 64-token tiles; as
    one 256-column tile it took 6.05 ms at best and 7.88 with the 8 warps it had before)."""
    dk_main, dk_tail = split_dim(Dk)
    split = dk_tail > 0
    width = dk_main + dk_tail + max(16, _np2(Dv))
    wide = width > 256
    # one padded tile: up to 128 columns each (width <= 256); two column tiles: up to the paper's 192 / 128
    one_warp = tma and (width <= 256 or split and width <= 320) and G <= 16 and dtype != torch.float32
    table = {
        "BLOCK_G": min(max(16, _np2(G)), max_block_g),
        "BLOCK_N": min(32 if combine or split else 16, max(16, _np2(block_sel))) if one_warp
        else min(max(16, _np2(block_sel)), max_block_n),
        "BLOCK_DK": dk_main,
        "BLOCK_DK2": dk_tail,
        "BLOCK_DV": max(16, _np2(Dv)),
        "TMA": tma,
        "TOKENS": 1 if wide or tma else 2,
        "STAGES": 2 if wide or split else 3,
        "num_warps": 1 if one_warp else 8 if wide else 4,
    }
    if capability is not None and capability[0] < 9 and dtype == torch.float32 and table["BLOCK_G"] > 16:
        table.update(BLOCK_N=min(table["BLOCK_N"], 32), num_warps=8)
    return table


def sel_forward(q, k, v, indices, seq_start, block_sel: int, scale: float, config: dict | None = None,
                max_block_g: int = 64, max_block_n: int = 64, combine=None, q_offset: int = 0):
    """(o [B, T, Hq, Dv] in q's dtype, lse [B, T, Hq] fp32 natural log, -inf = empty row).
    indices int32 [B, T, Hkv, n]; seq_start int [B, T]; config overrides launch_config's choices.
    q_offset: q's rows are the stream's positions [q_offset, q_offset + T) (k, v hold the stream from
    position 0 on, seq_start gives each row's sequence start in stream positions); 0 for the plain call.

    combine = (gates, o_cmp Segments, o_win): the gate combine runs in the kernel's epilogue and the result
    is (out, o, lse). At T=64k on an H200 (bf16, Hq=64, Hkv=4, D=128) that takes 14.00 ms against 14.45
    for this kernel and the separate combine kernel (which reads 3 GB and writes 1 GB): the kernel is
    bound by L2 bandwidth over the gathered K/V and hides most of the extra reads. Skipping the o and LSE
    stores when no backward needs them was slower (14.4-14.8 ms), so they are always written."""
    B, T, Hq, Dk = q.shape
    Hkv, Dv = k.shape[2], v.shape[3]
    o = torch.empty(B, T, Hq, Dv, device=q.device, dtype=q.dtype)
    lse = torch.empty(B, T, Hq, device=q.device, dtype=torch.float32)
    out = torch.empty(B, T, Hq, Dv, device=q.device, dtype=q.dtype) if combine is not None else None
    if combine is None:
        comb_args = (o, o, o, o, o, 0, 0, 0, *([0] * 12))
    else:  # (every argument costs the launch about 2.5 us of host time: out and o_win take o's strides)
        gates, seg, o_win = combine
        o_win = o_win if o_win.stride() == o.stride() else o_win.contiguous()
        m, tail, lo, hi, hi2, *sa = seg.args()
        comb_args = (gates, m, tail, o_win, out, lo, hi, hi2, *gates.stride(), *sa)
    if B * T * Hq == 0:
        o, lse = o.zero_(), lse.fill_(float("-inf"))
        return (o, lse) if combine is None else (out, o, lse)
    G = Hq // Hkv
    use_tma = tma.supported(k, v) if (config or {}).get("TMA") is None else config["TMA"]
    meta = {**launch_config(G, Dk, Dv, block_sel, q.dtype, max_block_g, max_block_n, use_tma, combine is not None,
                            device_capability(q.device)), **(config or {})}
    if not torch.cuda.is_available():
        meta.pop("num_warps", None)
    n = indices.shape[3]
    meta["N_SUB"], meta["N_PAD"] = triton.cdiv(block_sel, meta["BLOCK_N"]), _np2(n)
    meta["EVEN_DK"], meta["EVEN_DV"] = meta["BLOCK_DK"] <= Dk, meta["BLOCK_DV"] == Dv
    meta["EVEN_DK2"] = meta["BLOCK_DK"] + meta["BLOCK_DK2"] == Dk
    grid = (triton.cdiv(T, meta["TOKENS"]), B * Hkv, triton.cdiv(G, meta["BLOCK_G"]))
    kd, vd = tma.kv_descriptors(meta["TMA"], k, v, meta["BLOCK_N"], meta["BLOCK_DK"], meta["BLOCK_DV"], "sel_fwd")
    kd2 = tma.tail_descriptor(meta["TMA"], k, meta["BLOCK_N"], meta["BLOCK_DK2"], "sel_fwd")
    _sel_fwd_kernel[grid](
        q, k, v, kd, vd, kd2, indices, seq_start, o, lse,
        *q.stride(), *k.stride(), *v.stride(), *indices.stride(), *seq_start.stride(), *o.stride(), *lse.stride(),
        T, Hkv, G, Dk, Dv, n, block_sel, scale * LOG2E, q_offset, *comb_args,
        IEEE=q.dtype == torch.float32, COMBINE=combine is not None, **meta,
    )
    return (o, lse) if combine is None else (out, o, lse)


__all__ = ["sel_forward", "launch_config"]
