"""The gated sum of the three branches (Triton): out = g_cmp * o_cmp + g_sel * o_sel + g_win * o_win.

One pass over the branch outputs instead of the five elementwise torch ops (each a full read and write
of [B, T, Hq, Dv]); fp32 arithmetic, output in o_cmp's dtype. The backward writes the three branch
gradients (g_i * dout) and the gate gradients (rowsum(dout * o_i)) in one pass too. Inputs may have any
strides (the providers return views); rows are (b, t, h), columns the head dim.

o_cmp may come in two token segments (`Segments`): the compressed branch folded by view
(nsa.branches.compressed.fold) returns its rows for tokens [t0, t0 + n) and a short tail after them, and
tokens before t0 see no block (output 0). The kernels read, and in the backward write, each segment in
place, so no [B, T, Hq, Dv] copy assembles o_cmp or splits its gradient.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import next_pow2 as _np2


class Segments:
    """o_cmp as two token ranges: rows of `main` are tokens [lo, lo + len(main)), rows of `tail` the
    tokens after them; tokens outside both are 0. Both [B, n, Hq, Dv] (any strides).

    The tail (a few tokens) is cast to main's dtype: a second element type in the kernels costs the
    backward about 40 more registers per thread and a third of its occupancy (H200, 64k: 3.8 ms with an
    fp32 tail beside bf16 rows, 2.0 with one dtype)."""

    def __init__(self, main: torch.Tensor, lo: int, tail: torch.Tensor):
        self.main, self.lo, self.tail = main, lo, tail.to(main.dtype)
        self.hi = lo + main.shape[1]

    @staticmethod
    def whole(x: torch.Tensor) -> Segments:
        return Segments(x, 0, x[:, :0])

    @property
    def tail_ptr(self) -> torch.Tensor:
        """The tail as a kernel argument: an empty tail is never read or written, so any valid pointer."""
        return self.tail if self.tail.numel() else self.main

    def args(self):
        """Kernel arguments: pointers, token ranges, strides of both segments."""
        tail = self.tail_ptr
        return (self.main, tail, self.lo, self.hi, self.hi + self.tail.shape[1],
                *self.main.stride(), *tail.stride())


@triton.jit
def _rows(R, T, Hq, BLOCK_R: tl.constexpr):
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    h = r % Hq
    bt = r // Hq
    return r < R, bt // T, bt % T, h


@triton.jit
def _gates(G, b, t, h, ok, s0, s1, s2, s3):
    """The three gates of each row, fp32, as [rows, 1] columns."""
    gp = G + b * s0 + t * s1 + h * s2
    g0 = tl.load(gp, mask=ok, other=0.0).to(tl.float32)[:, None]
    g1 = tl.load(gp + s3, mask=ok, other=0.0).to(tl.float32)[:, None]
    g2 = tl.load(gp + 2 * s3, mask=ok, other=0.0).to(tl.float32)[:, None]
    return g0, g1, g2


@triton.jit
def _tile(X, b, t, h, d, m, s0, s1, s2, s3):
    """[rows, BLOCK_D] of a [B, T, Hq, Dv] tensor, fp32."""
    return tl.load(X + (b * s0 + t * s1 + h * s2)[:, None] + d[None, :] * s3, mask=m, other=0.0).to(tl.float32)


@triton.jit
def _segment_off(b, t, h, lo, hi, s0, s1, s2):
    """Row offsets into a segment holding tokens [lo, hi), and which rows it holds."""
    inside = (t >= lo) & (t < hi)
    return b * s0 + tl.where(inside, t - lo, 0) * s1 + h * s2, inside


@triton.jit
def _combine_fwd(G, A, A2, S, W, O, R, T, Hq, Dv, a_lo, a_hi, a2_hi,
                 sg0, sg1, sg2, sg3, sa0, sa1, sa2, sa3, sb0, sb1, sb2, sb3, ss0, ss1, ss2, ss3,
                 sw0, sw1, sw2, sw3, so0, so1, so2, so3, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    ok, b, t, h = _rows(R, T, Hq, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    dm = (d < Dv)[None, :]
    m = ok[:, None] & dm
    g0, g1, g2 = _gates(G, b, t, h, ok, sg0, sg1, sg2, sg3)
    off, in1 = _segment_off(b, t, h, a_lo, a_hi, sa0, sa1, sa2)
    a = tl.load(A + off[:, None] + d[None, :] * sa3, mask=m & in1[:, None], other=0.0).to(tl.float32)
    off, in2 = _segment_off(b, t, h, a_hi, a2_hi, sb0, sb1, sb2)
    a += tl.load(A2 + off[:, None] + d[None, :] * sb3, mask=m & in2[:, None], other=0.0).to(tl.float32)
    s = _tile(S, b, t, h, d, m, ss0, ss1, ss2, ss3)
    w = _tile(W, b, t, h, d, m, sw0, sw1, sw2, sw3)
    out = g0 * a + g1 * s + g2 * w
    tl.store(O + (b * so0 + t * so1 + h * so2)[:, None] + d[None, :] * so3, out.to(O.dtype.element_ty), mask=m)


@triton.jit
def _combine_bwd(G, A, A2, S, W, DO, DG, DA, DA2, DS, DW, R, T, Hq, Dv, a_lo, a_hi, a2_hi,
                 sg0, sg1, sg2, sg3, sa0, sa1, sa2, sa3, sb0, sb1, sb2, sb3, ss0, ss1, ss2, ss3,
                 sw0, sw1, sw2, sw3, sd0, sd1, sd2, sd3, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # DG, DS, DW are contiguous: [R, 3] and [R, Dv]; DA / DA2 contiguous like the segments of A / A2.
    ok, b, t, h = _rows(R, T, Hq, BLOCK_R)
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    m = ok[:, None] & (d < Dv)[None, :]
    g0, g1, g2 = _gates(G, b, t, h, ok, sg0, sg1, sg2, sg3)
    do = _tile(DO, b, t, h, d, m, sd0, sd1, sd2, sd3)
    off1, in1 = _segment_off(b, t, h, a_lo, a_hi, sa0, sa1, sa2)
    a = tl.load(A + off1[:, None] + d[None, :] * sa3, mask=m & in1[:, None], other=0.0).to(tl.float32)
    off2, in2 = _segment_off(b, t, h, a_hi, a2_hi, sb0, sb1, sb2)
    a += tl.load(A2 + off2[:, None] + d[None, :] * sb3, mask=m & in2[:, None], other=0.0).to(tl.float32)
    s = _tile(S, b, t, h, d, m, ss0, ss1, ss2, ss3)
    w = _tile(W, b, t, h, d, m, sw0, sw1, sw2, sw3)
    off = r[:, None] * Dv + d[None, :]
    # Row (b, t, h) of a contiguous [B, n, Hq, Dv] segment sits at ((b * n + t - lo) * Hq + h) * Dv.
    da1 = ((b * (a_hi - a_lo) + t - a_lo) * Hq + h)[:, None] * Dv + d[None, :]
    tl.store(DA + da1, (g0 * do).to(DA.dtype.element_ty), mask=m & in1[:, None])
    da2 = ((b * (a2_hi - a_hi) + t - a_hi) * Hq + h)[:, None] * Dv + d[None, :]
    tl.store(DA2 + da2, (g0 * do).to(DA2.dtype.element_ty), mask=m & in2[:, None])
    tl.store(DS + off, (g1 * do).to(DS.dtype.element_ty), mask=m)
    tl.store(DW + off, (g2 * do).to(DW.dtype.element_ty), mask=m)
    tl.store(DG + r * 3, tl.sum(do * a, axis=1).to(DG.dtype.element_ty), mask=ok)
    tl.store(DG + r * 3 + 1, tl.sum(do * s, axis=1).to(DG.dtype.element_ty), mask=ok)
    tl.store(DG + r * 3 + 2, tl.sum(do * w, axis=1).to(DG.dtype.element_ty), mask=ok)


def _meta(Dv: int) -> dict:
    bd = max(16, _np2(Dv))
    return {"BLOCK_R": max(1, 4096 // bd), "BLOCK_D": bd, "num_warps": 4}


def _launch(kernel, R: int, Dv: int, *args) -> None:
    """One program per BLOCK_R rows of the R = B*T*Hq rows (nothing to do for R = 0)."""
    if R:
        meta = _meta(Dv)
        kernel[(triton.cdiv(R, meta["BLOCK_R"]),)](*args, **meta)


def combine_forward(gates, a: Segments, o_sel, o_win):
    """out [B, T, Hq, Dv] in o_sel's dtype (o_cmp given as Segments)."""
    B, T, Hq, Dv = o_sel.shape
    out = torch.empty(B, T, Hq, Dv, device=o_sel.device, dtype=o_sel.dtype)
    m, t, lo, hi, hi2, *sa = a.args()
    _launch(_combine_fwd, B * T * Hq, Dv, gates, m, t, o_sel, o_win, out, B * T * Hq, T, Hq, Dv, lo, hi, hi2,
            *gates.stride(), *sa, *o_sel.stride(), *o_win.stride(), *out.stride())
    return out


