"""Routing and sanity probe: a few NSA calls on the GPU with the debug log on, and the telemetry counters.

    NSA_DEBUG_LOG=1 NSA_LOG_LIMIT=5 python tests/gpu/routing_probe.py --device cuda --out telemetry.json

Runs, in bf16 and fp32: a dense prefill, a packed varlen prefill (cu_seqlens), its backward, and a few
decode steps through an NSACache. Prints which backend served each branch (nsa.telemetry, with the
rate-limited `nsa.route` log lines on stderr; a fused call's core row says whether the dense core ran,
`core->dense_core`, or why not, `core->separate (reason)`) and fails (exit 1) on any non-finite output or
gradient.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(name)s: %(message)s")

    import torch

    from nsa import NSACache, NSAConfig, nsa_attention, nsa_decode, nsa_prefill, telemetry

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("routing_probe: no CUDA GPU visible to torch", file=sys.stderr)
        return 2
    cfg = NSAConfig(block_cmp=32, stride_cmp=16, block_sel=64, n_sel=8, window=128)
    g = torch.Generator().manual_seed(0)
    T, Hq, Hkv, D = 1024, 8, 2, 64
    bad = []
    phases = {}
    for dtype in (torch.bfloat16, torch.float32):
        name = str(dtype).replace("torch.", "")

        def rnd(*shape, dtype=dtype, grad=False):
            x = torch.randn(*shape, generator=g).to(args.device, dtype)
            return x.requires_grad_() if grad else x

        telemetry.reset()
        q, k, v = rnd(1, T, Hq, D, grad=True), rnd(1, T, Hkv, D, grad=True), rnd(1, T, Hkv, D, grad=True)
        gates = torch.rand(1, T, Hq, 3, generator=g).to(args.device, dtype)
        out = nsa_attention(q, k, v, gates, cfg)
        out.float().square().mean().backward()
        cu = torch.tensor([0, 100, 613, T], dtype=torch.int32, device=args.device)
        out_v = nsa_attention(q.detach(), k.detach(), v.detach(), gates, cfg, cu_seqlens=cu)
        for label, x in (("dense", out), ("varlen", out_v), ("grad_q", q.grad), ("grad_k", k.grad), ("grad_v", v.grad)):
            if not torch.isfinite(x).all():
                bad.append(f"{name} {label}")
        phases[f"prefill_{name}"] = telemetry.snapshot()

        telemetry.reset()
        cache = NSACache(cfg, 1, T + 8, Hkv, D, D, device=args.device, dtype=dtype)
        with torch.no_grad():
            nsa_prefill(q.detach(), k.detach(), v.detach(), gates, cache)
            for _ in range(8):
                o = nsa_decode(rnd(1, 1, Hq, D), rnd(1, 1, Hkv, D), rnd(1, 1, Hkv, D),
                               torch.rand(1, 1, Hq, 3, generator=g).to(args.device, dtype), cache)
                if not torch.isfinite(o).all():
                    bad.append(f"{name} decode")
        phases[f"decode_{name}"] = telemetry.snapshot()

    for phase, snap in phases.items():
        print(f"routing {phase}: " + ", ".join(f"{r['branch']}->{r['backend']} ({r['reason']}) x{r['calls']}"
                                             for r in snap["counts"]) + f"; fallbacks {snap['fallbacks']}")
    report = {"device": args.device, "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
              "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("NSA_")},
              "phases": phases, "non_finite": bad}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    if bad:
        print("sanity: NON-FINITE values in " + ", ".join(bad), file=sys.stderr)
        return 1
    print("sanity: all outputs and gradients finite")
    return 0


if __name__ == "__main__":
    sys.exit(main())
