"""Per-kernel GPU time of one Triton decode step (torch.profiler), paper heads, bf16.

    PYTHONPATH=. python bench/profile_decode.py --cells 8192x8,65536x8,65536x1
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from bench_decode import fill_cache, step_inputs  # noqa: E402

from nsa import NSACache, NSAConfig, nsa_decode  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cells", default="8192x8,65536x8,65536x1", help="SxB,...")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--chunk-j", default="", help="comma list of Tuning.chunk_j values to compare (default: as is)")
    args = ap.parse_args(argv)
    dev, cfg, dtype = torch.device("cuda"), NSAConfig(), torch.bfloat16
    Hq, Hkv, D = 64, 4, 128
    from nsa.kernels.triton import decode as kdecode

    chunks = [int(x) for x in args.chunk_j.split(",") if x] or [None]
    for cell, cj in ((c, j) for c in args.cells.split(",") for j in chunks):
        kdecode.TUNING = kdecode.Tuning(chunk_j=cj)
        S, B = (int(x) for x in cell.split("x"))
        gen = torch.Generator(device=dev).manual_seed(0)
        cache = NSACache(cfg, B, S + args.steps + 8, Hkv, D, D, device=dev, dtype=dtype)
        fill_cache(cache, [S] * B, gen, 8192)
        q, k, v, g = step_inputs(gen, B, Hq, Hkv, D, D, dev, dtype)
        nsa_decode(q, k, v, g, cache, backend="triton")  # compile
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                nsa_decode(q, k, v, g, cache, backend="triton")
            torch.cuda.synchronize()
        times = defaultdict(float)
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                times[e.name] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        total = sum(times.values()) / args.steps
        print(f"S={S} B={B} chunk_j={cj}: GPU time per step {total:.1f} us")
        for name, t in sorted(times.items(), key=lambda x: -x[1])[:8]:
            print(f"    {t / args.steps:8.1f} us  {name[:90]}")


if __name__ == "__main__":
    main()