def combine_backward(dout, gates, a: Segments, o_sel, o_win):
    """(d gates, d o_cmp as Segments of contiguous tensors, d o_sel, d o_win)."""
    B, T, Hq, Dv = o_sel.shape
    dg = torch.empty(B, T, Hq, 3, device=gates.device, dtype=gates.dtype)
    da = Segments(torch.empty(a.main.shape, device=a.main.device, dtype=a.main.dtype), a.lo,
                  torch.empty(a.tail.shape, device=a.tail.device, dtype=a.tail.dtype))
    ds = torch.empty(B, T, Hq, Dv, device=o_sel.device, dtype=o_sel.dtype)
    dw = torch.empty(B, T, Hq, Dv, device=o_win.device, dtype=o_win.dtype)
    m, t, lo, hi, hi2, *sa = a.args()
    _launch(_combine_bwd, B * T * Hq, Dv, gates, m, t, o_sel, o_win, dout, dg, da.main, da.tail_ptr, ds, dw,
            B * T * Hq, T, Hq, Dv, lo, hi, hi2, *gates.stride(), *sa, *o_sel.stride(), *o_win.stride(),
            *dout.stride())
    return dg, da, ds, dw


class GateCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gates, o_cmp, o_sel, o_win):
        ctx.save_for_backward(gates, o_cmp, o_sel, o_win)
        return combine_forward(gates, Segments.whole(o_cmp), o_sel, o_win)

    @staticmethod
    def backward(ctx, dout):
        gates, o_cmp, o_sel, o_win = ctx.saved_tensors
        dg, da, ds, dw = combine_backward(dout, gates, Segments.whole(o_cmp), o_sel, o_win)
        return dg, da.main, ds, dw


def gate_combine(gates, o_cmp, o_sel, o_win):
    """gates [B, T, Hq, 3], o_* [B, T, Hq, Dv] (one dtype) -> out [B, T, Hq, Dv] (differentiable)."""
    if not (o_cmp.shape == o_sel.shape == o_win.shape) or gates.shape != (*o_cmp.shape[:3], 3):
        raise ValueError(f"gate_combine: shapes gates {tuple(gates.shape)}, o_cmp {tuple(o_cmp.shape)}, "
                         f"o_sel {tuple(o_sel.shape)}, o_win {tuple(o_win.shape)} do not match")
    return GateCombine.apply(gates, o_cmp, o_sel, o_win)


__all__ = ["GateCombine", "Segments", "combine_backward", "combine_forward", "gate_combine"]
