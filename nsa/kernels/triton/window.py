"""NSA's sliding-window branch (Triton, Hopper TMA copies): causal attention over the last `window` keys of
each query, GQA by index, forward and backward.

Why kernels of our own for a branch FA-2 already serves: PyTorch's built-in FA-2 runs the window branch
at about 205 TF/s forward on an H200 (T=64k, Hq=64, Hkv=4, D=128, w=512: 5.35 ms), this forward at about
350 (3.13 ms), where dense causal FA-2 reaches 340; the backward takes 11.1 ms against FA-2's 14.0 (plus
FA-2's separate sums of dK/dV over each group's heads). With a band of w keys per query, FA-2's 128-row
tiles spend most of their few key blocks on the masked edges; 64-row tiles with 64-key blocks (4 warps,
TMA) waste less and keep more programs per SM (bench/tune_kernels.py --kernels window: 3.13 ms
at 64k against 3.99 for the best 128-row tiles; 0.40 ms at 8k against 0.51, and 0.67 for FA-2).

Forward: one program per (64 queries, batch x query head); the grid's first axis is the head so that the
G heads of a KV head run side by side and share its K/V tiles in L2. Key blocks come in three runs: the
window's lower edge (masked), the blocks every row sees (no mask), the causal diagonal (masked). Online
softmax in fp32, exp2 domain; the running max starts at a finite -1e30 so that a row with no key yet in a
block gives p = 0 rather than NaN. It writes o and the log-sum-exp [B, Hq, T] (FA-2's layout).

Backward (FlashAttention-2's scheme): delta = rowsum(o * dO); one program per key tile of a KV head
accumulates dK and dV over every query head of its group and every query tile that sees the tile (so no
atomics and no separate sum over the group); one program per query tile and head accumulates dQ over
the key tiles of its window. Offsets are int64; TMA copies read rows outside [0, T) as zeros.

Head dims: Dv a power of two, Dk a power of two or three quarters of one (common.split_dim: the paper's
Dk=192 as column tiles of 128 and 64, each by its own TMA copy, the two dots summed into the logits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import tma
from .common import pv_dot, qk_dot, softmax_step, split_dim

LOG2E = 1.4426950408889634
HEAD_DIMS = (64, 128, 256)  # Dv, and Dk as one tile: tl.arange needs a power of two
SPLIT_HEAD_DIMS = (96, 192)  # Dk as two column tiles (split_dim); FA-2 serves the rest


@triton.jit
def _logits(q, q2, KD, KD2, b, n0, hk, BN: tl.constexpr, DK: tl.constexpr, DK2: tl.constexpr):
    """q [BM, DK] (and its second column tile q2 [BM, DK2] when DK2 > 0) against the key tile at n0: [BM, BN]."""
    k = tl.reshape(KD.load([b, n0, hk, 0]), [BN, DK])
    s = qk_dot(q, k, False)
    if DK2 > 0:
        k2 = tl.reshape(KD2.load([b, n0, hk, DK]), [BN, DK2])
        s += qk_dot(q2, k2, False)
    return s


@triton.jit
def _window_blocks(acc, l_i, m_i, q, q2, KD, KD2, VD, b, hk, lo, hi, rm, rn, qk_scale, left,
                   MASK: tl.constexpr, BN: tl.constexpr, DK: tl.constexpr, DK2: tl.constexpr, DV: tl.constexpr,
                   STAGES: tl.constexpr):
    """Key blocks [lo, hi) of one query tile into the online softmax state (acc, l_i, m_i)."""
    for n0 in tl.range(lo, hi, BN, num_stages=STAGES):
        s = _logits(q, q2, KD, KD2, b, n0, hk, BN, DK, DK2)
        if MASK:
            back = rm[:, None] - (n0 + rn)[None, :]  # how far the key lies behind the query
            s = tl.where((back >= 0) & (back <= left), s * qk_scale, float("-inf"))
        else:
            s = s * qk_scale
        p, alpha, m_i, l_i = softmax_step(s, m_i, l_i, False)  # m_i starts finite (-1e30): no -inf guard
        v = tl.reshape(VD.load([b, n0, hk, 0]), [BN, DV])
        acc = acc * alpha[:, None] + pv_dot(p, v, False)
    return acc, l_i, m_i


@triton.jit
def _q_tiles(QD, QD2, b, m0, h, BM: tl.constexpr, DK: tl.constexpr, DK2: tl.constexpr):
    """The q tile [BM, DK] of head h from query m0, and its second column tile [BM, DK2] (q itself when DK2 is 0,
    unused)."""
    q = tl.reshape(QD.load([b, m0, h, 0]), [BM, DK])
    if DK2 > 0:
        q2 = tl.reshape(QD2.load([b, m0, h, DK]), [BM, DK2])
    else:
        q2 = q
    return q, q2


@triton.jit
def _query_tile(QD, QD2, Hq, G, BM: tl.constexpr, DK: tl.constexpr, DK2: tl.constexpr):
    """This program's query tile (grid: batch x query head, tiles of BM queries): b, h, its KV head, the
    first query m0, the rows rm and the q tiles."""
    pid_bh = tl.program_id(0)
    b = pid_bh // Hq
    h = pid_bh % Hq
    m0 = tl.program_id(1) * BM
    q, q2 = _q_tiles(QD, QD2, b, m0, h, BM, DK, DK2)
    return b, h, h // G, m0, m0 + tl.arange(0, BM), q, q2


@triton.jit
def _window_fwd_kernel(QD, QD2, KD, KD2, VD, O, LSE, sob, sot, soh, slb, slh, T, Hq, G, left, qk_scale,
                       BM: tl.constexpr, BN: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, STAGES: tl.constexpr,
                       DK2: tl.constexpr = 0):
    b, h, hk, m0, rm, q, q2 = _query_tile(QD, QD2, Hq, G, BM, DK, DK2)
    rn = tl.arange(0, BN)
    m_i = tl.full([BM], -1.0e30, tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, DV], tl.float32)
    # [edge_lo, full_lo): the window's lower edge cuts through; [full_lo, m0): every row sees all keys;
    # [m0, m0 + BM): the diagonal. Block starts are multiples of BN (BM is one too).
    # (integer division of non-negative values only: the interpreter and the GPU round negatives apart)
    edge_lo = tl.maximum(m0 - left, 0) // BN * BN
    full_lo = tl.minimum(tl.maximum((tl.maximum(m0 + BM - 1 - left, 0) + BN - 1) // BN * BN, edge_lo), m0)
    acc, l_i, m_i = _window_blocks(acc, l_i, m_i, q, q2, KD, KD2, VD, b, hk, edge_lo, full_lo, rm, rn, qk_scale,
                                   left, True, BN, DK, DK2, DV, STAGES)
    acc, l_i, m_i = _window_blocks(acc, l_i, m_i, q, q2, KD, KD2, VD, b, hk, full_lo, m0, rm, rn, qk_scale, left,
                                   False, BN, DK, DK2, DV, STAGES)
    acc, l_i, m_i = _window_blocks(acc, l_i, m_i, q, q2, KD, KD2, VD, b, hk, m0, tl.minimum(m0 + BM, T), rm, rn,
                                   qk_scale, left, True, BN, DK, DK2, DV, STAGES)
    row_ok = rm < T  # a row past T saw only zero keys: not stored
    l_i = tl.where(row_ok, l_i, 1.0)
    rd = tl.arange(0, DV)
    b64, h64, rm64 = b.to(tl.int64), h.to(tl.int64), rm.to(tl.int64)
    o = acc / l_i[:, None]
    tl.store(O + b64 * sob + rm64[:, None] * sot + h64 * soh + rd[None, :], o.to(O.dtype.element_ty),
             mask=row_ok[:, None])
    tl.store(LSE + b64 * slb + h64 * slh + rm64, (m_i + tl.log2(l_i)) * 0.6931471805599453, mask=row_ok)


def launch_config(Dk: int, Dv: int | None = None) -> dict:
    """Tiles, warps and stages per head dims (H200, bf16, T=8k-64k, w=512, bench/tune_kernels.py). Dk=192 /
    Dv=128 takes the wide heads' entry (64k: 3.73 ms, against 3.97 with 3 stages and 4.09 with 64-key tiles;
    FA-2's window forward with V padded to 192 took 7.6)."""
    if max(Dk, Dv or Dk) > 128:
        return {"BM": 64, "BN": 32, "STAGES": 2, "num_warps": 4}
    return {"BM": 64, "BN": 64, "STAGES": 3, "num_warps": 4}


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[bool, str]:
    """(whether window_forward serves these tensors, why not)."""
    Dk, Dv = q.shape[-1], v.shape[-1]
    if not (k.shape[-1] == Dk and Dk in HEAD_DIMS + SPLIT_HEAD_DIMS and Dv in HEAD_DIMS):
        return False, (f"head dims Dk={Dk}, Dv={Dv} (needs Dk in {HEAD_DIMS + SPLIT_HEAD_DIMS} and Dv in "
                       f"{HEAD_DIMS})")
    if not tma.supported(q, k, v):
        return False, "no TMA copies here (sm 9.0+, fp16/bf16, 16-byte aligned strides)"
    return True, ""


