"""phi: the compressed K/V of every block slot of a layout (nsa.layout).

compress="avg": block i is the mean of tokens [i*d, i*d + l). For dense input it is formed from sums
over the l/d stride-long runs it covers (one pass over K/V, no [Nc, l] gather); packed input gathers
each slot's tokens. compress="mlp": the caller's (phi_k, phi_v) over the gathered [N, l, H, D] blocks.
Sums run in fp32 (fp64 for fp64 input); the result has the input's dtype. Differentiable.
"""

from __future__ import annotations

from .branches.attend import compute_dtype
from .config import NSAConfig
from .layout import SeqLayout, gather_blocks


def _mean_dense(x, n: int, cfg: NSAConfig):
    B, T, H, D = x.shape
    d, runs = cfg.stride_cmp, cfg.block_cmp // cfg.stride_cmp
    m = n + runs - 1  # stride-long runs the n blocks cover
    # The sum reads x in its own dtype and accumulates in the compute dtype: no converted copy of x
    # (two [B, T, Hkv, D] fp32 copies cost 0.2 ms at T=64k on an H200, the sums 0.09).
    sums = x[:, : m * d].unflatten(1, (m, d)).sum(2, dtype=compute_dtype(x.dtype))  # [B, m, H, D]
    acc = sums[:, 0:n]
    for a in range(1, runs):
        acc = acc + sums[:, a:a + n]
    return (acc / cfg.block_cmp).to(x.dtype)


def compress_kv(k, v, layout: SeqLayout, cfg: NSAConfig, compress_fn=None):
    """Compressed K/V [B, Nc, Hkv, D] for every slot of the layout (phi = mean unless compress_fn)."""
    n = layout.n_cmp
    if n == 0:
        B, _, H, _ = k.shape
        return k.new_zeros(B, 0, H, k.shape[-1]), v.new_zeros(B, 0, H, v.shape[-1])
    if compress_fn is None and not layout.packed:
        return _mean_dense(k, n, cfg), _mean_dense(v, n, cfg)
    kb = gather_blocks(k, layout.cmp_start, cfg.block_cmp)
    vb = gather_blocks(v, layout.cmp_start, cfg.block_cmp)
    if compress_fn is None:
        return kb.mean(dim=2), vb.mean(dim=2)
    B, N = kb.shape[:2]
    return (compress_fn[0](kb.flatten(0, 1)).unflatten(0, (B, N)),
            compress_fn[1](vb.flatten(0, 1)).unflatten(0, (B, N)))
