"""The whole NSA operation against dense attention: forward, backward, forward+backward, per-step breakdown.

    PYTHONPATH=. python bench/bench_nsa.py --out bench/results/h100-cu130-torch2.11      # GPU, paper shapes
    PYTHONPATH=. python bench/bench_nsa.py --smoke --out /tmp/nsa-smoke                  # tiny CPU run (CI)

For each shape (--shapes: D128 = Hq 64, Hkv 4, Dk = Dv = 128; Dk192Dv128 = the paper's heads), dtype
(--dtypes, default bf16) and T (--T, B=1; --packed adds a batch of 16 sequences of 4k packed with
cu_seqlens, which nsa_attention runs as the dense batch [16, 4096] it is; --ragged adds 16 packed sequences
of 3072 and 5120 tokens in turn, the varlen path, with no dense baseline; --one-seq-packed adds each T
again as cu_seqlens=[0, T], which must time as the dense call),
paper blocks (l=32, d=16, l'=64, n=16, w=512; --config n_sel=13,window=192 changes NSAConfig fields, e.g. to
see what fewer selected blocks or a shorter window would cost), shared K/V for the three branches:
  nsa        nsa_attention(..., backend="auto"): fwd (no grad), bwd (backward of a random output
             gradient, graph kept), fwdbwd (both); the plan that served it (telemetry) is recorded
  dense_fa2  causal SDPA with the flash backend only (FlashAttention-2; GQA through enable_gqa)
  cudnn      causal SDPA with the cuDNN backend only (K/V repeated per query head when cuDNN refuses GQA)
  fla        fla's parallel_nsa when `fla-core` is installed: another NSA variant (block = stride = 64,
             no compression inside the timed op), shown as a peer, not the same function
All three are measured in the same process, medians with min/max over --iters after --warmup (CUDA
events). speedup_* = dense FA-2 time / NSA time. peak_mib: peak allocated memory of one fwd+bwd,
inputs and gradients included (torch.cuda.max_memory_allocated).
Breakdown (--breakdown-T, default the largest T): each step of the fused pipeline alone (compress,
cmp, topn, sel, win, combine), forward and backward, with the FLOPs and bytes it must do/move and the
achieved TF/s and TB/s (H100: 989 TF/s bf16 dense, 3.35 TB/s; H200: same compute, 4.8 TB/s).
--compile adds an `nsa_compiled` row per point: the same call under torch.compile(fullgraph=True) (Inductor;
NSA's Triton kernels are custom operators, docs/compile.md), timed the same way after a warm-up call that
compiles it (its seconds in compile_s); speedup_* of that row = eager NSA time / compiled time.
Outputs in --out: bench_nsa.csv, bench_nsa_breakdown.csv, bench_nsa.json (environment, arguments, rows,
hardware limits) and bench_nsa.png (time against T, log-log) when matplotlib is installed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from nsa import NSAConfig, nsa_attention, telemetry  # noqa: E402
from nsa.benchutil import env_metadata, time_fn, write_csv, write_json  # noqa: E402

SHAPES = {"D128": (64, 4, 128, 128), "Dk192Dv128": (64, 4, 192, 128)}
SMOKE_SHAPES = {"small": (4, 2, 32, 16)}
LIMITS = {"H100": (989.0, 3.35), "H200": (989.0, 4.8), "A100": (312.0, 2.0)}  # bf16 dense TF/s, HBM TB/s
COLUMNS = ["impl", "T", "B", "n_seq", "input", "dtype", "Hq", "Hkv", "Dk", "Dv", "fwd_ms", "fwd_min_ms",
           "fwd_max_ms", "bwd_ms", "bwd_min_ms", "bwd_max_ms", "fwdbwd_ms", "dense_fa2_fwd_ms", "dense_fa2_bwd_ms",
           "cudnn_fwd_ms", "cudnn_bwd_ms", "speedup_fwd", "speedup_bwd", "speedup_fwdbwd", "speedup_fwd_vs_cudnn",
           "speedup_bwd_vs_cudnn", "peak_mib", "dense_peak_mib", "fwd_tflops", "plan", "status"]
BREAKDOWN_COLUMNS = ["T", "shape", "step", "fwd_ms", "bwd_ms", "gflop_fwd", "gbytes_fwd", "fwd_tflops",
                     "fwd_tbps", "bwd_tflops", "provider"]


def hw_limits(name: str):
    for key, lim in LIMITS.items():
        if key in name:
            return {"gpu": key, "tflops_bf16": lim[0], "hbm_tbps": lim[1]}
    return {"gpu": name, "tflops_bf16": None, "hbm_tbps": None}


def make_inputs(B, T, Hq, Hkv, Dk, Dv, dtype, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(B, T, Hq, Dk, device=device, dtype=dtype, generator=g)
    k = torch.randn(B, T, Hkv, Dk, device=device, dtype=dtype, generator=g)
    v = torch.randn(B, T, Hkv, Dv, device=device, dtype=dtype, generator=g)
    gates = torch.rand(B, T, Hq, 3, device=device, dtype=dtype, generator=g)
    return q, k, v, gates


def timed_fwd_bwd(fwd, inputs, iters, warmup, device):
    """fwd(*inputs) -> out. Returns (fwd stats, bwd stats, fwdbwd stats) from time_fn."""
    with torch.no_grad():
        f = time_fn(lambda: fwd(*inputs), iters, warmup, device)
    leaves = [x.detach().requires_grad_() for x in inputs]
    out = fwd(*leaves)
    go = torch.randn_like(out)
    b = time_fn(lambda o=out: torch.autograd.grad(o, leaves, go, retain_graph=True, allow_unused=True), iters,
                warmup, device)

    def both():
        o = fwd(*leaves)
        torch.autograd.grad(o, leaves, go, allow_unused=True)

    fb = time_fn(both, max(1, iters // 2), 1, device)
    return f, b, fb


def compiled_row(fwd, inputs, eager: dict, iters, warmup, device) -> dict:
    """The nsa_compiled row: fwd under torch.compile(fullgraph=True), the first (compiling) calls timed apart
    from the measured ones; speedups against the eager row."""
    row = {k: eager[k] for k in ("T", "B", "n_seq", "Hq", "Hkv", "Dk", "Dv", "shape")}
    row.update(impl="nsa_compiled", status="ok")
    compiled = torch.compile(fwd, fullgraph=True)
    # The bwd timing replays one graph (retain_graph=True): AOTAutograd must not donate its saved buffers.
    nodonate = torch._functorch.config.patch(donated_buffer=False)
    try:
        nodonate.__enter__()
        t0 = time.perf_counter()
        leaves = [x.detach().requires_grad_() for x in inputs]
        torch.autograd.grad(compiled(*leaves).float().sum(), leaves)
        with torch.no_grad():
            compiled(*inputs)
        torch.cuda.synchronize() if device.type == "cuda" else None
        row["compile_s"] = round(time.perf_counter() - t0, 1)
        f, b, fb = timed_fwd_bwd(compiled, inputs, iters, warmup, device)
        row.update(fwd_ms=f["median_ms"], fwd_min_ms=f["min_ms"], fwd_max_ms=f["max_ms"], bwd_ms=b["median_ms"],
                   bwd_min_ms=b["min_ms"], bwd_max_ms=b["max_ms"], fwdbwd_ms=fb["median_ms"])
        for m in ("fwd", "bwd", "fwdbwd"):
            if eager.get(f"{m}_ms") and row.get(f"{m}_ms"):
                row[f"speedup_{m}"] = round(eager[f"{m}_ms"] / row[f"{m}_ms"], 3)
    except Exception as e:  # noqa: BLE001 - recorded in the row (a bench reports, it does not stop)
        row["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    finally:
        nodonate.__exit__(None, None, None)
    print(f"{row['shape']:11} T={row['T']:7} seqs={row['n_seq']:2} nsa compiled fwd {fmt(row.get('fwd_ms'))} "
          f"bwd {fmt(row.get('bwd_ms'))} fwdbwd {fmt(row.get('fwdbwd_ms'))} (x{fmt(row.get('speedup_fwdbwd'))} "
          f"of eager; compiled in {row.get('compile_s', '-')} s) {row['status']}", flush=True)
    return row


def peak_fwdbwd(fwd, inputs, device):
    """Peak allocated MiB of one forward+backward, inputs and gradients included."""
    if device.type != "cuda":
        return None
    leaves = [x.detach().requires_grad_() for x in inputs]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    out = fwd(*leaves)
    grads = torch.autograd.grad(out, leaves, torch.randn_like(out), allow_unused=True)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated(device) / 2**20
    del out, grads
    return round(peak, 1)


def dense_sdpa(backend_name, Dk, Dv, Hq, Hkv):
    """Causal SDPA restricted to one backend; q [B, T, Hq, Dk] layouts as NSA's. Dk != Dv: v padded."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend_name]
    G = Hq // Hkv

    def fwd(q, k, v, gates, repeat=False):
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if Dv != Dk:
            vt = F.pad(vt, (0, Dk - Dv))
        kw = {"enable_gqa": True}
        if repeat:
            kt, vt, kw = kt.repeat_interleave(G, 1), vt.repeat_interleave(G, 1), {}
        with sdpa_kernel(backend):
            o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, **kw)
        return o[..., :Dv].transpose(1, 2)

    return fwd


