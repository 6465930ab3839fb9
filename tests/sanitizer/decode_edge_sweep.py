"""Edge sweep of the Triton decode step for compute-sanitizer (memcheck); run by tests/sanitizer/test_memcheck.py
(`nox -s sanitizer`), by hand:

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck python tests/sanitizer/decode_edge_sweep.py

B in {1, 3, 8}, cache lengths S in {1, l-1, l, 4097} (l = block_cmp) and ragged lengths (empty sequences,
lengths on both sides of l and of a selection block), a cache filled to exactly max_len by the last step,
fp32 and bf16, Dk != Dv, G = 1 / 4 / 16; the ragged cases also on a paged cache (nsa.PagedNSACache, pages
of 16 and 64 tokens in shuffled order, lengths on both sides of a page boundary, a pool with no spare page
beyond the last step's). Each step is compared with the torch step on the same state
(blocks; outputs loosely, the point here is memory safety). Exit 0 when every step was finite and close;
the sanitizer reports memory errors itself. NSA_SWEEP_DEVICE=cpu with TRITON_INTERPRET=1 runs it in Triton's
interpreter (to check the script on a machine without a GPU; slow; fp16 there instead of bf16, whose tl.dot the
interpreter of triton 3.7 gets wrong).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: decode_cases
sys.path.insert(1, str(Path(__file__).resolve().parents[2]))  # the checkout: nsa

from decode_cases import decode_rows, make_case, prefill_cache, prefill_paged_cache  # noqa: E402

from nsa import NSAConfig, nsa_decode  # noqa: E402

CFG = NSAConfig()  # l=32, d=16, l'=64, n=16, w=512
L = CFG.block_cmp
STEPS = 3
RAGGED = {3: [0, L, 4097], 8: [0, 1, L - 1, L, L + 1, 63, 64, 700]}
DEVICE = os.environ.get("NSA_SWEEP_DEVICE", "cuda")
SHAPES = [(4, 4, 64, 64), (8, 2, 128, 64), (16, 1, 64, 128)]  # (Hq, Hkv, Dk, Dv): G = 1, 4, 16


PAGE_SIZES = (16, 64)  # 16 = d < l < l': a compressed block spans two pages; 64 = l': one selection block


def cases():
    """(B, lengths, page size or None: the contiguous cache)."""
    for B in (1, 3, 8):
        for S in (1, L - 1, L, 4097):
            yield B, [S] * B, None
        if B in RAGGED:
            yield B, RAGGED[B], None
            for page in PAGE_SIZES:
                yield B, RAGGED[B], page


def fast_cache(case, page):
    if page is None:
        return prefill_cache(case, prefill_backend=None)
    pages = sum(-(-(x + STEPS) // page) for x in case.lengths)  # exactly the pages the last step needs
    return prefill_paged_cache(case, page, num_pages=pages, seed=page, prefill_backend=None)


def main() -> int:
    gen = torch.Generator().manual_seed(0)
    bad = 0
    n = 0
    for (B, lengths, page), (Hq, Hkv, Dk, Dv) in zip(cases(), SHAPES * 10):
        for dtype in (torch.float32, torch.bfloat16 if DEVICE == "cuda" else torch.float16):
            case = make_case(gen, CFG, lengths, STEPS, Hq, Hkv, Dk, Dv, dtype=dtype, device=DEVICE)
            # max_len = longest + STEPS: the last step fills the cache exactly; filled without prefill attention
            fast = fast_cache(case, page)
            ref = prefill_cache(case, prefill_backend=None)
            f = case.full
            for s, row in enumerate(decode_rows(case)):
                args = [f[x][0, row][:, None] for x in "qkvg"]
                o, i = nsa_decode(*args, fast, backend="triton", return_indices=True)
                o_ref, i_ref = nsa_decode(*args, ref, backend="torch", return_indices=True)
                if DEVICE == "cuda":
                    torch.cuda.synchronize()
                n += 1
                err = float((o.float() - o_ref.float()).abs().max() / o_ref.float().abs().max().clamp_min(1e-30))
                same = float((i == i_ref).all(dim=-1).float().mean())
                # fp32: the torch step's blocks and outputs; 16-bit: close where the blocks agree
                close = same == 1.0 and err < 1e-4 if dtype == torch.float32 else err < 5e-2 or same < 1.0
                ok = bool(torch.isfinite(o.float()).all()) and close
                if not ok:
                    bad += 1
                    print(f"MISMATCH B={B} lengths={lengths} page={page} heads={Hq}/{Hkv} D={Dk}/{Dv} {dtype} "
                          f"step {s}: rel err {err:.2e}, rows with equal blocks {same:.2f}")
            assert fast.cache_seqlens.tolist() == [x + STEPS for x in lengths]
    print(f"decode edge sweep: {n} steps, {bad} mismatches")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
