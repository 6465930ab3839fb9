"""FA-2 providers vs SDPA (and the torch path) on the compressed (cmp) and sliding (win) branches.

    python bench/bench_fa2.py [--T 1024,2048,...] [--D 64,128,192,256] [--out DIR]
                              [--write-thresholds nsa/fa2_thresholds.json] [--max-seconds 200]

Forward of each branch alone (provider calls, as nsa_attention makes them), bf16, paper heads
(Hq=64, Hkv=4; Dk=Dv=D), dense B=1. Writes DIR/bench_fa2.csv and DIR/bench_fa2.json (environment
metadata from nsa.benchutil, rows, derived thresholds). Threshold per (branch, D): the smallest measured
T from which the FA-2 provider is at least as fast as SDPA at every larger measured T (16, the library
default, when it already wins at the smallest T; null when it never does). `speedup_vs_sdpa` >= 1.2 is
the acceptance column. A row still running when --max-seconds is spent finishes; later rows are
recorded as skipped.
"""

# ruff: noqa: B023 - the timed lambdas run inside the loop iteration that defines them
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nsa import (  # noqa: E402
    NSAConfig,  # noqa: E402
    plan,
    toggles,
)
from nsa.benchutil import env_metadata, time_fn, write_csv, write_json  # noqa: E402
from nsa.branches.compressed.fa2 import compressed_fa2  # noqa: E402
from nsa.branches.compressed.naive import compressed_attention  # noqa: E402
from nsa.branches.compressed.sdpa import compressed_sdpa  # noqa: E402
from nsa.branches.context import CallContext  # noqa: E402
from nsa.branches.sliding.fa2 import sliding_fa2  # noqa: E402
from nsa.branches.sliding.naive import sliding_attention  # noqa: E402
from nsa.branches.sliding.sdpa import sliding_sdpa  # noqa: E402
from nsa.compress import compress_kv  # noqa: E402
from nsa.layout import dense_layout  # noqa: E402
from nsa.plan.rules import gpu_class  # noqa: E402
from nsa.validation import Shapes  # noqa: E402

TORCH_PATH_MAX_T = 16384


def torch_path(branch, q, k, v, kc, vc, layout, cfg, scale, chunk=2048):
    if branch == "cmp":
        return compressed_attention(q, kc, vc, layout, cfg, scale, chunk=chunk)[0]
    return sliding_attention(q, k, v, layout, cfg, scale, chunk=chunk)


def derive(rows, providers):
    out = {}
    for prov in providers:
        for (branch, D) in sorted({(r["branch"], r["D"]) for r in rows}):
            pts = sorted((r["T"], r["fa2_ms"], r["sdpa_ms"]) for r in rows
                         if r["branch"] == branch and r["D"] == D and r["provider"] == prov
                         and r["fa2_ms"] is not None and r["sdpa_ms"] is not None)
            if not pts:
                continue
            thr = None
            for i, (T, _, _) in enumerate(pts):
                if all(f <= s for _, f, s in pts[i:]):
                    thr = T if i else 16
                    break
            out.setdefault(prov, {}).setdefault(D, {})[branch] = thr
    return out


