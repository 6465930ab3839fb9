"""The NSA branches, one folder each, every implementation of a branch with one signature.

    compressed/  o_cmp, lse = fn(q, k_cmp, v_cmp, layout, cfg, scale)
                 naive (torch), fa2 (flash_attn / torch_flash), sdpa
    selected/    indices = topn(q, k_cmp, lse, layout, cfg, scale)       naive (torch), triton
                 o_sel = fn(q, k, v, indices, layout, cfg, scale)         naive (torch), triton
    sliding/     o_win = fn(q, k, v, layout, cfg, scale)                  naive (torch), fa2, sdpa
                 o, lse = forward(q, k, v, cfg, scale), and backward         triton (the dense core's)
    combine/     out = fn(gates, o_cmp, o_sel, o_win)                     naive (torch), triton
    decode/      out, indices = decode_step(q, gates, cache, tokens, compress_fn)   naive (torch), triton

Shapes: q [B, T, Hq, Dk], k/v [B, T, Hkv, Dk/Dv], k_cmp/v_cmp [B, Nc, Hkv, D] (one slot per compressed
block, nsa.layout), lse [B, T, Hq] fp32 (-inf where a query sees no compressed block), indices
[B, T, Hkv, n_sel] int32 (ascending, -1 padded), outputs [B, T, Hq, Dv] in q's dtype. The `naive`
module of each branch also holds the per-chunk functions the chunked torch pipeline and decode run
(queries grouped by KV head, q [B, C, Hkv, G, Dk], masks from positions). nsa.plan picks one
implementation per branch and call; nsa.run runs them. The fast twins import their kernels (and triton)
on first call, so planning can name them without importing triton.
"""
