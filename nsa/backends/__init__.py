"""Fast paths for the compressed and sliding branches: providers, guards, toggles, per-branch routing.

    providers   flash_attn (flash-attn package), torch_flash (PyTorch's built-in FA-2 kernels),
                sdpa (scaled_dot_product_attention, chunked masks); torch = nsa.ops (always there)
    toggles     NSA_* environment variables, read at call time (nsa.backends.toggles)
    guards      checks before every FA-2 call (nsa.backends.guards)
    router      backend="auto": flash_attn -> torch_flash -> sdpa -> torch, per branch, counted in
                nsa.telemetry (nsa.backends.router)
docs/backends.md documents all of it.
"""

BACKENDS = ("auto", "torch", "reference", "flash_attn", "torch_flash", "sdpa")