def write_thresholds(path: Path, derived, cls, device_name, provider):
    table = json.loads(path.read_text()) if path.exists() else {"schema": "nsa-fa2-thresholds/1",
                                                                 "default": {"win": 16, "cmp": 16, "measured": False}}
    entries = [e for e in table.get("entries", []) if e.get("gpu_class") != cls]
    for D, th in sorted(derived.get(provider, {}).items()):
        e = {"gpu_class": cls, "gpu_name": device_name, "head_dim": D, "provider": provider, "measured": True,
             "source": "bench/bench_fa2.py", "date": time.strftime("%Y-%m-%d")}
        for b in ("cmp", "win"):
            if b in th:
                e[b] = th[b] if th[b] is not None else 1 << 30  # FA-2 never faster: effectively off
        entries.append(e)
    table["entries"] = entries
    path.write_text(json.dumps(table, indent=2) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", default="1024,2048,4096,8192,16384,32768,65536")
    ap.add_argument("--D", default="64,128,192,256")
    ap.add_argument("--Hq", type=int, default=64)
    ap.add_argument("--Hkv", type=int, default=4)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--write-thresholds", default=None)
    ap.add_argument("--max-seconds", type=float, default=200.0)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_fa2: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    providers = [n for n in ("flash_attn", "torch_flash") if plan.PROVIDERS[n].availability(dev, True)[0]]
    if not providers:
        print("bench_fa2: no FA-2 provider available", file=sys.stderr)
        return 2
    cfg = NSAConfig()
    tg = toggles.read()
    Ts = [int(x) for x in args.T.split(",")]
    Ds = [int(x) for x in args.D.split(",")]
    deadline = time.monotonic() + args.max_seconds
    rows = []
    for D in Ds:
        for T in Ts:
            if time.monotonic() > deadline:
                rows += [dict(provider=p, branch=b, T=T, D=D, Hq=args.Hq, Hkv=args.Hkv, fa2_ms=None, sdpa_ms=None,
                              torch_ms=None, speedup_vs_sdpa=None, status="skipped: time budget")
                         for p in providers for b in ("cmp", "win")]
                continue
            g = torch.Generator(device="cuda").manual_seed(0)
            q = torch.randn(1, T, args.Hq, D, device=dev, dtype=torch.bfloat16, generator=g)
            k = torch.randn(1, T, args.Hkv, D, device=dev, dtype=torch.bfloat16, generator=g)
            v = torch.randn(1, T, args.Hkv, D, device=dev, dtype=torch.bfloat16, generator=g)
            layout = dense_layout(1, T, cfg, dev)
            kc, vc = compress_kv(k, v, layout, cfg)
            ctx = CallContext(Shapes(1, T, args.Hq, args.Hkv, D, D), q.dtype, dev, False, kernel_dtype=q.dtype)
            scale = D ** -0.5
            with torch.no_grad():
                for branch in ("cmp", "win"):
                    a = (q, kc, vc) if branch == "cmp" else (q, k, v)

                    def call(p, a=a, branch=branch):
                        fn = compressed_fa2 if branch == "cmp" else sliding_fa2
                        return fn(p, ctx, tg, *a, layout, cfg, scale)

                    sdpa_fn = compressed_sdpa if branch == "cmp" else sliding_sdpa
                    sd = time_fn(lambda f=sdpa_fn, a=a: f(tg, *a, layout, cfg, scale), args.iters, args.warmup,
                                 dev)["median_ms"]
                    tp = None
                    if T <= TORCH_PATH_MAX_T:
                        tp = time_fn(lambda b=branch: torch_path(b, q, k, v, kc, vc, layout, cfg, scale), 2, 1,
                                     dev)["median_ms"]
                    for pname in providers:
                        fa = time_fn(lambda p=plan.PROVIDERS[pname]: call(p), args.iters, args.warmup,
                                     dev)["median_ms"]
                        rows.append(dict(provider=pname, branch=branch, T=T, D=D, Hq=args.Hq, Hkv=args.Hkv,
                                         fa2_ms=round(fa, 4), sdpa_ms=round(sd, 4),
                                         torch_ms=None if tp is None else round(tp, 4),
                                         speedup_vs_sdpa=round(sd / fa, 3), status="ok"))
                        print(f"{pname:12} {branch} D={D:3} T={T:6}  fa2 {fa:9.3f} ms  sdpa {sd:9.3f} ms  "
                              f"torch {'-' if tp is None else f'{tp:9.3f}'} ms  x{sd / fa:.2f}", flush=True)
            q = k = v = kc = vc = None
            torch.cuda.empty_cache()
    meta = env_metadata(dev)
    cls = gpu_class(torch.cuda.get_device_capability(dev))
    derived = derive(rows, providers)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "bench_fa2.csv", rows)
    write_json(out / "bench_fa2.json", {"env": meta, "gpu_class": cls, "rows": rows,
                                         "thresholds": {p: {str(D): t for D, t in d.items()}
                                                        for p, d in derived.items()}})
    if args.write_thresholds:
        write_thresholds(Path(args.write_thresholds), derived, cls, meta.get("device_name"), providers[0])
    print(json.dumps({"gpu_class": cls, "thresholds": {p: {str(D): t for D, t in d.items()}
                                                       for p, d in derived.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
