"""Selection branch: Triton kernel vs the torch selected branch vs dense causal attention (SDPA / FA-2).

    python3 bench/bench_sel_triton.py --out DIR [--T 4096,8192,...] [--max-seconds 150]

Paper shapes: Hq=64, Hkv=4, l'=64, n=16 (forced blocks included), D=128 and Dk=192/Dv=128, bf16, B=1.
Indices come from the top-n step on random scores (valid, ascending, forced blocks included). Per
(T, shape, impl, mode in {fwd, fwd+bwd}) the median time (nsa.benchutil.time_fn), the K/V bytes the
kernel loads (every visible selected token once per (token, KV head): tokens * (Dk + Dv) * 2 bytes),
the achieved GB/s of that traffic, and TF/s (2 * Hq * tokens * (Dk + Dv) FLOP forward). Dense:
scaled_dot_product_attention causal with enable_gqa (Dv padded to Dk when they differ). The torch
selected branch only up to --torch-max-T (it gathers n*l' tokens per query). Writes
bench_sel_triton.csv and .json (env metadata) to --out.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nsa import NSAConfig  # noqa: E402
from nsa.benchutil import env_metadata, time_fn, write_csv, write_json  # noqa: E402
from nsa.branches.selected.naive import selected_attention, top_n_blocks  # noqa: E402
from nsa.layout import dense_layout  # noqa: E402

SHAPES = {"D128": (64, 4, 128, 128), "Dk192Dv128": (64, 4, 192, 128)}


def make_indices(T, Hkv, cfg, device, chunk=8192):
    out = torch.empty(1, T, Hkv, cfg.n_sel, dtype=torch.int32, device=device)
    J = cfg.n_sel_blocks(T)
    g = torch.Generator(device=device)
    g.manual_seed(0)
    for c0 in range(0, T, chunk):
        c1 = min(T, c0 + chunk)
        pos = torch.arange(c0, c1, device=device)[None]
        scores = torch.rand(1, c1 - c0, Hkv, J, device=device, generator=g)
        out[:, c0:c1] = top_n_blocks(scores, pos, cfg).to(torch.int32)
    return out


def visible_tokens(idx, ls):
    """Sum over (token, KV head) of the selected tokens u <= t (what the kernel loads)."""
    T = idx.shape[1]
    pos = torch.arange(T, device=idx.device)[None, :, None, None]
    j = idx.long()
    n = torch.clamp(pos - j * ls + 1, min=0, max=ls)
    return int(torch.where(j >= 0, n, torch.zeros_like(n)).sum().item())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--T", default="4096,8192,16384,32768,65536")
    ap.add_argument("--shapes", default="D128,Dk192Dv128")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--torch-max-T", type=int, default=8192)
    ap.add_argument("--no-bwd", action="store_true")
    ap.add_argument("--no-dense", action="store_true")
    ap.add_argument("--max-seconds", type=float, default=150.0, help="stop starting new points after this")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_sel_triton needs a CUDA GPU")
    from nsa.kernels.triton.selection import selected_attention_triton

    dev = torch.device("cuda")
    dtype = torch.bfloat16
    cfg = NSAConfig()
    ls = cfg.block_sel
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    t_start = time.perf_counter()
    stopped = None
    for T in [int(x) for x in args.T.split(",")]:
        for shape in args.shapes.split(","):
            if time.perf_counter() - t_start > args.max_seconds:
                stopped = f"--max-seconds {args.max_seconds} reached before T={T} {shape}"
                break
            Hq, Hkv, Dk, Dv = SHAPES[shape]
            torch.manual_seed(0)
            q = torch.randn(1, T, Hq, Dk, device=dev, dtype=dtype, requires_grad=True)
            k = torch.randn(1, T, Hkv, Dk, device=dev, dtype=dtype, requires_grad=True)
            v = torch.randn(1, T, Hkv, Dv, device=dev, dtype=dtype, requires_grad=True)
            idx = make_indices(T, Hkv, cfg, dev)
            ss = torch.zeros(1, T, dtype=torch.long, device=dev)
            tokens = visible_tokens(idx, ls)
            kv_bytes = tokens * (Dk + Dv) * q.element_size()
            flops_fwd = 2.0 * (Hq // Hkv) * tokens * (Dk + Dv)
            go = torch.randn(1, T, Hq, Dv, device=dev, dtype=dtype)
            scale = 1.0 / math.sqrt(Dk)

            impls = {"triton": lambda q=q, k=k, v=v, idx=idx, ss=ss, scale=scale: selected_attention_triton(
                q, k, v, idx, ss, cfg, scale)}
            if T <= args.torch_max_T:
                chunk = max(16, (1 << 31) // (Hkv * cfg.n_sel * ls * (Dk + Dv) * 4 + Hq * cfg.n_sel * ls * 8))
                lay = dense_layout(1, T, cfg, dev)
                impls["torch_sel"] = lambda q=q, k=k, v=v, idx=idx, lay=lay, scale=scale, chunk=chunk: (
                    selected_attention(q, k, v, idx, lay, cfg, scale, chunk=chunk))
            if not args.no_dense:
                qt = q.detach().transpose(1, 2).requires_grad_()
                kt = k.detach().transpose(1, 2).requires_grad_()
                vv = v.detach() if Dv == Dk else torch.nn.functional.pad(v.detach(), (0, Dk - Dv))
                vt = vv.transpose(1, 2).requires_grad_()

                def dense(qt=qt, kt=kt, vt=vt, scale=scale):
                    return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale,
                                                                            enable_gqa=True)
                impls["dense_sdpa_causal"] = dense
            for impl, fn in impls.items():
                modes = ["fwd"] if args.no_bwd else ["fwd", "fwd+bwd"]
                for mode in modes:
                    row = {"T": T, "shape": shape, "Hq": Hq, "Hkv": Hkv, "Dk": Dk, "Dv": Dv, "dtype": "bf16",
                           "block_sel": ls, "n_sel": cfg.n_sel, "impl": impl, "mode": mode}
                    try:
                        if mode == "fwd":
                            def call(fn=fn):
                                with torch.no_grad():
                                    fn()
                        else:
                            def call(fn=fn, go=go):
                                o = fn()
                                o.backward(go if o.shape == go.shape else torch.ones_like(o))
                        res = time_fn(call, iters=args.iters, warmup=args.warmup, device=dev)
                        ms = res["median_ms"]
                        row.update(median_ms=round(ms, 4), min_ms=round(res["min_ms"], 4), status="ok")
                        if impl != "dense_sdpa_causal":
                            row["kv_bytes"] = kv_bytes
                            row["kv_GBps"] = round(kv_bytes / (ms * 1e-3) / 1e9, 1)
                            fl = flops_fwd * (1 if mode == "fwd" else 3.5)
                            row["TFLOPs"] = round(fl / (ms * 1e-3) / 1e12, 2)
                    except torch.OutOfMemoryError as e:
                        row.update(status=f"oom: {str(e)[:80]}")
                    except Exception as e:  # noqa: BLE001 - a failed point is recorded, the sweep goes on
                        row.update(status=f"error: {type(e).__name__}: {str(e)[:160]}")
                    rows.append(row)
                    print(row, flush=True)
                    for x in (q, k, v):
                        x.grad = None
                    torch.cuda.empty_cache()
            q = k = v = idx = impls = None
            torch.cuda.empty_cache()
        if stopped:
            break
    # speed-ups vs dense and vs torch per (T, shape, mode)
    by = {(r["T"], r["shape"], r["mode"], r["impl"]): r.get("median_ms") for r in rows}
    for r in rows:
        if r["impl"] == "triton" and r.get("median_ms"):
            for other in ("dense_sdpa_causal", "torch_sel"):
                o = by.get((r["T"], r["shape"], r["mode"], other))
                if o:
                    r[f"speedup_vs_{other}"] = round(o / r["median_ms"], 2)
    cols = ["T", "shape", "Hq", "Hkv", "Dk", "Dv", "dtype", "block_sel", "n_sel", "impl", "mode", "median_ms",
            "min_ms", "kv_bytes", "kv_GBps", "TFLOPs", "speedup_vs_dense_sdpa_causal", "speedup_vs_torch_sel", "status"]
    write_csv(out_dir / "bench_sel_triton.csv", rows, columns=cols)
    write_json(out_dir / "bench_sel_triton.json", {"env": env_metadata(dev), "rows": rows, "stopped": stopped})
    print(f"wrote {out_dir / 'bench_sel_triton.csv'} ({len(rows)} rows){'; ' + stopped if stopped else ''}")
    return 1 if any(r["status"].startswith("error") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
