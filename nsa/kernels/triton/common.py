"""Jit helpers shared by the prefill and decode kernels (Triton inlines @triton.jit helpers: calling one
costs nothing over writing its body in place).

    qk_dot(q, k, IEEE)             logits of a query tile against a key tile, [M, N]
    pv_dot(p, v, IEEE)             probabilities times a value tile, in v's dtype (fp32 inputs: IEEE)
    softmax_step(s, m, l, SAFE)    the online-softmax step in the exp2 domain: (p, alpha, m_new, l_new)
    load_tile(DESC, ptrs, ...)     a [N, D] K or V tile by TMA descriptor or by masked pointer loads
    split_dim(D)                   (host) a head dim as a power-of-two tile plus a smaller power-of-two tail
    bh_program(axis, H)            (b, h) of a program whose grid axis runs over batch x heads

Softmax state is fp32 in the exp2 domain (logits * scale * log2(e)); alpha rescales what the state held
before the tile, p are the tile's unnormalised probabilities.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def qk_dot(q, k, IEEE: tl.constexpr):
    """q [M, D] @ k [N, D]^T; IEEE: full fp32 precision (fp32 inputs), else the default (tf32 for fp32)."""
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    return s


@triton.jit
def pv_dot(p, v, IEEE: tl.constexpr):
    """p [M, N] fp32 @ v [N, D]: p cast to v's dtype (16-bit tensor cores), or kept fp32 with IEEE."""
    if IEEE:
        o = tl.dot(p, v, input_precision="ieee")
    else:
        o = tl.dot(p.to(v.dtype), v)
    return o


@triton.jit
def softmax_step(s, m_i, l_i, SAFE: tl.constexpr):
    """One online-softmax step over a tile of scaled logits s [M, N] (exp2 domain): (p, alpha, m_new, l_new).
    SAFE: rows whose running max is still -inf (every logit so far masked) give p = 0 and alpha = 1 rather
    than NaN; without it the caller starts the max at a finite value (-1e30)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if SAFE:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_i


@triton.jit
def load_tile(DESC, ptrs, b, row0, h, keep, d_ok, N: tl.constexpr, D: tl.constexpr, TMA: tl.constexpr,
              EVEN_D: tl.constexpr, COL: tl.constexpr = 0):
    """A [N, D] tile of a [B, T, H, D] tensor: by a TMA copy of rows [row0, row0 + N) of head h, columns
    [COL, COL + D) (rows outside [0, T) and columns past the head dim read as zeros; the caller masks the
    rest in its scores), else by pointer loads at `ptrs` [N, D] masked by `keep` [N] and, unless EVEN_D, by
    the head-dim mask `d_ok` [D]."""
    if TMA:
        x = tl.reshape(DESC.load([b.to(tl.int32), row0, h.to(tl.int32), COL]), [N, D])
    elif EVEN_D:  # no column mask: fewer predicate registers, wider loads
        x = tl.load(ptrs, mask=keep[:, None], other=0.0)
    else:
        x = tl.load(ptrs, mask=keep[:, None] & d_ok[None, :], other=0.0)
    return x


@triton.jit
def selected_tiles(idx_row, sin, n_sel, pos, block_sel, N_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                   N_SUB: tl.constexpr):
    """How many (slot, sub-tile) iterations a token's walk over its n_sel selected-block slots at `idx_row`
    (stride sin; -1 = none) needs, slot it // N_SUB taking sub-tile it % N_SUB, every block ending at or
    before `pos` (the token's position) masked as before.

    Where the visible slots (0 <= id, id * block_sel <= pos) come first, as the top-n step writes them
    (ascending, -1 padded): N_SUB per visible slot, and for the last one, where it is the token's own block,
    only the sub-tiles that hold positions <= pos. The iterations left out are the ones whose tile is wholly
    masked, so the walk's result is the same to the bit. A row in any other order is walked whole
    (n_sel * N_SUB). Tokens early in a sequence see fewer blocks than n_sel: 16 x 4k packed documents at the
    paper's settings leave about 14% of the iterations out. N_PAD: n_sel padded to a power of two."""
    ri = tl.arange(0, N_PAD)
    ids = tl.load(idx_row + ri * sin, mask=ri < n_sel, other=-1).to(tl.int64)
    vis = (ids >= 0) & (ids * block_sel <= pos)
    n_vis = tl.sum(vis.to(tl.int32), 0)
    leading = tl.sum((vis & (ri >= n_vis)).to(tl.int32), 0) == 0
    last = tl.sum(tl.where(ri == n_vis - 1, ids, 0), 0)
    own = pos // block_sel
    tail = tl.where(last == own, (pos - own * block_sel) // BLOCK_N + 1, N_SUB)
    n_it = tl.where(n_vis > 0, (n_vis - 1) * N_SUB + tail, 0)
    return tl.where(leading, n_it, n_sel * N_SUB)


@triton.jit
def bh_program(axis: tl.constexpr, H):
    """(b, h) int64 of this program along grid axis `axis`, which runs over batch x H heads."""
    pid = tl.program_id(axis)
    return (pid // H).to(tl.int64), (pid % H).to(tl.int64)


def next_pow2(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1): tile sizes for tl.arange."""
    return 1 << max(0, (int(x) - 1).bit_length())


def split_dim(d: int, least: int = 16) -> tuple[int, int]:
    """(main, tail) column tiles of a head dim d: main the largest power of two <= d, tail the power of two
    (>= least) that covers the rest; (next power of two, 0) where d needs no tail, where the tail would be as
    wide as the main tile, or where it would be narrower than half of it. tl.arange and tl.dot take
    power-of-two tiles only, so a kernel with one [.., next_pow2(d)] tile computes on zero columns: the
    paper's Dk=192 as 256 is a third more work in every q.k dot; as 128 + 64 it is none (H200, 16k: the
    selection forward 4.1 ms against 6.1, the whole selection backward 11.5 against 16.1 at best).
    Narrower tails (144 as 128 + 16, 160 as 128 + 32) made ptxas spill 3-10 KB per thread in the backward
    kernels on sm 8.0 and 9.0 (bench/triton_compile_check.py), so those keep one padded tile."""
    full = max(least, next_pow2(d))
    main = max(least, 1 << (max(1, int(d)).bit_length() - 1))
    tail = 0 if main >= d else max(least, next_pow2(d - main))
    return (full, 0) if tail == 0 or main + tail >= full or 2 * tail < main else (main, tail)


__all__ = ["LN2", "LOG2E", "bh_program", "load_tile", "next_pow2", "pv_dot", "qk_dot", "softmax_step",
           "split_dim"]