def _q_descriptors(q: torch.Tensor, rows: int, kernel: str):
    """(QD, QD2, DK, DK2): q's TMA descriptors of [rows, DK] and [rows, DK2] tiles (the second q itself when
    DK2 is 0) and the column tiles of its head dim."""
    dk, dk2 = split_dim(q.shape[-1])
    return tma.tile_descriptor(q, rows, dk, kernel), tma.tail_descriptor(True, q, rows, dk2, kernel), dk, dk2


def window_forward(q, k, v, window: int, scale: float, config: dict | None = None):
    """(o [B, T, Hq, Dv] in q's dtype, lse [B, Hq, T] fp32 natural log) of causal attention over the last
    `window` keys (the query's own included); q [B, T, Hq, Dk], k [B, T, Hkv, Dk], v [B, T, Hkv, Dv] with Hq
    a multiple of Hkv."""
    B, T, Hq, _ = q.shape
    Hkv, D = k.shape[2], v.shape[-1]
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    meta = {**launch_config(q.shape[-1], D), **(config or {})}
    if meta["BM"] % meta["BN"]:  # the three runs of key blocks start at multiples of BN, the diagonal at m0
        raise ValueError(f"the query tile BM={meta['BM']} must be a multiple of the key tile BN={meta['BN']}")
    if not torch.cuda.is_available():
        meta.pop("num_warps", None)
    o = torch.empty(B, T, Hq, D, device=q.device, dtype=q.dtype)
    lse = torch.empty(B, Hq, T, device=q.device, dtype=torch.float32)
    if B * T * Hq == 0:
        return o, lse
    qd, qd2, dk, dk2 = _q_descriptors(q, meta["BM"], "window_fwd")
    kd, vd = tma.kv_descriptors(True, k, v, meta["BN"], dk, D, "window_fwd")
    kd2 = tma.tail_descriptor(True, k, meta["BN"], dk2, "window_fwd")
    grid = (B * Hq, triton.cdiv(T, meta["BM"]))
    _window_fwd_kernel[grid](qd, qd2, kd, kd2, vd, o, lse, o.stride(0), o.stride(1), o.stride(2), lse.stride(0),
                             lse.stride(1), T, Hq, Hq // Hkv, window - 1, scale * LOG2E, DK=dk, DV=D, DK2=dk2, **meta)
    return o, lse


# --- backward ----------------------------------------------------------------------------------------------


@triton.jit
def _window_delta_kernel(O, DO, DELTA, sob, sot, soh, T, Hq, BM: tl.constexpr, D: tl.constexpr):
    """delta[b, h, t] = sum_d o * do (fp32): the softmax backward's row term."""
    pid_bh = tl.program_id(0)
    b, h = (pid_bh // Hq).to(tl.int64), (pid_bh % Hq).to(tl.int64)
    rm = tl.program_id(1) * BM + tl.arange(0, BM)
    rd = tl.arange(0, D)
    off = b * sob + rm.to(tl.int64)[:, None] * sot + h * soh + rd[None, :]
    ok = (rm < T)[:, None]
    o = tl.load(O + off, mask=ok, other=0.0).to(tl.float32)
    do = tl.load(DO + off, mask=ok, other=0.0).to(tl.float32)
    tl.store(DELTA + (b * Hq + h) * T + rm, tl.sum(o * do, axis=1), mask=rm < T)


@triton.jit
def _window_dkdv_kernel(QD, QD2, KD, KD2, VD, DOD, LSE, DELTA, DK_OUT, DV_OUT, sdb, sdt, sdh, svb, svt, svh, T, Hq,
                        Hkv, G, left, qk_scale, sm_scale, BM: tl.constexpr, BN: tl.constexpr, DK: tl.constexpr,
                        DV: tl.constexpr, STAGES: tl.constexpr, DK2: tl.constexpr = 0):
    """dK, dV of one key tile of one KV head: every query head of its group, every query tile that sees it
    (queries [n0, n0 + BN - 1 + left]); no atomics. DK_OUT's strides sd*, DV_OUT's sv*."""
    SPLIT: tl.constexpr = DK2 > 0
    pid_bh = tl.program_id(1)
    b = pid_bh // Hkv
    hk = pid_bh % Hkv
    n0 = tl.program_id(0) * BN
    rn = n0 + tl.arange(0, BN)
    k = tl.reshape(KD.load([b, n0, hk, 0]), [BN, DK])
    v = tl.reshape(VD.load([b, n0, hk, 0]), [BN, DV])
    dk = tl.zeros([BN, DK], tl.float32)
    dv = tl.zeros([BN, DV], tl.float32)
    if SPLIT:
        k2 = tl.reshape(KD2.load([b, n0, hk, DK]), [BN, DK2])
        dk2 = tl.zeros([BN, DK2], tl.float32)
    m_lo = n0 // BM * BM
    m_hi = tl.minimum(n0 + BN - 1 + left + 1, T)
    for g in range(0, G):
        h = hk * G + g
        row = (b * Hq + h).to(tl.int64) * T
        for m0 in tl.range(m_lo, m_hi, BM, num_stages=STAGES):
            rm = m0 + tl.arange(0, BM)
            q, q2 = _q_tiles(QD, QD2, b, m0, h, BM, DK, DK2)
            do = tl.reshape(DOD.load([b, m0, h, 0]), [BM, DV])
            lse2 = tl.load(LSE + row + rm, mask=rm < T, other=float("inf")) * 1.4426950408889634
            delta = tl.load(DELTA + row + rm, mask=rm < T, other=0.0)
            s_t = tl.dot(k, tl.trans(q))  # [BN, BM]: key rows, query columns
            if SPLIT:
                s_t += tl.dot(k2, tl.trans(q2))
            back = rm[None, :] - rn[:, None]
            p_t = tl.where((back >= 0) & (back <= left), tl.exp2(s_t * qk_scale - lse2[None, :]), 0.0)
            dv += tl.dot(p_t.to(do.dtype), do)
            dp_t = tl.dot(v, tl.trans(do))
            ds_t = p_t * (dp_t - delta[None, :])
            dk += tl.dot(ds_t.to(q.dtype), q)
            if SPLIT:
                dk2 += tl.dot(ds_t.to(q2.dtype), q2)
    b64, hk64, rn64 = b.to(tl.int64), hk.to(tl.int64), rn.to(tl.int64)
    rd = tl.arange(0, DK)
    off = b64 * sdb + rn64[:, None] * sdt + hk64 * sdh
    tl.store(DK_OUT + off + rd[None, :], (dk * sm_scale).to(DK_OUT.dtype.element_ty), mask=(rn < T)[:, None])
    if SPLIT:
        rd2 = DK + tl.arange(0, DK2)
        tl.store(DK_OUT + off + rd2[None, :], (dk2 * sm_scale).to(DK_OUT.dtype.element_ty), mask=(rn < T)[:, None])
    rdv = tl.arange(0, DV)
    tl.store(DV_OUT + b64 * svb + rn64[:, None] * svt + hk64 * svh + rdv[None, :], dv.to(DV_OUT.dtype.element_ty),
             mask=(rn < T)[:, None])


@triton.jit
def _window_dq_kernel(QD, QD2, KD, KD2, VD, DOD, LSE, DELTA, DQ, sqb, sqt, sqh, T, Hq, G, left, qk_scale, sm_scale,
                      BM: tl.constexpr, BN: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, STAGES: tl.constexpr,
                      DK2: tl.constexpr = 0):
    """dQ of one query tile of one head: the key tiles of its window, as the forward walks them."""
    SPLIT: tl.constexpr = DK2 > 0
    b, h, hk, m0, rm, q, q2 = _query_tile(QD, QD2, Hq, G, BM, DK, DK2)
    row = (b * Hq + h).to(tl.int64) * T
    do = tl.reshape(DOD.load([b, m0, h, 0]), [BM, DV])
    lse2 = tl.load(LSE + row + rm, mask=rm < T, other=float("inf")) * 1.4426950408889634
    delta = tl.load(DELTA + row + rm, mask=rm < T, other=0.0)
    dq = tl.zeros([BM, DK], tl.float32)
    if SPLIT:
        dq2 = tl.zeros([BM, DK2], tl.float32)
    lo = tl.maximum(m0 - left, 0) // BN * BN
    for n0 in tl.range(lo, tl.minimum(m0 + BM, T), BN, num_stages=STAGES):
        rn = n0 + tl.arange(0, BN)
        k = tl.reshape(KD.load([b, n0, hk, 0]), [BN, DK])
        v = tl.reshape(VD.load([b, n0, hk, 0]), [BN, DV])
        s = tl.dot(q, tl.trans(k))
        if SPLIT:
            k2 = tl.reshape(KD2.load([b, n0, hk, DK]), [BN, DK2])
            s += tl.dot(q2, tl.trans(k2))
        back = rm[:, None] - rn[None, :]
        p = tl.where((back >= 0) & (back <= left), tl.exp2(s * qk_scale - lse2[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k)
        if SPLIT:
            dq2 += tl.dot(ds.to(k2.dtype), k2)
    b64, h64, rm64 = b.to(tl.int64), h.to(tl.int64), rm.to(tl.int64)
    base = DQ + b64 * sqb + rm64[:, None] * sqt + h64 * sqh
    rd = tl.arange(0, DK)
    tl.store(base + rd[None, :], (dq * sm_scale).to(DQ.dtype.element_ty), mask=(rm < T)[:, None])
    if SPLIT:
        rd2 = DK + tl.arange(0, DK2)
        tl.store(base + rd2[None, :], (dq2 * sm_scale).to(DQ.dtype.element_ty), mask=(rm < T)[:, None])


def backward_config(Dk: int, Dv: int | None = None) -> dict:
    """Tiles, warps and stages of the backward kernels per head dim: BM, BN, STAGES and num_warps for both
    kernels, and where the dK/dV kernel wants other query tiles, BM_KV and STAGES_KV for them (H200, bf16,
    Hq=64, Hkv=4, D=128, w=512, the whole backward with one tile set: 11.08 ms at 64k and 1.39 at 8k with 64 x
    64 tiles, 4 warps, 3 stages, against 11.34 / 1.42 with 2 stages, 13.1 / 1.66 with 32-query tiles, 14.6 /
    1.86 with 128 x 128 tiles and 8 warps, and FA-2's backward fed the same o and LSE, 14.03 / 1.77).

    The two kernels want different query tiles. The dK/dV kernel alone, H100, bf16, Hq=64, Hkv=4, w=512, two
    runs (.. = the range), 64-query tiles in 3 stages against 32-query tiles in 2: D=128 16 x 4k 6.58-6.89 ->
    4.75-5.39 ms, 64k 7.21-7.28 -> 5.59-5.69, 8k 0.96 -> 0.70-0.74; D=64 16k 0.96-1.00 -> 0.92-0.93 (8 warps,
    16-query tiles, 32-key tiles or 128-key tiles were slower). The dQ kernel keeps its 64-query tiles: with 32 it
    took twice as long (16 x 4k 3.35 -> 6.76-8.29 ms)."""
    if max(Dk, Dv or Dk) > 128 and split_dim(Dk)[1] and (Dv or Dk) <= 128:
        # Dk=192 as 128 + 64 columns, Dv=128 (H200, 64k): 16.6 ms against 21.7 with 32-query tiles, 25.6 with
        # 32-key tiles and 28.1 with the wide heads' 32 x 32 tiles (FA-2's window backward, V padded: 18.6)
        return {"BM": 64, "BN": 64, "STAGES": 2, "num_warps": 4}
    if max(Dk, Dv or Dk) > 128:
        return {"BM": 32, "BN": 32, "STAGES": 2, "num_warps": 4}
    return {"BM": 64, "BN": 64, "STAGES": 3, "num_warps": 4, "BM_KV": 32, "STAGES_KV": 2}


def window_backward(do, q, k, v, o, lse, window: int, scale: float, config: dict | None = None):
    """(dq, dk, dv) of window_forward, from its o and lse and the output gradient do [B, T, Hq, Dv].
    config overrides backward_config's entries; its BM and STAGES serve both kernels unless it names BM_KV."""
    B, T, Hq, Dk = q.shape
    Hkv, D = k.shape[2], v.shape[-1]
    meta = {**backward_config(Dk, D), **(config or {})}
    if config and "BM_KV" not in config:  # the caller's tiles serve both kernels
        meta.pop("BM_KV", None)
        meta.pop("STAGES_KV", None)
    if not torch.cuda.is_available():
        meta.pop("num_warps", None)
    do = do.contiguous()
    dq = torch.empty(B, T, Hq, Dk, device=q.device, dtype=q.dtype)
    dk = torch.empty(B, T, Hkv, Dk, device=k.device, dtype=k.dtype)
    dv = torch.empty(B, T, Hkv, D, device=v.device, dtype=v.dtype)
    if B * T * Hq == 0:
        return dq, dk.zero_(), dv.zero_()
    delta = torch.empty(B, Hq, T, device=q.device, dtype=torch.float32)
    BM, BN, stages, warps = meta["BM"], meta["BN"], meta["STAGES"], meta.get("num_warps")
    bm_kv, stages_kv = meta.get("BM_KV", BM), meta.get("STAGES_KV", stages)
    extra = {} if warps is None else {"num_warps": warps}
    _window_delta_kernel[(B * Hq, triton.cdiv(T, 64))](o, do, delta, o.stride(0), o.stride(1), o.stride(2), T, Hq,
                                                       BM=64, D=D, **extra)
    qd, qd2, dkt, dk2 = _q_descriptors(q, BM, "window_bwd")
    dod = tma.tile_descriptor(do, BM, D, "window_bwd")
    if bm_kv == BM:
        qd_kv, qd2_kv, dod_kv = qd, qd2, dod
    else:  # the dK/dV kernel's own query tiles
        qd_kv, qd2_kv, _, _ = _q_descriptors(q, bm_kv, "window_bwd")
        dod_kv = tma.tile_descriptor(do, bm_kv, D, "window_bwd")
    kd, vd = tma.kv_descriptors(True, k, v, BN, dkt, D, "window_bwd")
    kd2 = tma.tail_descriptor(True, k, BN, dk2, "window_bwd")
    lse = lse.contiguous()
    _window_dkdv_kernel[(triton.cdiv(T, BN), B * Hkv)](
        qd_kv, qd2_kv, kd, kd2, vd, dod_kv, lse, delta, dk, dv, dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0),
        dv.stride(1), dv.stride(2), T, Hq, Hkv, Hq // Hkv, window - 1, scale * LOG2E, scale, BM=bm_kv, BN=BN, DK=dkt,
        DV=D, STAGES=stages_kv, DK2=dk2, **extra)
    _window_dq_kernel[(B * Hq, triton.cdiv(T, BM))](
        qd, qd2, kd, kd2, vd, dod, lse, delta, dq, dq.stride(0), dq.stride(1), dq.stride(2), T, Hq, Hq // Hkv,
        window - 1, scale * LOG2E, scale, BM=BM, BN=BN, DK=dkt, DV=D, STAGES=stages, DK2=dk2, **extra)
    return dq, dk, dv


__all__ = ["HEAD_DIMS", "backward_config", "launch_config", "supported", "window_backward", "window_forward"]
