"""Where one nsa_attention forward and its backward spend their time (torch.profiler), each on its own: GPU
time per kernel and host time per op, to tell kernel time from launch and Python overhead at short T.

    PYTHONPATH=. python bench/profile_nsa.py --T 8192
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from nsa import NSAConfig, nsa_attention  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=12, help="kernels listed, by GPU time")
    args = ap.parse_args(argv)
    dev, cfg, T = torch.device("cuda"), NSAConfig(), args.T
    q, k, v = (torch.randn(1, T, h, 128, device=dev, dtype=torch.bfloat16, requires_grad=True) for h in (64, 4, 4))
    g = torch.rand(1, T, 64, 3, device=dev, dtype=torch.bfloat16, requires_grad=True)
    go = torch.randn(1, T, 64, 128, device=dev, dtype=torch.bfloat16)

    def fwd():
        return nsa_attention(q, k, v, g, cfg)

    def bwd(out):
        torch.autograd.grad(out, (q, k, v, g), go, retain_graph=True)

    for _ in range(3):
        bwd(fwd())
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        bwd(fwd())
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / args.steps * 1e3
    print(f"T={T}: wall {wall:.2f} ms per fwd+bwd")
    out = fwd()
    for phase, run in (("forward", fwd), ("backward", lambda: bwd(out))):
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                run()
            torch.cuda.synchronize()
        report(prof, phase, args.steps, args.top)


def report(prof, phase: str, steps: int, top: int) -> None:
    gpu, calls = defaultdict(float), defaultdict(int)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            gpu[e.name] += getattr(e, "device_time_total", 0) or e.cuda_time_total
            calls[e.name] += 1
    total_gpu = sum(gpu.values()) / steps / 1e3
    print(f"{phase}: GPU busy {total_gpu:.2f} ms per call, {sum(calls.values()) // steps} kernels")
    for name, t in sorted(gpu.items(), key=lambda x: -x[1])[:top]:
        print(f"  gpu {t / steps / 1e3:8.3f} ms  x{calls[name] // steps:<3d} {name[:90]}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))


if __name__ == "__main__":
    main()
