"""Where one nsa_attention forward+backward spends its time (torch.profiler): GPU time per kernel and host
time per op, to tell kernel time from launch and Python overhead at short T.

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

    def step():
        out = nsa_attention(q, k, v, g, cfg)
        torch.autograd.grad(out, (q, k, v, g), go)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / args.steps * 1e3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    gpu, n_kernels = defaultdict(float), 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            gpu[e.name] += getattr(e, "device_time_total", 0) or e.cuda_time_total
            n_kernels += 1
    total_gpu = sum(gpu.values()) / args.steps / 1e3
    print(f"T={T}: wall {wall:.2f} ms per fwd+bwd, GPU busy {total_gpu:.2f} ms, {n_kernels // args.steps} kernels")
    for name, t in sorted(gpu.items(), key=lambda x: -x[1])[: args.top]:
        print(f"  gpu {t / args.steps / 1e3:8.3f} ms  {name[:90]}")
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60)
    print(table)


if __name__ == "__main__":
    main()
