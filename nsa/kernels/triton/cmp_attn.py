"""NSA's compressed branch on Triton (Hopper TMA copies): each query's attention over the compressed blocks
that end at or before it (block i covers tokens [i*d, i*d + l); query t sees it iff i*d + l - 1 <= t), GQA
by index, forward and backward. Rows that see no block (t < l - 1) give o = 0 and lse = -inf.

Why kernels of our own for a branch cuDNN serves: on short sequences cuDNN's fold of the branch (q as rows
of d tokens against the expanded compressed K/V, nsa.branches.compressed.fold) spends more on its glue
than on attention. H200, bf16, 16 x 4k, Hq=64, Hkv=4, D=128, paper blocks, one forward+backward: 6.5 ms,
of which the backward's dO.O pass 1.1, its fp32 dq conversion 0.9 and the sums of dK/dV over the expanded
heads 0.5, and the attention itself (fprop 1.0, bprop 3.0). These kernels read q and K/V as they are and
reduce each group's heads inside the dK/dV program.

Measured, they are off by default (NSA_TRITON_CMP_MAX_LEN=0; bench/results/h100-cu130-torch2.11/triton-cmp/).
H100, bf16, Hq=64, Hkv=4, D=128, paper blocks, the whole NSA forward / backward with them against cuDNN's
fold in the same run: 16 x 4k packed 18.50 / 48.04 ms against 18.00 / 49.78 (2% faster, peak memory 13.2
against 16.7 GiB); one sequence of 4k 2.22 / 5.02 against 2.12 / 4.05, 8k 3.03 / 7.54 against 3.13 / 7.37,
64k 37.15 / 93.92 against 35.24 / 74.19 (the dK/dV kernel's walk over every later query tile grows with T;
cuDNN's bprop is the faster kernel there). Setting the toggle to a sequence length turns them on up to it
(nsa.plan.rules.cmp_triton_guard), for the memory above all.
Profiled (torch.profiler, same H100, kernels' GPU time per forward+backward): 16 x 4k packed 65.6 ms with
them against 66.8 with the fold; one sequence of 4k 4.68 against 4.78, so the 4k loss on the wall clock is
the host's launches, not the GPU. Their forward (1.76 ms at 16 x 4k) is slower than cuDNN's fprop (0.99):
the first place to tune.

Forward: the window kernels' tiles (nsa.kernels.triton.window: one program per 64 queries and query
head, 64-key tiles); the key tiles every row of the query tile sees run unmasked, the rest against each
row's count of visible blocks (a staircase of d tokens per block). It writes o and the log-sum-exp
[B, T, Hq] (natural log: the top-n kernel's layout).

Backward: delta = rowsum(o * dO) (the window's delta kernel); dK/dV: one program per key tile, batch x KV
head and share of the group's heads, over every query tile from the first that sees the tile to T. The
first blocks are seen by every later query, so a tile's work grows with T - its position: split over
shares of the heads, the longest program is that many times shorter; the shares' fp32 partials are summed
afterwards (compressed K/V are d times shorter than q: a small sum). dQ: one program per query tile and
head over the key tiles its last row sees. Offsets are int64; TMA copies read rows outside the tensors as
zeros, and keys at or past the cache's block count are masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import tma
from .common import pv_dot, softmax_step
from .window import (
    LOG2E,
    _logits,
    _q_descriptors,
    _q_tiles,
    _query_tile,
    _window_delta_kernel,
    backward_config,
    launch_config,
)
from .window import supported as _window_supported

LN2 = tl.constexpr(0.6931471805599453)  # a jit function reads globals only as constexpr


@triton.jit
def _n_vis(t, BL: tl.constexpr, BD: tl.constexpr):
    """Compressed blocks visible to query t (int, any shape): (t - l + 1) // d + 1 where t >= l - 1, else 0
    (the division on non-negative values only: the interpreter and the GPU round negatives apart)."""
    return tl.where(t >= BL - 1, tl.maximum(t - (BL - 1), 0) // BD + 1, 0)


@triton.jit
def _cmp_blocks(acc, l_i, m_i, q, q2, KD, KD2, VD, b, hk, lo, hi, rn, nv, NK, qk_scale, MASK: tl.constexpr,
                BN: tl.constexpr, DK: tl.constexpr, DK2: tl.constexpr, DV: tl.constexpr, STAGES: tl.constexpr):
    """Key tiles [lo, hi) of one query tile into the online softmax state; MASK: against each row's count of
    visible blocks nv [BM] and the block count NK."""
    for n0 in tl.range(lo, hi, BN, num_stages=STAGES):
        s = _logits(q, q2, KD, KD2, b, n0, hk, BN, DK, DK2)
        if MASK:
            key = n0 + rn
            s = tl.where((key[None, :] < nv[:, None]) & (key < NK)[None, :], s * qk_scale, float("-inf"))
        else:
            s = s * qk_scale
        p, alpha, m_i, l_i = softmax_step(s, m_i, l_i, False)  # m_i starts finite (-1e30): no -inf guard
        v = tl.reshape(VD.load([b, n0, hk, 0]), [BN, DV])
        acc = acc * alpha[:, None] + pv_dot(p, v, False)
    return acc, l_i, m_i


@triton.jit
def _cmp_fwd_kernel(QD, QD2, KD, KD2, VD, O, LSE, sob, sot, soh, slb, slt, slh, T, NK, Hq, G, qk_scale,
                    BL: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, DK: tl.constexpr,
                    DV: tl.constexpr, STAGES: tl.constexpr, DK2: tl.constexpr = 0):
    b, h, hk, m0, rm, q, q2 = _query_tile(QD, QD2, Hq, G, BM, DK, DK2)
    rn = tl.arange(0, BN)
    m_i = tl.full([BM], -1.0e30, tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, DV], tl.float32)
    nv = _n_vis(rm, BL, BD)
    hi = tl.minimum(_n_vis(tl.minimum(m0 + BM, T) - 1, BL, BD), NK)
    full = tl.minimum(_n_vis(m0, BL, BD), hi) // BN * BN  # every row of the tile sees these
    acc, l_i, m_i = _cmp_blocks(acc, l_i, m_i, q, q2, KD, KD2, VD, b, hk, 0, full, rn, nv, NK, qk_scale, False, BN,
                                DK, DK2, DV, STAGES)
    acc, l_i, m_i = _cmp_blocks(acc, l_i, m_i, q, q2, KD, KD2, VD, b, hk, full, hi, rn, nv, NK, qk_scale, True, BN,
                                DK, DK2, DV, STAGES)
    row_ok = rm < T
    seen = l_i > 0  # a row before the first block's end sees none: o = 0, lse = -inf
    l_safe = tl.where(seen, l_i, 1.0)
    rd = tl.arange(0, DV)
    b64, h64, rm64 = b.to(tl.int64), h.to(tl.int64), rm.to(tl.int64)
    o = acc / l_safe[:, None]
    tl.store(O + b64 * sob + rm64[:, None] * sot + h64 * soh + rd[None, :], o.to(O.dtype.element_ty),
             mask=row_ok[:, None])
    lse = tl.where(seen, (m_i + tl.log2(l_safe)) * LN2, float("-inf"))
    tl.store(LSE + b64 * slb + rm64 * slt + h64 * slh, lse, mask=row_ok)


def _check(q, k_cmp, v_cmp, block_cmp: int, stride_cmp: int) -> int:
    """The compressed blocks the last query sees (the block count k_cmp must hold at least)."""
    T = q.shape[1]
    if block_cmp < 1 or stride_cmp < 1:
        raise ValueError(f"block_cmp and stride_cmp must be >= 1, got {block_cmp} and {stride_cmp}")
    need = (T - block_cmp) // stride_cmp + 1 if T >= block_cmp else 0
    if k_cmp.shape[1] < need or v_cmp.shape[1] != k_cmp.shape[1]:
        raise ValueError(f"k_cmp / v_cmp hold {k_cmp.shape[1]} / {v_cmp.shape[1]} blocks; queries up to T={T} "
                         f"see {need} (l={block_cmp}, d={stride_cmp})")
    return need


def supported(q: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor) -> tuple[bool, str]:
    """(whether cmp_forward / cmp_backward serve these tensors, why not): the window kernels' head dims and
    TMA copies."""
    return _window_supported(q, k_cmp, v_cmp)


def cmp_forward(q, k_cmp, v_cmp, block_cmp: int, stride_cmp: int, scale: float, config: dict | None = None):
    """(o [B, T, Hq, Dv] in q's dtype, lse [B, T, Hq] fp32 natural log, -inf for rows that see no block) of
    q [B, T, Hq, Dk] over k_cmp [B, N, Hkv, Dk], v_cmp [B, N, Hkv, Dv] (N >= the blocks query T - 1 sees)."""
    B, T, Hq, _ = q.shape
    Hkv, D, NK = k_cmp.shape[2], v_cmp.shape[-1], k_cmp.shape[1]
    need = _check(q, k_cmp, v_cmp, block_cmp, stride_cmp)
    meta = {**launch_config(q.shape[-1], D), **(config or {})}
    if not torch.cuda.is_available():
        meta.pop("num_warps", None)
    o = torch.empty(B, T, Hq, D, device=q.device, dtype=q.dtype)
    lse = torch.empty(B, T, Hq, device=q.device, dtype=torch.float32)
    if B * T * Hq == 0:
        return o, lse
    if need == 0:  # no query sees a block
        return o.zero_(), lse.fill_(float("-inf"))
    qd, qd2, dk, dk2 = _q_descriptors(q, meta["BM"], "cmp_fwd")
    kd, vd = tma.kv_descriptors(True, k_cmp, v_cmp, meta["BN"], dk, D, "cmp_fwd")
    kd2 = tma.tail_descriptor(True, k_cmp, meta["BN"], dk2, "cmp_fwd")
    grid = (B * Hq, triton.cdiv(T, meta["BM"]))
    _cmp_fwd_kernel[grid](qd, qd2, kd, kd2, vd, o, lse, o.stride(0), o.stride(1), o.stride(2), lse.stride(0),
                          lse.stride(1), lse.stride(2), T, NK, Hq, Hq // Hkv, scale * LOG2E, BL=block_cmp,
                          BD=stride_cmp, DK=dk, DV=D, DK2=dk2, **meta)
    return o, lse


# --- backward ----------------------------------------------------------------------------------------------


@triton.jit
def _cmp_dkdv_kernel(QD, QD2, KD, KD2, VD, DOD, LSE, DELTA, DKP, DVP, slb, slt, slh, T, NK, Hq, Hkv, G, heads_per,
                     qk_scale, BL: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                     DK: tl.constexpr, DV: tl.constexpr, STAGES: tl.constexpr, DK2: tl.constexpr = 0):
    """fp32 partial dK (unscaled), dV of one key tile of one KV head over one share of its group's heads: every
    query tile from the first that sees the tile to T. DKP [shares, B, NK, Hkv, DK + DK2], DVP [.., DV]."""
    SPLIT: tl.constexpr = DK2 > 0
    n0 = tl.program_id(0) * BN
    pid_bh = tl.program_id(1)
    share = tl.program_id(2)
    b = pid_bh // Hkv
    hk = pid_bh % Hkv
    rn = n0 + tl.arange(0, BN)
    k = tl.reshape(KD.load([b, n0, hk, 0]), [BN, DK])
    v = tl.reshape(VD.load([b, n0, hk, 0]), [BN, DV])
    dk = tl.zeros([BN, DK], tl.float32)
    dv = tl.zeros([BN, DV], tl.float32)
    if SPLIT:
        k2 = tl.reshape(KD2.load([b, n0, hk, DK]), [BN, DK2])
        dk2 = tl.zeros([BN, DK2], tl.float32)
    key_ok = rn < NK
    m_lo = (n0 * BD + BL - 1) // BM * BM  # the first query that sees key n0 lies in this tile
    g_lo = share * heads_per
    for g in range(g_lo, tl.minimum(g_lo + heads_per, G)):
        h = hk * G + g
        lrow = LSE + b.to(tl.int64) * slb + h * slh
        drow = DELTA + (b * Hq + h).to(tl.int64) * T
        for m0 in tl.range(m_lo, T, BM, num_stages=STAGES):
            rm = m0 + tl.arange(0, BM)
            row_ok = rm < T
            q, q2 = _q_tiles(QD, QD2, b, m0, h, BM, DK, DK2)
            do = tl.reshape(DOD.load([b, m0, h, 0]), [BM, DV])
            lse2 = tl.load(lrow + rm.to(tl.int64) * slt, mask=row_ok, other=0.0) * 1.4426950408889634
            delta = tl.load(drow + rm, mask=row_ok, other=0.0)
            s_t = tl.dot(k, tl.trans(q))  # [BN, BM]: key rows, query columns
            if SPLIT:
                s_t += tl.dot(k2, tl.trans(q2))
            ok = (rn[:, None] < _n_vis(rm, BL, BD)[None, :]) & key_ok[:, None] & row_ok[None, :]
            p_t = tl.where(ok, tl.exp2(s_t * qk_scale - lse2[None, :]), 0.0)
            dv += tl.dot(p_t.to(do.dtype), do)
            dp_t = tl.dot(v, tl.trans(do))
            ds_t = p_t * (dp_t - delta[None, :])
            dk += tl.dot(ds_t.to(q.dtype), q)
            if SPLIT:
                dk2 += tl.dot(ds_t.to(q2.dtype), q2)
    DKT: tl.constexpr = DK + DK2
    row = ((share * tl.num_programs(1) + pid_bh).to(tl.int64) * NK + rn.to(tl.int64))  # (share, b, hk) rows
    # [shares, B, NK, Hkv, D] stored as [shares, B * Hkv, NK, D]: one program's rows contiguous
    rd = tl.arange(0, DK)
    tl.store(DKP + row[:, None] * DKT + rd[None, :], dk, mask=key_ok[:, None])
    if SPLIT:
        rd2 = DK + tl.arange(0, DK2)
        tl.store(DKP + row[:, None] * DKT + rd2[None, :], dk2, mask=key_ok[:, None])
    rdv = tl.arange(0, DV)
    tl.store(DVP + row[:, None] * DV + rdv[None, :], dv, mask=key_ok[:, None])


@triton.jit
def _cmp_dq_kernel(QD, QD2, KD, KD2, VD, DOD, LSE, DELTA, DQ, sqb, sqt, sqh, slb, slt, slh, T, NK, Hq, G, qk_scale,
                   sm_scale, BL: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   DK: tl.constexpr, DV: tl.constexpr, STAGES: tl.constexpr, DK2: tl.constexpr = 0):
    """dQ of one query tile of one head: the key tiles its last row sees."""
    SPLIT: tl.constexpr = DK2 > 0
    b, h, hk, m0, rm, q, q2 = _query_tile(QD, QD2, Hq, G, BM, DK, DK2)
    row_ok = rm < T
    b64, h64, rm64 = b.to(tl.int64), h.to(tl.int64), rm.to(tl.int64)
    do = tl.reshape(DOD.load([b, m0, h, 0]), [BM, DV])
    lse2 = tl.load(LSE + b64 * slb + rm64 * slt + h64 * slh, mask=row_ok, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + (b64 * Hq + h64) * T + rm, mask=row_ok, other=0.0)
    nv = _n_vis(rm, BL, BD)
    dq = tl.zeros([BM, DK], tl.float32)
    if SPLIT:
        dq2 = tl.zeros([BM, DK2], tl.float32)
    hi = tl.minimum(_n_vis(tl.minimum(m0 + BM, T) - 1, BL, BD), NK)
    for n0 in tl.range(0, hi, BN, num_stages=STAGES):
        rn = n0 + tl.arange(0, BN)
        k = tl.reshape(KD.load([b, n0, hk, 0]), [BN, DK])
        v = tl.reshape(VD.load([b, n0, hk, 0]), [BN, DV])
        s = tl.dot(q, tl.trans(k))
        if SPLIT:
            k2 = tl.reshape(KD2.load([b, n0, hk, DK]), [BN, DK2])
            s += tl.dot(q2, tl.trans(k2))
        ok = (rn[None, :] < nv[:, None]) & (rn < NK)[None, :]
        p = tl.where(ok, tl.exp2(s * qk_scale - lse2[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k)
        if SPLIT:
            dq2 += tl.dot(ds.to(k2.dtype), k2)
    base = DQ + b64 * sqb + rm64[:, None] * sqt + h64 * sqh
    rd = tl.arange(0, DK)
    tl.store(base + rd[None, :], (dq * sm_scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])
    if SPLIT:
        rd2 = DK + tl.arange(0, DK2)
        tl.store(base + rd2[None, :], (dq2 * sm_scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])


def head_shares(G: int, key_tiles: int, BHkv: int, device) -> int:
    """Shares of a group's heads for the dK/dV kernel: enough programs for about 4 per SM (1 on CPU)."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = max(1, triton.cdiv(4 * sms, max(1, key_tiles * BHkv)))
    per = triton.cdiv(G, min(G, want))
    return triton.cdiv(G, per)


def cmp_backward(do, q, k_cmp, v_cmp, o, lse, block_cmp: int, stride_cmp: int, scale: float,
                 config: dict | None = None):
    """(dq, dk_cmp, dv_cmp) of cmp_forward from its o and lse and the output gradient do [B, T, Hq, Dv].
    config overrides backward_config's entries (and SHARES, the dK/dV kernel's shares of each group's heads)."""
    B, T, Hq, Dk = q.shape
    Hkv, D, NK = k_cmp.shape[2], v_cmp.shape[-1], k_cmp.shape[1]
    need = _check(q, k_cmp, v_cmp, block_cmp, stride_cmp)
    meta = {**backward_config(Dk, D), **(config or {})}
    if config and "BM_KV" not in config:  # the caller's tiles serve both kernels
        meta.pop("BM_KV", None)
        meta.pop("STAGES_KV", None)
    if not torch.cuda.is_available():
        meta.pop("num_warps", None)
    dq = torch.empty_like(q)
    if B * T * Hq == 0 or need == 0:
        return dq.zero_(), torch.zeros_like(k_cmp), torch.zeros_like(v_cmp)
    do = do.contiguous()
    G = Hq // Hkv
    BM, BN, stages, warps = meta["BM"], meta["BN"], meta["STAGES"], meta.get("num_warps")
    bm_kv, stages_kv = meta.get("BM_KV", BM), meta.get("STAGES_KV", stages)
    extra = {} if warps is None else {"num_warps": warps}
    delta = torch.empty(B, Hq, T, device=q.device, dtype=torch.float32)
    _window_delta_kernel[(B * Hq, triton.cdiv(T, 64))](o, do, delta, o.stride(0), o.stride(1), o.stride(2), T, Hq,
                                                       BM=64, D=D, **extra)
    qd, qd2, dkt, dk2 = _q_descriptors(q, BM, "cmp_bwd")
    dod = tma.tile_descriptor(do, BM, D, "cmp_bwd")
    if bm_kv == BM:
        qd_kv, qd2_kv, dod_kv = qd, qd2, dod
    else:
        qd_kv, qd2_kv, _, _ = _q_descriptors(q, bm_kv, "cmp_bwd")
        dod_kv = tma.tile_descriptor(do, bm_kv, D, "cmp_bwd")
    kd, vd = tma.kv_descriptors(True, k_cmp, v_cmp, BN, dkt, D, "cmp_bwd")
    kd2 = tma.tail_descriptor(True, k_cmp, BN, dk2, "cmp_bwd")
    key_tiles = triton.cdiv(NK, BN)
    shares = meta.get("SHARES") or head_shares(G, key_tiles, B * Hkv, q.device)
    heads_per = triton.cdiv(G, shares)
    shares = triton.cdiv(G, heads_per)
    dkp = torch.empty(shares, B * Hkv, NK, dkt + dk2, device=q.device, dtype=torch.float32)
    dvp = torch.empty(shares, B * Hkv, NK, D, device=q.device, dtype=torch.float32)
    lse_s = lse.stride()
    _cmp_dkdv_kernel[(key_tiles, B * Hkv, shares)](
        qd_kv, qd2_kv, kd, kd2, vd, dod_kv, lse, delta, dkp, dvp, *lse_s, T, NK, Hq, Hkv, G, heads_per,
        scale * LOG2E, BL=block_cmp, BD=stride_cmp, BM=bm_kv, BN=BN, DK=dkt, DV=D, STAGES=stages_kv, DK2=dk2, **extra)
    _cmp_dq_kernel[(B * Hq, triton.cdiv(T, BM))](
        qd, qd2, kd, kd2, vd, dod, lse, delta, dq, dq.stride(0), dq.stride(1), dq.stride(2), *lse_s, T, NK, Hq, G,
        scale * LOG2E, scale, BL=block_cmp, BD=stride_cmp, BM=BM, BN=BN, DK=dkt, DV=D, STAGES=stages, DK2=dk2,
        **extra)
    # the shares' partials, [shares, B * Hkv, NK, D] -> [B, NK, Hkv, D]
    dk = (dkp.sum(0) * scale)[..., :Dk].unflatten(0, (B, Hkv)).transpose(1, 2).to(k_cmp.dtype)
    dv = dvp.sum(0).unflatten(0, (B, Hkv)).transpose(1, 2).to(v_cmp.dtype)
    return dq, dk.contiguous(), dv.contiguous()


__all__ = ["cmp_backward", "cmp_forward", "head_shares", "supported"]
