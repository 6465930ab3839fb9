"""NSAAttention.forward with a context-parallel group: RoPE at each token's stream position, then
cp_nsa_attention on the projected slice."""

from __future__ import annotations

from .cp import cp_nsa_attention, positions


def cp_forward(mod, x, cp_group, *, cu_seqlens=None, backend="auto"):
    """x [B, T_local, dim] (this rank's slice) -> [B, T_local, dim]."""
    B, T, _ = x.shape
    pos = positions(cp_group, T, x.device, cu_seqlens)[None]
    q, kv, gates = mod.project(x, pos.expand(B, T) if cu_seqlens is None else pos)
    k, v = kv["sel"]
    # Shared K/V (shared_kv=True) travel once: the branches then read the gathered selection K/V.
    kv_cmp = None if kv["cmp"] is kv["sel"] else kv["cmp"]
    kv_win = None if kv["win"] is kv["sel"] else kv["win"]
    out = cp_nsa_attention(q, k, v, gates, mod.config, cp_group=cp_group, cu_seqlens=cu_seqlens, backend=backend,
                           kv_cmp=kv_cmp, kv_win=kv_win, compress_fn=mod.compress_fn())
    return mod.o_proj(out.flatten(2))