def step_models(cfg, T, B, Hq, Hkv, Dk, Dv, idx=None):
    """(flops, bytes) each step must do/move at least, for one sequence of T per batch row (bf16)."""
    e = 2  # bytes per element
    d, l, w = cfg.stride_cmp, cfg.block_cmp, cfg.window
    t = torch.arange(T, dtype=torch.float64)
    vis_cmp = torch.clamp(torch.div(t + 1 - l, d, rounding_mode="floor") + 1, min=0).sum().item()
    vis_win = torch.clamp(t + 1, max=w).sum().item()
    if idx is not None:  # tokens the selected branch attends, from the real indices
        j = idx[0].long()
        pos = torch.arange(T, device=j.device)[:, None, None]
        n = torch.clamp(pos - j * cfg.block_sel + 1, min=0, max=cfg.block_sel)
        vis_sel = torch.where(j >= 0, n, torch.zeros_like(n)).sum().item() / Hkv
    else:
        vis_sel = torch.clamp(t + 1, max=cfg.n_sel * cfg.block_sel).sum().item()
    G = Hq // Hkv
    nc = cfg.n_cmp_blocks(T)
    qb, ob = B * T * Hq * Dk * e, B * T * Hq * Dv * e
    kvb = B * T * Hkv * (Dk + Dv) * e
    kvc = B * nc * Hkv * (Dk + Dv) * e
    return {
        "compress": (B * T * Hkv * (Dk + Dv) * 2.0, kvb + kvc),
        "cmp": (2.0 * B * Hq * vis_cmp * (Dk + Dv), qb + kvc + ob),
        "topn": (2.0 * B * Hq * vis_cmp * Dk, qb + kvc + B * T * Hkv * cfg.n_sel * 4),
        "sel": (2.0 * B * G * Hkv * vis_sel * (Dk + Dv), qb + kvb + ob),
        "win": (2.0 * B * Hq * vis_win * (Dk + Dv), qb + kvb + ob),
        "combine": (4.0 * B * T * Hq * Dv, 4 * ob + B * T * Hq * 3 * e),
        "dense": (2.0 * B * Hq * (T * (T + 1) / 2) * (Dk + Dv), qb + kvb + ob),
    }


