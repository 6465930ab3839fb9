"""Edge-shape sweep of the Triton selection kernel for compute-sanitizer (memcheck): forward and backward
(dq, dk/dv through the reverse index, partials + reduce) on tiny and odd shapes: T = 1, T not a multiple of
the block, blocks shorter and longer than the kernel tile, G in {1, 3, 16, 64}, Dk != Dv up to 256, packed
input with empty and length-1 sequences, -1 padded, empty and repeated index rows, and chunks of a few
queries so that most blocks take the partials path. Exit 0 when every output and gradient is finite; the
sanitizer reports memory errors. Run by tests/sanitizer/test_memcheck.py (`nox -s sanitizer`), by hand:

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck python tests/sanitizer/triton_sel_edge_sweep.py
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: nsa

from nsa.kernels.triton import selection_bwd  # noqa: E402
from nsa.kernels.triton.selection import selected_attention_triton  # noqa: E402

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
CASES = [  # (lengths or None, B, T, Hq, Hkv, Dk, Dv, block_sel, n, chunk_rows, dtype)
    (None, 1, 1, 4, 1, 64, 64, 64, 4, None, BF16),
    (None, 2, 31, 3, 1, 64, 32, 16, 3, None, FP16),
    (None, 1, 97, 16, 1, 192, 128, 64, 4, 32, BF16),
    (None, 1, 130, 64, 1, 128, 128, 64, 3, 64, BF16),
    (None, 1, 300, 8, 2, 256, 256, 128, 3, 64, FP16),
    (None, 1, 200, 2, 2, 128, 64, 48, 5, 4, FP32),
    ([0, 1, 0, 31, 65, 47], 1, None, 8, 2, 128, 128, 16, 4, 16, BF16),
    ([0, 0], 1, None, 4, 1, 64, 64, 64, 2, None, BF16),
    ([5, 0, 200, 1], 1, None, 4, 1, 64, 128, 64, 4, 8, FP32),
    (None, 1, 257, 16, 4, 128, 128, 64, 16, None, FP32),
]


def indices_for(seq_start, Hkv, n, ls, gen):
    """Random distinct visible blocks per row, -1 holes, one empty row and one repeated block."""
    B, T = seq_start.shape
    pos = torch.arange(T)[None] - seq_start
    nblk = pos.div(ls, rounding_mode="floor") + 1  # candidate blocks of each token
    r = torch.rand(B, T, Hkv, n, generator=gen)
    idx = (r * nblk[..., None, None]).long()
    idx = torch.where(torch.rand(idx.shape, generator=gen) < 0.2, -1, idx)
    if T > 3:
        idx[0, T // 2] = -1
        idx[0, T - 1, 0, :2] = 0  # repeated block
    return idx.to(torch.int32)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda, or cpu under TRITON_INTERPRET=1 (slow)")
    dev = torch.device(ap.parse_args(argv).device)
    gen = torch.Generator().manual_seed(0)
    bad = 0
    default_rows = selection_bwd.CHUNK_ROWS
    for lengths, B, T, Hq, Hkv, Dk, Dv, ls, n, rows, dtype in CASES:
        if lengths is not None:
            cu = [0, *itertools.accumulate(lengths)]
            T = cu[-1]
            ss = torch.zeros(1, T, dtype=torch.long)
            for a, b in zip(cu, cu[1:]):
                ss[0, a:b] = a
        else:
            ss = torch.zeros(B, T, dtype=torch.long)
        idx = indices_for(ss, Hkv, n, ls, gen).to(dev)
        selection_bwd.CHUNK_ROWS = rows or default_rows
        q = torch.randn(B, T, Hq, Dk, device=dev, dtype=dtype, requires_grad=True)
        k = torch.randn(B, T, Hkv, Dk, device=dev, dtype=dtype, requires_grad=True)
        v = torch.randn(B, T, Hkv, Dv, device=dev, dtype=dtype, requires_grad=True)
        out = selected_attention_triton(q, k, v, idx, ss.to(dev), ls)
        grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
        if dev.type == "cuda":
            torch.cuda.synchronize()
        ok = bool(torch.isfinite(out).all()) and all(bool(torch.isfinite(g).all()) for g in grads)
        bad += not ok
        print(f"lengths={lengths} B={B} T={T} Hq={Hq} Hkv={Hkv} D={Dk}/{Dv} l'={ls} n={n} chunk_rows={rows} "
              f"{dtype}: {'ok' if ok else 'NON-FINITE'}", flush=True)
    selection_bwd.CHUNK_ROWS = default_rows
    print(f"triton selection edge sweep: {bad} non-finite case(s) of {len(CASES)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
