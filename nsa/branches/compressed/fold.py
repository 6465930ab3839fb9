"""The compressed branch as one causal FlashAttention call, by folding queries into heads.

Query t (0-based, in its sequence) sees compressed blocks i with i*d + l - 1 <= t. With u = t + 1 =
m*d + r (0 <= r < d), that is i <= m - l/d for every r: the d queries of a run share one visible set.
Pad the queries at the front by one position (padded position p = t + 1) and cut them into groups
of d consecutive padded positions: group m sees blocks [0, m - l/d]. A sequence of L tokens has
Ng = floor(L/d) + 1 groups and T_cmp = floor((L - l)/d) + 1 = floor(L/d) - l/d + 1 blocks, so
Ng - T_cmp = l/d and "group row m sees key j iff j <= m - l/d" is causal attention aligned to the
bottom-right corner (FlashAttention-2's convention for seqlen_q > seqlen_k) with
seqlen_q = Ng groups and seqlen_k = T_cmp blocks. Groups m < l/d see nothing (the kernels return 0 and
an LSE of +inf there; `unfold_lse` maps every non-finite LSE to -inf).

Layout, dense (no K/V copy at all): the d queries and the G query heads of a KV head form the heads of
a group row, ordered (kv head, r, g):
    q [B, T, Hq, D] -> pad -> [B, Ng, d, Hkv, G, D] -> [B, Ng, Hkv*d*G, D]
and K/V stay [.., T_cmp, Hkv, D]: query head h' = kv*d*G + r*G + g reads KV head h' // (d*G) = kv,
i.e. plain GQA with group size d*G, which every FA-2 kernel supports natively. The only copy is of q
(one pass, with the pad rows) and of the output back.

Layout, varlen: the tokens go to their folded rows in one copy and the heads stay in q's order, so a
group row is a view of d rows, ordered (r, query head); K/V get d copies per block (KV head r*Hkv + kv,
1/G of q's size), the GQA of the view fold below:
    q [1, T, Hq, D] -> rows -> [NG*d, Hq, D] = [NG, d*Hq, D]        k [n_cmp, Hkv, D] -> [n_cmp, d*Hkv, D]
Query head r*Hq + h reads KV head (r*Hq + h) // G = r*Hkv + h // G. No permuting copy of q, of the
output or of their gradients (each a full pass over [T, Hq, D]); the K/V copy is G times smaller.

Varlen: sequence s (start c_s, length L_s) owns groups [g_s, g_s + Ng_s) and compressed slots
[k_s, k_s + T_cmp_s) (nsa.layout.packed_layout allots slots in sequence order, so the valid slots
are the prefix of k_cmp). Token x of s goes to folded row x - c_s + 1 + g_s*d.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...config import NSAConfig


@dataclass
class FoldPlan:
    varlen: bool
    B: int
    T: int
    Hkv: int
    G: int
    d: int
    n_groups: int  # per batch row (dense) or in total (varlen)
    n_cmp: int  # compressed blocks per batch row (dense) or valid slots in total (varlen)
    max_q: int  # longest group sequence
    max_k: int  # most compressed blocks of one sequence
    rows: torch.Tensor | None = None  # varlen: [T] int64 folded row of each token
    cu_q: torch.Tensor | None = None  # varlen: int32 [n_seq + 1] group offsets
    cu_k: torch.Tensor | None = None  # varlen: int32 [n_seq + 1] compressed-slot offsets

    @property
    def heads(self) -> int:
        return self.Hkv * self.d * self.G


def plan_dense(B: int, T: int, Hkv: int, G: int, cfg: NSAConfig) -> FoldPlan:
    d = cfg.stride_cmp
    ng = T // d + 1
    n = cfg.n_cmp_blocks(T)
    return FoldPlan(False, B, T, Hkv, G, d, ng, n, ng, n)


def plan_varlen(host_cu: list[int], T: int, Hkv: int, G: int, cfg: NSAConfig, device) -> FoldPlan:
    """Group/slot offsets from the host copy of cu_seqlens (O(n_seq) host work, one small upload)."""
    d = cfg.stride_cmp
    lengths = [b - a for a, b in zip(host_cu, host_cu[1:])]
    ng = [L // d + 1 for L in lengths]
    nc = [cfg.n_cmp_blocks(L) for L in lengths]
    cu_q, cu_k, shift = [0], [0], []
    for s in range(len(lengths)):
        shift.append(cu_q[-1] * d + 1 - host_cu[s])  # row of token x = x + shift[s]
        cu_q.append(cu_q[-1] + ng[s])
        cu_k.append(cu_k[-1] + nc[s])
    meta = torch.tensor([cu_q, cu_k], dtype=torch.int32).to(device, non_blocking=True)
    shift_t = torch.tensor(shift, dtype=torch.long).to(device, non_blocking=True)
    cu_dev = torch.tensor(host_cu[1:], dtype=torch.long).to(device, non_blocking=True)
    tokens = torch.arange(T, device=device)
    seq = torch.searchsorted(cu_dev, tokens, right=True).clamp_(max=len(lengths) - 1)
    rows = tokens + shift_t[seq]
    return FoldPlan(True, 1, T, Hkv, G, d, cu_q[-1], cu_k[-1], max(ng), max(nc), rows=rows,
                    cu_q=meta[0].contiguous(), cu_k=meta[1].contiguous())


def fold_q(q: torch.Tensor, p: FoldPlan) -> torch.Tensor:
    """q [B, T, Hq, D] -> dense [B, Ng, Hkv*d*G, D] heads (kv, r, g) / varlen [NG, d*Hq, D] heads (r, h)
    (contiguous)."""
    D = q.shape[-1]
    if not p.varlen:
        pad_back = p.n_groups * p.d - p.T - 1
        qp = torch.nn.functional.pad(q, (0, 0, 0, 0, 1, pad_back))  # [B, Ng*d, Hq, D]
        qp = qp.view(p.B, p.n_groups, p.d, p.Hkv, p.G, D).permute(0, 1, 3, 2, 4, 5)
        return qp.reshape(p.B, p.n_groups, p.heads, D)
    # In place into a fresh buffer (the out-of-place index_copy would copy the zeros once more first).
    buf = q.new_zeros(p.n_groups * p.d, q.shape[2], D).index_copy_(0, p.rows, q[0])
    return buf.view(p.n_groups, p.heads, D)


def expand_kv_varlen(x: torch.Tensor, p: FoldPlan, head_dim: int | None = None) -> torch.Tensor:
    """The valid compressed slots of x [1, N, Hkv, D] as [n_cmp, d*Hkv, head_dim], KV head r*Hkv + kv (a
    copy, zero-padded to head_dim as in expand_kv): the K/V of the varlen fold (fold_q)."""
    return expand_kv(x[:, :p.n_cmp], p.n_cmp, p.d, head_dim)[0]


def unfold_o(o: torch.Tensor, p: FoldPlan, skip: int = 0) -> torch.Tensor:
    """Kernel output (folded) -> [B, T, Hq, Dv]. Dense: `skip` leading groups were not computed (they see no
    block): their z = skip*d - 1 tokens get 0, written with the rest in one copy."""
    Dv = o.shape[-1]
    if not p.varlen:
        ng = p.n_groups - skip
        o = o.view(p.B, ng, p.Hkv, p.d, p.G, Dv).permute(0, 1, 3, 2, 4, 5)
        if skip == 0:
            return o.reshape(p.B, p.n_groups * p.d, p.Hkv * p.G, Dv)[:, 1:p.T + 1]
        z = skip * p.d - 1  # tokens before the first computed group; z + ng*d >= T
        out = o.new_empty(p.B, z + ng * p.d, p.Hkv * p.G, Dv)
        out[:, :z].zero_()
        out[:, z:].view(p.B, ng, p.d, p.Hkv, p.G, Dv).copy_(o)
        return out[:, :p.T]
    return o.reshape(p.n_groups * p.d, p.Hkv * p.G, Dv).index_select(0, p.rows)[None]


def unfold_lse(lse: torch.Tensor, p: FoldPlan, skip: int = 0) -> torch.Tensor:
    """Kernel LSE (dense [B, H', Ng - skip]; varlen [H', NG]) -> [B, T, Hq] fp32, -inf where nothing is
    visible (the `skip` leading groups of dense input, as in unfold_o, too)."""
    lse = lse.detach().float()
    if not p.varlen:
        ng = p.n_groups - skip
        lse = lse.view(p.B, p.Hkv, p.d, p.G, ng).permute(0, 4, 2, 1, 3).reshape(p.B, ng * p.d, p.Hkv * p.G)
        if skip:
            lse = torch.cat([lse.new_full((p.B, skip * p.d, p.Hkv * p.G), float("-inf")), lse], dim=1)
        lse = lse[:, 1:p.T + 1]
    else:
        lse = lse.view(p.d, p.Hkv * p.G, p.n_groups).permute(2, 0, 1)
        lse = lse.reshape(p.n_groups * p.d, p.Hkv * p.G).index_select(0, p.rows)[None]
    return torch.where(torch.isfinite(lse), lse, torch.full_like(lse, float("-inf")))


# --- Folding by view (dense input, no copy of q) -----------------------------------------------------------
#
# Start at token t0 = l - 1 instead of padding: token t = t0 + m*d + r (0 <= r < d) sees the blocks
# i <= (t - l + 1)/d = m + r/d, i.e. i <= m for every r. So row m of d consecutive tokens from t0 sees
# blocks 0..m: causal attention of n_rows rows over the first n_rows blocks, square (top-left and
# bottom-right alignment agree). For a q whose token stride is Hq times its head stride (a contiguous q),
# the rows are a VIEW: q[:, t0:t0 + n_rows*d] is [B, n_rows, d*Hq, D] with folded head r*Hq + h. Its KV
# head must be (r, kv) = r*Hkv + h // G for plain GQA with group G, so K/V get d copies per block
# ([B, n_rows, d*Hkv, D]: d copies of T/d blocks, 1/G of q's size). Tokens before t0 see nothing; the last
# (T - t0) mod d tokens (the tail, fewer than d) see blocks 0..n_rows and are computed apart.


def view_rows(T: int, cfg: NSAConfig) -> tuple[int, int]:
    """(t0, n_rows): the first folded token and the number of whole rows of d tokens from it."""
    t0 = cfg.block_cmp - 1
    return t0, max(0, (T - t0) // cfg.stride_cmp)


def view_foldable(q: torch.Tensor) -> bool:
    """q's tokens can be viewed as rows of d*Hq heads: token stride = Hq * head stride, head dim contiguous."""
    return q.stride(-1) == 1 and q.stride(1) == q.shape[2] * q.stride(2)


