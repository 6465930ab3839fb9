"""Edge-shape sweep of the rotary-embedding kernel (nsa.kernels.triton.rope) for compute-sanitizer (memcheck):
forward and backward (the inverse rotation) on T = 0, 1 and not a multiple of the token tile, one head and
many, head dims whose half is 1, 3, 96 and 128 (masked frequency columns), strided heads, positions shared by
the batch or per row, fp32 / fp16 / bf16. Exit 0 when every output is finite and matches the torch formula;
the sanitizer reports memory errors. Run by tests/sanitizer/test_memcheck.py (`nox -s sanitizer`), by hand:

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck python tests/sanitizer/rope_edge_sweep.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: nsa

from nsa.attention import rope_torch  # noqa: E402
from nsa.kernels.triton.rope import rope_apply  # noqa: E402

CASES = [  # (B, T, H, D, per_row, dtype)
    (1, 0, 2, 64, False, torch.bfloat16),
    (1, 1, 1, 2, False, torch.float32),
    (2, 17, 3, 6, True, torch.float16),
    (3, 33, 16, 128, True, torch.bfloat16),
    (1, 50, 5, 192, False, torch.bfloat16),
    (2, 15, 1, 256, True, torch.float32),
]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def main() -> int:
    bad = 0
    for B, T, H, D, per_row, dtype in CASES:
        wide = torch.randn(B, T, H + 1, D, device="cuda").to(dtype)
        x = wide[:, :, 1:]  # strided heads
        pos = (torch.stack([torch.arange(T, device="cuda") // (b + 1) for b in range(B)]) if per_row
               else torch.arange(T, device="cuda")[None])
        freqs = 10000.0 ** (-torch.arange(D // 2, device="cuda", dtype=torch.float32) / (D // 2))
        for inverse in (False, True):
            y = rope_apply(x, pos, freqs, inverse=inverse)
            want = rope_torch(x, pos, -freqs if inverse else freqs)
            err = ((y.double() - want.double()).norm() / want.double().norm().clamp(min=1e-12)).item() if T else 0.0
            ok = bool(torch.isfinite(y).all()) and y.shape == x.shape and err <= TOL[dtype]
            print(f"B={B} T={T} H={H} D={D} per_row={per_row} {dtype} inverse={inverse}: "
                  f"{'ok' if ok else 'FAIL'} (rel err {err:.1e})", flush=True)
            bad += not ok
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
