"""Gate combine in plain PyTorch, with the combine signature `(gates, o_cmp, o_sel, o_win) -> out`."""

from __future__ import annotations

from ..attend import compute_dtype


def combine_torch(gates, o_cmp, o_sel, o_win):
    """out = g_cmp * o_cmp + g_sel * o_sel + g_win * o_win in the compute dtype, cast to o_cmp's dtype."""
    ct = compute_dtype(o_cmp.dtype)
    g = gates.to(ct)
    out = g[..., 0:1] * o_cmp.to(ct) + g[..., 1:2] * o_sel.to(ct) + g[..., 2:3] * o_win.to(ct)
    return out.to(o_cmp.dtype)


__all__ = ["combine_torch"]
