"""Decode: one new token per sequence, its NSA output from the cache (nsa.cache), equal to prefill at that
position. naive: the prefill branches' per-chunk torch functions on the cache; triton: five launches per
step, no host sync, no allocation, static shapes (capturable in a CUDA graph): append the token,
compressed + window attention split over many programs, selection scores + top-n candidates, selected
attention, combine + gates (nsa.kernels.triton.decode). Both: `decode_step(q, gates, cache, tokens,
compress_fn) -> (out [B, 1, Hq, Dv], indices [B, 1, Hkv, n] int32)`."""