def breakdown(cfg, q, k, v, gates, iters, warmup, device, shape_name):
    """Each step of the fused pipeline alone, as nsa.run.fused composes them."""
    from nsa import plan as planning
    from nsa.branches.combine.naive import combine_torch
    from nsa.compress import compress_kv
    from nsa.layout import dense_layout

    B, T, Hq, Dk = q.shape
    Hkv, Dv = k.shape[2], v.shape[3]
    leaves = [x.detach().requires_grad_() for x in (q, k, v, gates)]
    q, k, v, gates = leaves
    p = planning.make_plan("auto", q, k, v, cfg)
    if p.executor != "fused":
        return [], p.describe()
    layout = dense_layout(B, T, cfg, device)
    scale = cfg.softmax_scale(Dk)
    k_cmp, v_cmp = compress_kv(k, v, layout, cfg)
    o_cmp, lse = p.cmp.fn(q, k_cmp, v_cmp, layout, cfg, scale)
    idx = p.topn.fn(q, k_cmp, lse, layout, cfg, scale)
    o_sel = p.sel.fn(q, k, v, idx, layout, cfg, scale)
    # the dense core's sliding branch on NSA's Triton kernels: both directions (its backward timed alone)
    if p.win.provider == "triton_window":
        from nsa.kernels.triton.window import window_backward, window_forward

        o_win, lse_w = window_forward(q.detach(), k.detach(), v.detach(), cfg.window, scale)
        d_w = torch.randn_like(o_win)
        win = (lambda: window_forward(q.detach(), k.detach(), v.detach(), cfg.window, scale),
               lambda: window_backward(d_w, q.detach(), k.detach(), v.detach(), o_win, lse_w, cfg.window, scale))
    else:
        o_win = p.win.fn(q, k, v, layout, cfg, scale)
        win = (lambda: p.win.fn(q, k, v, layout, cfg, scale), (q, k, v))
    combine = p.combine.fn or combine_torch
    steps = {
        "compress": (lambda: compress_kv(k, v, layout, cfg), (k, v)),
        "cmp": (lambda: p.cmp.fn(q, k_cmp, v_cmp, layout, cfg, scale)[0], (q, k_cmp, v_cmp)),
        "topn": (lambda: p.topn.fn(q, k_cmp, lse, layout, cfg, scale), None),
        "sel": (lambda: p.sel.fn(q, k, v, idx, layout, cfg, scale), (q, k, v)),
        "win": win,
        "combine": (lambda: combine(gates, o_cmp, o_sel, o_win), (gates, o_cmp, o_sel, o_win)),
    }
    providers = {}
    if p.dense_core:  # ... and the selection forward with the gate combine in its epilogue (forward only)
        from nsa.kernels.triton.combine import Segments
        from nsa.kernels.triton.selection import sel_forward

        ss = layout.seq_start_i32
        fused = (gates.detach(), Segments.whole(o_cmp.detach()), o_win.detach())
        steps["sel+combine"] = (lambda: sel_forward(q.detach(), k.detach(), v.detach(), idx, ss, cfg.block_sel, scale,
                                                    combine=fused), None)
        providers["sel+combine"] = "triton"
    models = step_models(cfg, T, B, Hq, Hkv, Dk, Dv, idx)
    models["sel+combine"] = tuple(a + b for a, b in zip(models["sel"], models["combine"]))
    rows = []
    for name, (fn, wrt) in steps.items():
        with torch.no_grad():
            f = time_fn(fn, iters, warmup, device)["median_ms"]
        bwd = None
        if callable(wrt):  # a backward of its own
            bwd = time_fn(wrt, iters, warmup, device)["median_ms"]
        elif wrt is not None:
            out = fn()
            out = out[0] if isinstance(out, tuple) else out
            go = torch.randn_like(out)
            wrt = [x for x in wrt if x.requires_grad]
            bwd = time_fn(lambda o=out, go=go, wrt=wrt: torch.autograd.grad(o, wrt, go, retain_graph=True,
                                                                            allow_unused=True), iters,
                          warmup, device)["median_ms"]
            del out
        flops, nbytes = models[name]
        prov = providers.get(name) or (getattr(p, name).provider if name in p.steps else "torch")
        rows.append({"T": T, "shape": shape_name, "step": name, "fwd_ms": round(f, 4),
                     "bwd_ms": None if bwd is None else round(bwd, 4), "gflop_fwd": round(flops / 1e9, 2),
                     "gbytes_fwd": round(nbytes / 1e9, 3), "fwd_tflops": round(flops / f / 1e9, 1),
                     "fwd_tbps": round(nbytes / f / 1e9, 3),
                     "bwd_tflops": None if not bwd else round(2.5 * flops / bwd / 1e9, 1), "provider": prov})
    return rows, p.describe()


