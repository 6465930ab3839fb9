"""The selection backward at one shape: per-kernel GPU time (torch.profiler) and a sweep of its launch
parameters: --sweep dkdv (persistent programs per SM, query rows per work item, dk/dv warps and rows),
--sweep dkdv_tile (the dk/dv kernel's key tile, stages, warps and programs per SM) or --sweep dq (the dq
kernel's key tile, stages and warps).

    PYTHONPATH=. python bench/tune_sel_bwd.py --T 65536 [--sweep dkdv|dkdv_tile|dq|none]

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
    ap.add_argument("--sweep", default="dkdv", choices=("dkdv", "dkdv_tile", "dq", "none"))
    args = ap.parse_args(argv)
    from nsa import NSAConfig
    from nsa import plan as planning
    from nsa.compress import compress_kv
    from nsa.kernels.triton import selection_bwd as sb
    from nsa.kernels.triton import tma
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
    ss = layout.seq_start_i32
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
    use_tma = tma.supported(k, v)

    def timed(label, conf, n_programs=None):
        try:
            grads = run(conf, n_programs)
            diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(grads, base))
            ms = triton.testing.do_bench(lambda: run(conf, n_programs), rep=200)
            print(f"  {label} -> {ms:8.3f} ms  ({diff:.2e})", flush=True)
        except Exception as e:  # noqa: BLE001 - a variant that does not compile or fit is reported
            print(f"  {label} -> error {type(e).__name__}: {str(e)[:80]}", flush=True)

    if args.sweep == "dq":
        print("\nvariant: dq key tile, stages, warps -> whole backward ms (max |diff| vs default)")
        for bn, stages, warps in itertools.product((32, 64), (2, 3, 4), (1, 2, 4)):
            conf = sb.bwd_config(G, 128, 128, cfg.block_sel, q.dtype, dev, tma=use_tma)
            conf["dq"].update(BLOCK_N=bn, N_SUB=triton.cdiv(cfg.block_sel, bn), NUM_STAGES=stages,
                              num_stages=stages, num_warps=warps)
            timed(f"{bn:3} {stages} {warps}", conf)
    if args.sweep == "dkdv_tile":
        print("\nvariant: dk/dv key tile, stages, warps, programs/SM -> whole backward ms (max |diff| vs default)")
        for bn, stages, warps, pps in itertools.product((32, 64), (1, 2, 3), (4, 8), (2, 4, 8)):
            if (bn == 32 or warps == 8) and pps != sb.PROGRAMS_PER_SM:
                continue
            conf = sb.bwd_config(G, 128, 128, cfg.block_sel, q.dtype, dev, tma=use_tma)
            n_sub = triton.cdiv(cfg.block_sel, bn)
            conf.update(n_sub=n_sub, ls_pad=n_sub * bn)
            conf["dkdv"].update(BLOCK_N=bn, NUM_STAGES=stages, num_stages=stages, num_warps=warps)
            conf["reduce"]["BLOCK_N"] = min(sb.REDUCE_BLOCK_N, bn)
            timed(f"{bn:3} {stages} {warps} {pps}", conf, sms * pps)
    if args.sweep != "dkdv":
        return
    saved = sb.CHUNK_ROWS, sb.DKDV_ROWS
    print("\nvariant: programs/SM, chunk rows, dkdv warps, dkdv rows -> ms (max |diff| vs default)")
    for pps, chunk_rows, warps, rows in itertools.product((2, 4, 8), (4096, 8192, 16384), (4, 8), (64, 128)):
        sb.CHUNK_ROWS, sb.DKDV_ROWS = chunk_rows, rows
        conf = sb.bwd_config(G, 128, 128, cfg.block_sel, q.dtype, dev, tma=use_tma)
        conf["dkdv"]["num_warps"] = warps
        timed(f"{pps} {chunk_rows:6} {warps} {rows:4}", conf, sms * pps)
    sb.CHUNK_ROWS, sb.DKDV_ROWS = saved


if __name__ == "__main__":
    main()
