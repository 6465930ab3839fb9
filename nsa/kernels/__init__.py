"""Kernels behind NSA's fast paths, mechanism only (no environment switches, no counters, no routing
policy: nsa.plan decides): FlashAttention-2 and cuDNN attention calls (fa2/), the SDPA folding (sdpa.py),
probes (flash_wrappers), Triton kernels (nsa.kernels.triton). Importing this package imports neither
flash_attn nor triton."""
