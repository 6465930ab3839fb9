"""FlashAttention-2 kernels as NSA calls them: the flash-attn package (flash_attn.py) and PyTorch's
built-in FA-2 (torch_flash.py) behind one provider interface (base.py: availability, guards, one
kernel call), and the guards every call passes first (guards.py). The compressed and sliding branches
(nsa.branches.*.fa2) map their attention onto these calls."""
