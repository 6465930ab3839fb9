"""One step of the fused pipeline alone, for `ncu` (one launch of each kernel after a warm-up).

    ncu --kernel-name regex:_topn_kernel --launch-skip 1 --launch-count 1 python bench/profile_step.py --step topn
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from nsa import NSAConfig  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--step", choices=("topn", "sel", "sel_bwd", "cmp", "win"), default="topn")
    ap.add_argument("--T", type=int, default=16384)
    ap.add_argument("--Hq", type=int, default=64)
    ap.add_argument("--Hkv", type=int, default=4)
    ap.add_argument("--D", type=int, default=128)
    args = ap.parse_args(argv)
    from nsa import plan as planning
    from nsa.compress import compress_kv
    from nsa.layout import dense_layout

    cfg, dev = NSAConfig(), torch.device("cuda")
    q = torch.randn(1, args.T, args.Hq, args.D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, args.T, args.Hkv, args.D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(1, args.T, args.Hkv, args.D, device=dev, dtype=torch.bfloat16)
    p = planning.make_plan("auto", q, k, v, cfg)
    layout = dense_layout(1, args.T, cfg, dev)
    scale = cfg.softmax_scale(args.D)
    kc, vc = compress_kv(k, v, layout, cfg)
    o, lse = p.cmp.fn(q, kc, vc, layout, cfg, scale)
    idx = p.topn.fn(q, kc, lse, layout, cfg, scale)
    for _ in range(2):
        if args.step == "topn":
            p.topn.fn(q, kc, lse, layout, cfg, scale)
        elif args.step == "sel":
            p.sel.fn(q, k, v, idx, layout, cfg, scale)
        elif args.step == "sel_bwd":
            qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
            out = p.sel.fn(qq, kk, vv, idx, layout, cfg, scale)
            torch.autograd.grad(out, (qq, kk, vv), torch.randn_like(out))
        elif args.step == "cmp":
            p.cmp.fn(q, kc, vc, layout, cfg, scale)
        else:
            p.win.fn(q, k, v, layout, cfg, scale)
    torch.cuda.synchronize()
    print("done", p.describe())


if __name__ == "__main__":
    main()
