"""Decode bench: per-step NSA decode latency after a prefill of S tokens, per-branch time, K/V bytes read,
and a dense-attention decode baseline measured in the same run.

    PYTHONPATH=. python bench/bench_decode.py --B 1 --dim 256 --heads 8 --groups 2 --dk 32 --dv 32 \
        --l 32 --d 16 --l_sel 64 --n_sel 16 --w 512 --S_list 512,1024,2048,4096 --iters 64 --warmup 8 \
        --csv decode.csv --branch_force_mode env

For each S: an NSAAttention layer (model dim --dim, --heads query heads, --groups KV heads) prefills S
tokens into an NSACache (timed once: prefill_ms). Then one decode step at position S is timed
--iters times after --warmup: after every step the cache's length (and compressed-block count) is
restored to S, so every timed step runs on the same state (the step rewrites the same slots with the
same values). Columns (ms are medians):
  step_ms         nsa_decode (cache write + the three branches + gating) on precomputed q/k/v/gates
  layer_step_ms   the whole NSAAttention layer for one token (projections, RoPE, step, output projection)
  tok_per_s       B / step time (attention alone)
  cmp_ms, topk_ms, sel_ms, win_ms   each branch alone on the same cache state (nsa.branches.*.naive):
                  compressed branch; selection scores + top-n; selected branch with those blocks; window
  kv_bytes*       K/V bytes the step reads, counted from the cache by nsa_decode(return_stats=True)
  dense_*         dense decode: write the token into a preallocated [B, Hkv, S+1, D] K/V cache and run
                  SDPA of the one query over all S+1 keys (GQA natively, never is_causal with Tq != Tk)
--branch_force_mode: env|all time every branch alone (env additionally records the NSA_* environment
toggles in the metadata, which route the full step); cmp|sel|win time only that branch (others empty).
The full step and the dense baseline are measured in every mode. A JSON sidecar (CSV path with .json)
holds the environment metadata, the arguments and the rows.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from nsa import NSAAttention, NSAConfig, nsa_decode  # noqa: E402
from nsa.benchutil import (  # noqa: E402
    console,
    env_metadata,
    fmt_bytes,
    parse_dtype,
    print_table,
    resolve_device,
    sidecar_path,
    time_fn,
    write_csv,
    write_json,
)
from nsa.branches.attend import compute_dtype  # noqa: E402
from nsa.branches.compressed.naive import compressed_chunk  # noqa: E402
from nsa.branches.selected.naive import selected_chunk, topn_chunk  # noqa: E402
from nsa.branches.sliding.naive import sliding_chunk  # noqa: E402

MODES = ("env", "cmp", "sel", "win", "all")
COLUMNS = [
    "S", "B", "dim", "heads", "groups", "dk", "dv", "l", "d", "l_sel", "n_sel", "w", "branch_force_mode",
    "device", "dtype", "prefill_ms", "step_ms", "layer_step_ms", "tok_per_s", "cmp_ms", "topk_ms", "sel_ms",
    "win_ms", "cmp_blocks", "kv_bytes", "kv_bytes_cmp", "kv_bytes_sel", "kv_bytes_win", "dense_kv_bytes",
    "kv_bytes_ratio", "dense_ms", "dense_tok_per_s", "speedup_vs_dense",
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--B", type=int, default=1, help="batch")
    p.add_argument("--dim", type=int, default=256, help="model dim of the NSAAttention layer")
    p.add_argument("--heads", type=int, default=8, help="query heads")
    p.add_argument("--groups", type=int, default=2, help="KV heads (GQA groups)")
    p.add_argument("--dk", type=int, default=32)
    p.add_argument("--dv", type=int, default=32)
    p.add_argument("--l", type=int, default=32, help="block_cmp")
    p.add_argument("--d", type=int, default=16, help="stride_cmp")
    p.add_argument("--l_sel", type=int, default=64, help="block_sel")
    p.add_argument("--n_sel", type=int, default=16)
    p.add_argument("--w", type=int, default=512, help="window")
    p.add_argument("--S_list", default="512,1024,2048,4096", help="comma-separated prefill lengths")
    p.add_argument("--iters", type=int, default=64)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--csv", default="decode.csv", help="output CSV (JSON sidecar beside it)")
    p.add_argument("--branch_force_mode", choices=MODES, default="env")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--compress", choices=("avg", "mlp"), default="avg")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        args.S = [int(s) for s in args.S_list.split(",") if s.strip()]
    except ValueError:
        p.error(f"--S_list must be comma-separated integers, got {args.S_list!r}")
    if not args.S or min(args.S) < 1:
        p.error("--S_list needs at least one positive length")
    if args.iters < 1 or args.warmup < 0:
        p.error("--iters must be >= 1 and --warmup >= 0")
    return args


def sdpa_decode(q, k, v, scale):
    """One query per head over all keys. q [B, Hq, 1, Dk], k/v [B, Hkv, N, D]. No mask: every key is past."""
    Hq, Hkv = q.shape[1], k.shape[1]
    try:
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=Hq != Hkv)
    except TypeError:  # torch < 2.5: fold the G query heads of a group into the query length (no K/V copy)
        B, _, _, Dk = q.shape
        qf = q.reshape(B, Hkv, Hq // Hkv, Dk)
        return F.scaled_dot_product_attention(qf, k, v, scale=scale).reshape(B, Hq, 1, v.shape[-1])


def bench_one(S, args, device, dtype, meta_modes):
    cfg = NSAConfig(block_cmp=args.l, stride_cmp=args.d, block_sel=args.l_sel, n_sel=args.n_sel,
                    window=args.w, compress=args.compress)
    torch.manual_seed(args.seed)
    layer = NSAAttention(args.dim, args.heads, args.groups, args.dk, args.dv, cfg).to(device=device, dtype=dtype)
    layer.eval()
    B, Hq, Hkv = args.B, args.heads, args.groups
    cache = layer.new_cache(B, S + 1)
    row = {"S": S, "B": B, "dim": args.dim, "heads": Hq, "groups": Hkv, "dk": args.dk, "dv": args.dv,
           "l": args.l, "d": args.d, "l_sel": args.l_sel, "n_sel": args.n_sel, "w": args.w,
           "branch_force_mode": args.branch_force_mode, "device": str(device),
           "dtype": str(dtype).replace("torch.", "")}
    with torch.no_grad():
        x = torch.randn(B, S + 1, args.dim, device=device, dtype=dtype)
        pre = time_fn(lambda: layer(x[:, :S], cache), iters=1, warmup=0, device=device)
        row["prefill_ms"] = pre["median_ms"]
        n_cmp0 = cache.n_cmp

        def restore():
            cache.length = S
            cache.n_cmp = n_cmp0

        # Inputs of the new token at position S, as the layer computes them.
        pos = torch.full((B, 1), S, device=device, dtype=torch.long)
        q, kv, gates = layer.project(x[:, S:], pos)
        k, v = kv["sel"]
        kw = dict(kv_cmp=kv["cmp"], kv_win=kv["win"], compress_fn=layer.compress_fn())

        _, stats = nsa_decode(q, k, v, gates, cache, return_stats=True, **kw)
        restore()

        def step():
            nsa_decode(q, k, v, gates, cache, **kw)
            restore()

        def layer_step():
            layer(x[:, S:], cache)
            restore()

        row["step_ms"] = time_fn(step, args.iters, args.warmup, device)["median_ms"]
        row["layer_step_ms"] = time_fn(layer_step, args.iters, args.warmup, device)["median_ms"]
        row["tok_per_s"] = B / (row["step_ms"] / 1e3)
        row["cmp_blocks"] = stats["cmp_blocks"]
        for key in ("kv_bytes", "kv_bytes_cmp", "kv_bytes_sel", "kv_bytes_win"):
            row[key] = stats[key]

        # Each branch alone on the cache state after the step (length S + 1), as nsa_decode composes them.
        nsa_decode(q, k, v, gates, cache, **kw)
        t = cache.length - 1
        ct = compute_dtype(q.dtype)
        scale = cfg.softmax_scale(args.dk)
        qc = q.to(ct).unflatten(2, (Hkv, Hq // Hkv))
        t_glob = torch.full((1,), t, device=device, dtype=torch.long)
        seq_start = torch.zeros(B, 1, dtype=torch.long, device=device)
        p_t = t_glob[None].expand(B, 1)
        n = cache.n_cmp
        starts = (torch.arange(n, device=device) * cfg.stride_cmp)[None].expand(B, n)
        valid = torch.ones(B, n, dtype=torch.bool, device=device)

        k_cmp = cache.k_cmp[:, :n].to(ct)

        def run_cmp():
            return compressed_chunk(qc, k_cmp, cache.v_cmp[:, :n].to(ct), starts, valid, t_glob, seq_start, cfg,
                                    scale)

        _, lse = run_cmp()

        def run_topk():
            return topn_chunk(qc, k_cmp, lse, starts, starts, valid, t_glob, seq_start, cfg.n_sel_blocks(t + 1),
                              cfg, scale)

        indices = run_topk()

        def run_sel():
            return selected_chunk(qc, cache.k_sel, cache.v_sel, indices, p_t, seq_start, cfg, scale)

        def run_win():
            return sliding_chunk(qc, cache.k_win.to(ct), cache.v_win.to(ct), cache.win_pos, t_glob, seq_start, cfg,
                                 scale)

        mode = args.branch_force_mode
        wanted = {"cmp": ("cmp",), "sel": ("sel",), "win": ("win",)}.get(mode, ("cmp", "sel", "win"))
        for name, fn in (("cmp", run_cmp), ("topk", run_topk), ("sel", run_sel), ("win", run_win)):
            branch = "sel" if name == "topk" else name
            row[f"{name}_ms"] = (time_fn(fn, args.iters, args.warmup, device)["median_ms"]
                                 if branch in wanted else float("nan"))

        # Dense baseline: a preallocated dense K/V cache holding the same S tokens, one query over S + 1 keys.
        kd = torch.empty(B, Hkv, S + 1, args.dk, device=device, dtype=dtype)
        vd = torch.empty(B, Hkv, S + 1, args.dv, device=device, dtype=dtype)
        kd[:, :, :S] = cache.k_sel[:, :S].transpose(1, 2)
        vd[:, :, :S] = cache.v_sel[:, :S].transpose(1, 2)
        qd = q.transpose(1, 2)  # [B, Hq, 1, Dk]
        k_new, v_new = k.transpose(1, 2), v.transpose(1, 2)

        def dense():
            kd[:, :, S:] = k_new
            vd[:, :, S:] = v_new
            return sdpa_decode(qd, kd, vd, scale)

        # sanity: with w >= S + 1 the window branch alone is exactly this dense attention
        row["dense_ms"] = time_fn(dense, args.iters, args.warmup, device)["median_ms"]
        row["dense_tok_per_s"] = B / (row["dense_ms"] / 1e3)
        row["speedup_vs_dense"] = row["dense_ms"] / row["step_ms"]
        row["dense_kv_bytes"] = B * Hkv * (S + 1) * (args.dk + args.dv) * kd.element_size()
        row["kv_bytes_ratio"] = row["kv_bytes"] / row["dense_kv_bytes"]
    return row


def main(argv=None) -> int:
    args = parse_args(argv)
    device = resolve_device(args.device)
    dtype = parse_dtype(args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    con = console()
    rows = []
    if con is not None:
        from rich.progress import Progress

        with Progress(console=con, transient=True) as prog:
            task = prog.add_task("decode bench", total=len(args.S))
            for S in args.S:
                prog.update(task, description=f"decode bench S={S}")
                rows.append(bench_one(S, args, device, dtype, args.branch_force_mode))
                write_csv(args.csv, rows, COLUMNS)  # partial results survive an interrupted run
                prog.advance(task)
    else:
        for S in args.S:
            print(f"decode bench S={S}", flush=True)
            rows.append(bench_one(S, args, device, dtype, args.branch_force_mode))
            write_csv(args.csv, rows, COLUMNS)
    csv_path = write_csv(args.csv, rows, COLUMNS)
    meta = env_metadata(device)
    side = write_json(sidecar_path(csv_path), {"meta": meta, "args": {k: v for k, v in vars(args).items()},
                                                "columns": COLUMNS, "rows": rows})
    f = lambda x, p=3: "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{p}f}"  # noqa: E731
    print_table(f"NSA decode ({device}, {rows[0]['dtype']}, B={args.B}, Hq={args.heads}, Hkv={args.groups}, "
                f"dk={args.dk}, dv={args.dv}, mode={args.branch_force_mode})",
                ["S", "step ms", "layer ms", "tok/s", "cmp", "topk", "sel", "win", "KV read", "dense KV",
                 "dense ms", "x dense"],
                [[r["S"], f(r["step_ms"]), f(r["layer_step_ms"]), f(r["tok_per_s"], 0), f(r["cmp_ms"]),
                  f(r["topk_ms"]), f(r["sel_ms"]), f(r["win_ms"]), fmt_bytes(r["kv_bytes"]),
                  fmt_bytes(r["dense_kv_bytes"]), f(r["dense_ms"]), f(r["speedup_vs_dense"], 2)] for r in rows],
                con)
    print(f"wrote {csv_path} and {side}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