def fla_peer():
    try:
        from fla.ops.nsa import parallel_nsa  # noqa: F401
    except Exception as e:  # noqa: BLE001 - optional peer: any import failure means "not installed here"
        return None, f"fla not available: {type(e).__name__}: {e}"
    return parallel_nsa, "fla.ops.nsa.parallel_nsa"


def fmt(x, nd=2):
    return "-" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001 - the plot is optional
        print(f"no plot: {e}")
        return None
    fig, ax = plt.subplots(figsize=(7, 5))
    for shape in sorted({r["shape"] for r in rows}):
        rs = [r for r in rows if r["shape"] == shape and r["impl"] == "nsa" and r["input"] == "dense"
              and r["dtype"] in ("bf16", "fp32") and r.get("fwd_ms")]
        if not rs:
            continue
        Ts = [r["T"] for r in rs]
        for key, style, label in (("fwd_ms", "o-", "NSA fwd"), ("fwdbwd_ms", "s-", "NSA fwd+bwd"),
                                  ("dense_fa2_fwd_ms", "o--", "dense FA-2 fwd"),
                                  ("dense_fa2_fwdbwd_ms", "s--", "dense FA-2 fwd+bwd")):
            ys = [r.get(key) for r in rs]
            if any(y is not None for y in ys):
                ax.plot(Ts, [y if y is not None else float("nan") for y in ys], style, label=f"{label} ({shape})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("T (tokens)")
    ax.set_ylabel("ms")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def config_overrides(cfg: NSAConfig, text: str) -> NSAConfig:
    """cfg with the integer fields of "field=int,..." replaced; a clear error for an unknown field, a value
    that is no integer, or a combination NSAConfig rejects."""
    known = [f.name for f in dataclasses.fields(NSAConfig) if f.type in (int, "int")]
    changes = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, eq, val = item.partition("=")
        if key not in known or not eq:
            raise SystemExit(f"--config: {item!r} is not FIELD=INT with FIELD one of {', '.join(known)}")
        try:
            changes[key] = int(val)
        except ValueError:
            raise SystemExit(f"--config: {key} takes an integer, got {val!r}") from None
    try:
        return dataclasses.replace(cfg, **changes)
    except ValueError as e:
        raise SystemExit(f"--config {text}: {e}") from None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--T", default="1024,2048,4096,8192,16384,32768,65536,131072")
    ap.add_argument("--shapes", default="D128,Dk192Dv128")
    ap.add_argument("--packed", action="store_true", help="also a packed batch of 16 sequences of 4096")
    ap.add_argument("--one-seq-packed", action="store_true", help="also each T as cu_seqlens=[0, T]")
    ap.add_argument("--ragged", action="store_true", help="also 16 packed sequences of 3072 and 5120 in turn")
    ap.add_argument("--dtypes", default="bf16", help="comma-separated: bf16, fp16")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--breakdown-T", type=int, default=None, help="T of the per-step breakdown (0: none)")
    ap.add_argument("--no-cudnn", action="store_true")
    ap.add_argument("--max-seconds", type=float, default=400.0, help="stop starting new points after this")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run of every code path (CI)")
    ap.add_argument("--compile", action="store_true",
                    help="also time nsa_attention under torch.compile(fullgraph=True) (an nsa_compiled row)")
    ap.add_argument("--config", default="", metavar="FIELD=INT,...",
                    help="NSAConfig fields to change from the paper's (or the smoke's), e.g. n_sel=13,window=192")
    args = ap.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if device.type != "cuda" and not args.smoke:
        raise SystemExit("bench_nsa needs a CUDA GPU (or --smoke for a tiny CPU run)")
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    bad = [x for x in args.dtypes.split(",") if x not in dtypes]
    if bad:
        raise SystemExit(f"--dtypes takes {', '.join(dtypes)}, got {', '.join(bad)}")
    run_dtypes = [x for x in dtypes if x in args.dtypes.split(",")] if device.type == "cuda" else ["fp32"]
    dtypes["fp32"] = torch.float32
    shapes = SMOKE_SHAPES if args.smoke else {s: SHAPES[s] for s in args.shapes.split(",")}
    Ts = [64, 200] if args.smoke else [int(x) for x in args.T.split(",")]
    iters, warmup = (1, 0) if args.smoke else (args.iters, args.warmup)
    cfg = NSAConfig() if not args.smoke else NSAConfig(block_cmp=8, stride_cmp=4, block_sel=8, n_sel=4, window=16)
    cfg = config_overrides(cfg, args.config)
    if args.config:
        print(f"config: {cfg}", flush=True)
    bT = max(Ts) if args.breakdown_T is None else args.breakdown_T
    # (shape, dtype, T, sequences, input): "dense", "packed" (cu_seqlens of n_seq equal sequences) or
    # "cu_one" (cu_seqlens=[0, T])
    cases = [(s, dt, T, 1, "dense") for s in shapes for dt in run_dtypes for T in Ts]
    if args.one_seq_packed:
        cases += [(s, dt, T, 1, "cu_one") for s in shapes for dt in run_dtypes for T in Ts]
    if args.packed:
        cases += [(s, dt, 4096 * 16 if not args.smoke else 128, 16, "packed") for s in shapes for dt in run_dtypes]
    if args.ragged:
        cases += [(s, dt, 4096 * 16 if not args.smoke else 128, 16, "ragged") for s in shapes for dt in run_dtypes]
    fla_fn, fla_why = fla_peer()
    deadline = time.monotonic() + args.max_seconds
    meta = env_metadata(device)
    limits = hw_limits(meta.get("device_name") or "")
    rows, brows, plans = [], [], {}
    for shape, dt, T, n_seq, kind in cases:
        Hq, Hkv, Dk, Dv = shapes[shape]
        dtype = dtypes[dt]
        base = {"T": T, "B": 1, "n_seq": n_seq, "input": kind, "dtype": dt, "Hq": Hq, "Hkv": Hkv, "Dk": Dk, "Dv": Dv,
                "shape": shape}
        if time.monotonic() > deadline:
            rows.append({**base, "impl": "nsa", "status": "skipped: time budget"})
            continue
        q, k, v, gates = make_inputs(1, T, Hq, Hkv, Dk, Dv, dtype, device)
        cu = None
        if kind in ("packed", "cu_one"):
            cu = torch.arange(0, T + 1, T // n_seq, dtype=torch.int32, device=device)
        elif kind == "ragged":  # L/4 shorter and longer in turn: one length would run as a dense batch
            L = T // n_seq
            lengths = [L - L // 4 if i % 2 else L + L // 4 for i in range(n_seq)]
            cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)

        def nsa_fwd(q, k, v, gates, cu=cu):
            return nsa_attention(q, k, v, gates, cfg, cu_seqlens=cu)

        row = {**base, "impl": "nsa", "status": "ok"}
        try:
            telemetry.reset()
            f, b, fb = timed_fwd_bwd(nsa_fwd, (q, k, v, gates), iters, warmup, device)
            served = {r["branch"]: r["backend"] for r in telemetry.snapshot()["counts"]}
            row["plan"] = " ".join(f"{s}={served.get(s, '-')}" for s in ("cmp", "topn", "sel", "win", "combine"))
            events = {e["event"] for e in telemetry.snapshot()["events"]}
            marks = ("as_batch", "dense_core", "fold_view", "fold_copy", "window_forward")
            row["plan"] += "".join(f" {e}" for e in marks if e in events)
            row.update(fwd_ms=f["median_ms"], fwd_min_ms=f["min_ms"], fwd_max_ms=f["max_ms"], bwd_ms=b["median_ms"],
                       bwd_min_ms=b["min_ms"], bwd_max_ms=b["max_ms"], fwdbwd_ms=fb["median_ms"])
            row["peak_mib"] = peak_fwdbwd(nsa_fwd, (q, k, v, gates), device)
            flops = sum(m[0] for key, m in step_models(cfg, T // n_seq, n_seq, Hq, Hkv, Dk, Dv).items()
                        if key not in ("dense",))
            row["fwd_tflops"] = round(flops / row["fwd_ms"] / 1e9, 1)
        except torch.cuda.OutOfMemoryError as e:
            row["status"] = f"oom: {str(e).splitlines()[0][:120]}"
        torch.cuda.empty_cache() if device.type == "cuda" else None
        if args.compile:
            rows.append(compiled_row(nsa_fwd, (q, k, v, gates), row, iters, warmup, device))
        if device.type == "cuda" and kind != "ragged":  # ragged: no dense form of the same work
            for name, key in (("flash", "dense_fa2"), ("cudnn", "cudnn")):
                if name == "cudnn" and args.no_cudnn:
                    continue
                fn = dense_sdpa(name, Dk, Dv, Hq, Hkv)
                for repeat in (False, True):
                    try:
                        dq = q.view(n_seq, T // n_seq, Hq, Dk) if n_seq > 1 else q
                        dk_ = k.view(n_seq, T // n_seq, Hkv, Dk) if n_seq > 1 else k
                        dv_ = v.view(n_seq, T // n_seq, Hkv, Dv) if n_seq > 1 else v

                        def run(q_, k_, v_, g_, fn=fn, repeat=repeat):
                            return fn(q_, k_, v_, g_, repeat=repeat)

                        df, db, dfb = timed_fwd_bwd(run, (dq, dk_, dv_, gates), iters, warmup, device)
                        row[f"{key}_fwd_ms"], row[f"{key}_bwd_ms"] = df["median_ms"], db["median_ms"]
                        row[f"{key}_fwdbwd_ms"] = dfb["median_ms"]
                        if name == "flash":
                            row["dense_peak_mib"] = peak_fwdbwd(run, (dq, dk_, dv_, gates), device)
                        row[f"{key}_impl"] = "repeat_kv" if repeat else "enable_gqa"
                        break
                    except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
                        row[f"{key}_error"] = str(e).splitlines()[0][:160]
                torch.cuda.empty_cache()
        for ref, suffix in (("dense_fa2", ""), ("cudnn", "_vs_cudnn")):
            for m in ("fwd", "bwd", "fwdbwd"):
                if suffix and m == "fwdbwd":
                    continue
                a, b_ = row.get(f"{ref}_{m}_ms"), row.get(f"{m}_ms")
                if a and b_:
                    row[f"speedup_{m}{suffix}"] = round(a / b_, 3)
        rows.append(row)
        print(f"{shape:11} {dt} T={T:7} seqs={n_seq:2} {kind:6} nsa fwd {fmt(row.get('fwd_ms'))} "
              f"bwd {fmt(row.get('bwd_ms'))} "
              f"| FA-2 fwd {fmt(row.get('dense_fa2_fwd_ms'))} bwd {fmt(row.get('dense_fa2_bwd_ms'))} "
              f"| cuDNN fwd {fmt(row.get('cudnn_fwd_ms'))} bwd {fmt(row.get('cudnn_bwd_ms'))} "
              f"| x{fmt(row.get('speedup_fwd'))} / x{fmt(row.get('speedup_bwd'))} / x{fmt(row.get('speedup_fwdbwd'))} "
              f"| peak {fmt(row.get('peak_mib'), 0)} vs {fmt(row.get('dense_peak_mib'), 0)} MiB "
              f"| {row.get('plan', '')} {row['status']}", flush=True)
        if fla_fn is not None and kind == "dense":
            rows.append({**base, "impl": "fla_parallel_nsa", "status": "not run: peer timing not wired for this "
                         "fla version (block = stride = 64 variant)"})
        if kind == "dense" and dt == run_dtypes[0] and T == bT and bT:
            b_rows, plans[f"{shape}-{T}"] = breakdown(cfg, q, k, v, gates, iters, warmup, device, shape)
            brows += b_rows
            for r in b_rows:
                print(f"    {r['step']:9} fwd {r['fwd_ms']:9.3f} ms  bwd {fmt(r['bwd_ms'], 3):>9} ms  "
                      f"{r['fwd_tflops']:7.1f} TF/s  {r['fwd_tbps']:6.2f} TB/s  ({r['provider']})", flush=True)
        del q, k, v, gates
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "bench_nsa.csv", rows, COLUMNS + ["shape", "compile_s", "dense_fa2_fwdbwd_ms", "cudnn_fwdbwd_ms",
                                                       "dense_fa2_impl", "cudnn_impl", "dense_fa2_error",
                                                       "cudnn_error"])
    write_csv(out / "bench_nsa_breakdown.csv", brows, BREAKDOWN_COLUMNS)
    write_json(out / "bench_nsa.json", {"env": meta, "limits": limits, "args": vars(args), "config": vars(cfg),
                                        "fla": fla_why, "plans": plans, "rows": rows, "breakdown": brows})
    with contextlib.suppress(Exception):
        plot(rows, out / "bench_nsa.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
