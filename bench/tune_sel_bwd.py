"""The selection backward at one shape: per-kernel GPU time (torch.profiler) and a sweep of its launch
parameters (persistent programs per SM, query rows per work item, dk/dv warps and rows).

    PYTHONPATH=. python bench/tune_sel_bwd.py --T 65536

Paper heads (Hq=64, Hkv=4, D=128), bf16, the fused pipeline's own top-n indices. Every variant's
gradients are compared with the default's (another chunking sums in another order: close, not equal).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402


def main(argv=None):
    import triton

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", type=int, default=65536)
    args = ap.parse_args(argv)
    from nsa import NSAConfig
    from nsa import plan as planning
    from nsa.compress import compress_kv
    from nsa.kernels.triton import selection_bwd as sb
    from nsa.kernels.triton.selection_fwd import sel_forward
    from nsa.layout import dense_layout

    dev, cfg, T = torch.device("cuda"), NSAConfig(), args.T
    q = torch.randn(1, T, 64, 128, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, T, 4, 128, device=dev, dtype=torch.bfloat16)
    v = torch.randn(1, T, 4, 128, device=dev, dtype=torch.bfloat16)
    layout = dense_layout(1, T, cfg, dev)
    scale = cfg.softmax_scale(128)
    p = planning.make_plan("auto", q, k, v, cfg)
    kc, vc = compress_kv(k, v, layout, cfg)
    _, lse_c = p.cmp.fn(q, kc, vc, layout, cfg, scale)
    idx = p.topn.fn(q, kc, lse_c, layout, cfg, scale)
    ss = layout.seq_start.to(torch.int32)
    o, lse = sel_forward(q, k, v, idx, ss, cfg.block_sel, scale)
    do = torch.randn_like(o)

    def run(conf=None, n_programs=None):
        grads, launches = sb.backward_launches(do, q, k, v, o, lse, idx, ss, cfg.block_sel, scale, cfg=conf,
                                               n_programs=n_programs)
        for kernel, grid, a, kw in launches:
            kernel[grid](*a, **kw)
        return grads

    base = run()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            run()
        torch.cuda.synchronize()
    times = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            times[e.name] += getattr(e, "device_time_total", 0) or e.cuda_time_total
    print(f"T={T}: GPU time per backward {sum(times.values()) / 3 / 1e3:.2f} ms")
    for name, t in sorted(times.items(), key=lambda x: -x[1])[:10]:
        print(f"    {t / 3 / 1e3:8.3f} ms  {name[:100]}")

    G = 16
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print("\nvariant: programs/SM, chunk rows, dkdv warps, dkdv rows -> ms (max |diff| vs default)")
    for pps, chunk_rows, warps, rows in itertools.product((1, 2, 4), (4096, 8192, 16384), (4, 8), (64, 128)):
        sb.CHUNK_ROWS, sb.DKDV_ROWS = chunk_rows, rows
        conf = sb.bwd_config(G, 128, 128, cfg.block_sel, q.dtype, dev)
        conf["dkdv"]["num_warps"] = warps
        try:
            grads = run(conf, sms * pps)
            diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(grads, base))
            ms = triton.testing.do_bench(lambda c=conf, n=sms * pps: run(c, n), rep=200)
            print(f"  {pps} {chunk_rows:6} {warps} {rows:4} -> {ms:8.3f} ms  ({diff:.2e})", flush=True)
        except Exception as e:  # noqa: BLE001 - a variant that does not compile or fit is reported
            print(f"  {pps} {chunk_rows:6} {warps} {rows:4} -> error {type(e).__name__}: {str(e)[:80]}", flush=True)
    sb.CHUNK_ROWS, sb.DKDV_ROWS = 8192, 64


if __name__ == "__main__":
    main()
