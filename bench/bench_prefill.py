"""Prefill bench: forward and backward time and peak memory of nsa_attention against T, with a dense causal
attention baseline (SDPA) measured in the same run, and a scaling check.

    PYTHONPATH=. python bench/bench_prefill.py --T_list 1024,2048,4096,8192,16384            # GPU, paper shapes
    PYTHONPATH=. python bench/bench_prefill.py --device cpu --heads 4 --kv_heads 1 --dk 64 --dv 64 \
        --T_list 1024,2048,4096,8192,16384 --iters 1 --warmup 0                              # CPU

Defaults: NSAConfig() (l=32, d=16, l'=64, n=16, w=512) and the paper's heads (Hq=64, Hkv=4, Dk=192,
Dv=128), B=1. For each T:
  fwd_ms          forward under torch.no_grad() (the prefill cost)
  fwd_bwd_ms      forward with autograd + backward of a random output gradient; bwd_ms = fwd_bwd - fwd
  fwd_peak_bytes / fwd_bwd_peak_bytes   peak memory above the inputs (see nsa.benchutil.peak_memory)
  dense_*         the same for SDPA causal attention (enable_gqa, is_causal=True since Tq == Tk);
                  skipped (empty) above --dense_max_T
  ratio_*         NSA / dense
  work            T * (T / stride_cmp + n_sel * block_sel + window): the keys NSA visits per query head,
                  summed over queries (upper bound); *_per_work = time (ns) or bytes divided by it. These
                  columns stay flat (or fall) as T grows when the implementation scales as NSA should.
CSV (--csv) and JSON (--json: environment metadata, arguments, rows).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from nsa import NSAConfig, nsa_attention, telemetry  # noqa: E402
from nsa.benchutil import (  # noqa: E402
    console,
    env_metadata,
    exact_cpu_allocations,
    fmt_bytes,
    parse_dtype,
    peak_memory,
    print_table,
    resolve_device,
    time_fn,
    write_csv,
    write_json,
)

COLUMNS = [
    "T", "B", "Hq", "Hkv", "Dk", "Dv", "backend", "served", "device", "dtype", "block_cmp", "stride_cmp",
    "block_sel", "n_sel", "window", "work", "fwd_ms", "fwd_bwd_ms", "bwd_ms", "fwd_peak_bytes",
    "fwd_bwd_peak_bytes", "dense_fwd_ms", "dense_fwd_bwd_ms", "dense_fwd_peak_bytes", "dense_fwd_bwd_peak_bytes",
    "ratio_fwd", "ratio_fwd_bwd", "ratio_fwd_peak", "ratio_fwd_bwd_peak", "fwd_ns_per_work",
    "fwd_bwd_ns_per_work", "fwd_peak_bytes_per_work", "fwd_bwd_peak_bytes_per_work", "peak_method", "dense_impl",
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--T_list", default="1024,2048,4096,8192,16384")
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--heads", type=int, default=64, help="query heads (paper: 64)")
    p.add_argument("--kv_heads", type=int, default=4, help="KV heads (paper: 4)")
    p.add_argument("--dk", type=int, default=192)
    p.add_argument("--dv", type=int, default=128)
    p.add_argument("--l", type=int, default=32, help="block_cmp")
    p.add_argument("--d", type=int, default=16, help="stride_cmp")
    p.add_argument("--l_sel", type=int, default=64, help="block_sel")
    p.add_argument("--n_sel", type=int, default=16)
    p.add_argument("--w", type=int, default=512, help="window")
    p.add_argument("--backend", choices=("torch", "auto", "reference"), default="torch")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--no-backward", dest="backward", action="store_false", help="time the forward only")
    p.add_argument("--no-dense", dest="dense", action="store_false", help="skip the dense baseline")
    p.add_argument("--dense_max_T", type=int, default=None,
                   help="largest T of the dense baseline (default: no limit on cuda, 8192 on cpu)")
    p.add_argument("--csv", default="prefill.csv")
    p.add_argument("--json", default=None, help="default: the CSV path with .json")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        args.T = [int(t) for t in args.T_list.split(",") if t.strip()]
    except ValueError:
        p.error(f"--T_list must be comma-separated integers, got {args.T_list!r}")
    if not args.T or min(args.T) < 1:
        p.error("--T_list needs at least one positive length")
    if args.heads % args.kv_heads:
        p.error(f"--heads ({args.heads}) must be a multiple of --kv_heads ({args.kv_heads})")
    if args.iters < 1 or args.warmup < 0:
        p.error("--iters must be >= 1 and --warmup >= 0")
    return args


def dense_attention(q, k, v, scale):
    """Causal dense attention, [B, T, H, D] in and out. GQA natively where SDPA has enable_gqa."""
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    try:
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale,
                                           enable_gqa=q.shape[2] != k.shape[2])
        impl = "sdpa(enable_gqa)"
    except TypeError:  # torch < 2.5: no enable_gqa; the only dense option copies K/V per query head
        G = q.shape[2] // k.shape[2]
        o = F.scaled_dot_product_attention(qt, kt.repeat_interleave(G, 1), vt.repeat_interleave(G, 1),
                                           is_causal=True, scale=scale)
        impl = "sdpa(repeat_interleave)"
    return o.transpose(1, 2), impl


def measure(fn_fwd, inputs, grad_out, args, device):
    """(fwd_ms, fwd_bwd_ms, fwd_peak, fwd_bwd_peak) of fn_fwd(*inputs)."""
    def fwd():
        with torch.no_grad():
            return fn_fwd(*inputs)

    def fwd_bwd():
        for t in inputs:
            t.grad = None
        out = fn_fwd(*inputs)
        out.backward(grad_out)

    res = {"fwd_ms": time_fn(fwd, args.iters, args.warmup, device)["median_ms"]}
    res["fwd_peak_bytes"], method = _peak(fwd, device)
    if args.backward:
        res["fwd_bwd_ms"] = time_fn(fwd_bwd, args.iters, args.warmup, device)["median_ms"]
        res["bwd_ms"] = res["fwd_bwd_ms"] - res["fwd_ms"]
        res["fwd_bwd_peak_bytes"], _ = _peak(fwd_bwd, device)
        for t in inputs:
            t.grad = None
    return res, method


def _peak(fn, device):
    r = peak_memory(fn, device)
    return r["peak_bytes"], r["method"]


def bench_one(T, args, device, dtype):
    cfg = NSAConfig(block_cmp=args.l, stride_cmp=args.d, block_sel=args.l_sel, n_sel=args.n_sel, window=args.w)
    g = torch.Generator(device="cpu").manual_seed(args.seed)
    B, Hq, Hkv = args.B, args.heads, args.kv_heads

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype).requires_grad_(True)

    q, k, v = rnd(B, T, Hq, args.dk), rnd(B, T, Hkv, args.dk), rnd(B, T, Hkv, args.dv)
    gates = torch.rand(B, T, Hq, 3, generator=g).to(device=device, dtype=dtype).requires_grad_(True)
    grad_out = torch.randn(B, T, Hq, args.dv, generator=g).to(device=device, dtype=dtype)
    work = T * (T / cfg.stride_cmp + cfg.n_sel * cfg.block_sel + cfg.window)
    row = {"T": T, "B": B, "Hq": Hq, "Hkv": Hkv, "Dk": args.dk, "Dv": args.dv, "backend": args.backend,
           "device": str(device), "dtype": str(dtype).replace("torch.", ""), "block_cmp": cfg.block_cmp,
           "stride_cmp": cfg.stride_cmp, "block_sel": cfg.block_sel, "n_sel": cfg.n_sel, "window": cfg.window,
           "work": work}
    telemetry.reset()
    nsa_fn = lambda q_, k_, v_, g_: nsa_attention(q_, k_, v_, g_, cfg, backend=args.backend)  # noqa: E731
    res, method = measure(nsa_fn, (q, k, v, gates), grad_out, args, device)
    row.update(res)
    row["peak_method"] = method
    served = {b: telemetry.served(b) for b in ("cmp", "sel", "win")}
    row["served"] = ";".join(f"{b}:{'+'.join(sorted(s))}" for b, s in served.items())

    dense_max = args.dense_max_T if args.dense_max_T is not None else (None if device.type == "cuda" else 8192)
    if args.dense and (dense_max is None or T <= dense_max):
        scale = cfg.softmax_scale(args.dk)
        _, impl = dense_attention(q[:, :1].detach(), k[:, :1].detach(), v[:, :1].detach(), scale)
        dres, _ = measure(lambda q_, k_, v_: dense_attention(q_, k_, v_, scale)[0], (q, k, v), grad_out, args,
                          device)
        for key, val in dres.items():
            row[f"dense_{key}"] = val
        row["dense_impl"] = impl
        for a, b in (("fwd", "fwd_ms"), ("fwd_bwd", "fwd_bwd_ms"), ("fwd_peak", "fwd_peak_bytes"),
                     ("fwd_bwd_peak", "fwd_bwd_peak_bytes")):
            if b in row and f"dense_{b}" in row and row[f"dense_{b}"]:
                row[f"ratio_{a}"] = row[b] / row[f"dense_{b}"]
    row["fwd_ns_per_work"] = row["fwd_ms"] * 1e6 / work
    if "fwd_bwd_ms" in row:
        row["fwd_bwd_ns_per_work"] = row["fwd_bwd_ms"] * 1e6 / work
        row["fwd_bwd_peak_bytes_per_work"] = row["fwd_bwd_peak_bytes"] / work
    row["fwd_peak_bytes_per_work"] = row["fwd_peak_bytes"] / work
    return row


def main(argv=None) -> int:
    args = parse_args(argv)
    device = resolve_device(args.device)
    if device.type == "cpu":
        exact_cpu_allocations()  # before any tensor is made: CPU peak memory follows allocations
    dtype = parse_dtype(args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    con = console()
    rows = []
    if con is not None:
        from rich.progress import Progress

        with Progress(console=con, transient=True) as prog:
            task = prog.add_task("prefill bench", total=len(args.T))
            for T in args.T:
                prog.update(task, description=f"prefill bench T={T}")
                rows.append(bench_one(T, args, device, dtype))
                write_csv(args.csv, rows, COLUMNS)  # partial results survive an interrupted run
                prog.advance(task)
    else:
        for T in args.T:
            print(f"prefill bench T={T}", flush=True)
            rows.append(bench_one(T, args, device, dtype))
            write_csv(args.csv, rows, COLUMNS)
    csv_path = write_csv(args.csv, rows, COLUMNS)
    json_path = write_json(args.json or Path(args.csv).with_suffix(".json"),
                           {"meta": env_metadata(device), "args": vars(args), "columns": COLUMNS, "rows": rows})

    def f(x, p=1):
        return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{p}f}"

    print_table(f"nsa_attention prefill ({args.backend}, {device}, {rows[0]['dtype']}, B={args.B}, Hq={args.heads}, "
                f"Hkv={args.kv_heads}, Dk={args.dk}, Dv={args.dv}, l={args.l} d={args.d} l'={args.l_sel} "
                f"n={args.n_sel} w={args.w})",
                ["T", "fwd ms", "fwd+bwd ms", "fwd peak", "fwd+bwd peak", "dense fwd", "dense fwd+bwd",
                 "dense peak", "x dense fwd", "fwd ns/work", "fwd+bwd ns/work", "peak B/work"],
                [[r["T"], f(r["fwd_ms"]), f(r.get("fwd_bwd_ms")), fmt_bytes(r["fwd_peak_bytes"]),
                  fmt_bytes(r.get("fwd_bwd_peak_bytes")), f(r.get("dense_fwd_ms")), f(r.get("dense_fwd_bwd_ms")),
                  fmt_bytes(r.get("dense_fwd_bwd_peak_bytes", r.get("dense_fwd_peak_bytes"))),
                  f(r.get("ratio_fwd"), 2), f(r["fwd_ns_per_work"], 3), f(r.get("fwd_bwd_ns_per_work"), 3),
                  f(r.get("fwd_bwd_peak_bytes_per_work", r["fwd_peak_bytes_per_work"]), 3)] for r in rows], con)
    print(f"wrote {csv_path} and {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