def fold_q_view(q: torch.Tensor, t0: int, n_rows: int, d: int) -> torch.Tensor:
    """[B, n_rows, d*Hq, D], a view of q's tokens [t0, t0 + n_rows*d)."""
    B, _, Hq, D = q.shape
    return q[:, t0:t0 + n_rows * d].view(B, n_rows, d * Hq, D)


def expand_kv(x: torch.Tensor, n_rows: int, d: int, head_dim: int | None = None) -> torch.Tensor:
    """Blocks [0, n_rows) of x [B, Nc, Hkv, D] as [B, n_rows, d*Hkv, head_dim], KV head r*Hkv + kv (a copy).
    head_dim > D zero-pads the head dim in the same copy (V for an FA-2 call with Dk > Dv: FA-2 takes one
    head dim for q, k and v)."""
    B, _, Hkv, D = x.shape
    rows = x[:, :n_rows, None].expand(B, n_rows, d, Hkv, D)
    if head_dim is None or head_dim == D:
        return rows.reshape(B, n_rows, d * Hkv, D)
    out = x.new_empty(B, n_rows, d, Hkv, head_dim)
    out[..., D:].zero_()
    out[..., :D] = rows
    return out.view(B, n_rows, d * Hkv, head_dim)


def unfold_view_o(o: torch.Tensor, Hq: int) -> torch.Tensor:
    """Kernel output [B, n_rows, d*Hq, Dv] -> [B, n_rows*d, Hq, Dv] (tokens t0...; a view when the kernel
    wrote rows contiguously, as FA-2 and cuDNN do)."""
    B, n, _, Dv = o.shape
    return o.reshape(B, -1, Hq, Dv)


def unfold_view_lse(lse: torch.Tensor, Hq: int, d: int) -> torch.Tensor:
    """Kernel LSE [B, d*Hq, n_rows] -> [B, n_rows*d, Hq] fp32."""
    B, _, n = lse.shape
    return lse.float().view(B, d, Hq, n).permute(0, 3, 1, 2).reshape(B, n * d, Hq)
