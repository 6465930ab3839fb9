"""Kernels behind NSA's fast paths: FlashAttention-2 wrappers and probes (flash_wrappers), Triton kernels
(nsa.kernels.triton). Importing this package imports neither flash_attn nor triton."""
