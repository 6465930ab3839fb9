"""FlashAttention-2 kernels as NSA calls them: the flash-attn package (flash_attn.py), PyTorch's built-in
FA-2 (torch_flash.py) and cuDNN attention (torch_cudnn.py) behind one interface (base.py: whether the
kernel exists here, one kernel call). Which calls they may serve is planning's (nsa.plan.rules); the
compressed and sliding branches (nsa.branches.*.fa2) map their attention onto these calls."""
