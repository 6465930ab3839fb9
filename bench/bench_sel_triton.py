"""Selection branch: the Triton kernel's forward and backward against dense causal FA-2, in one process.

    python3 bench/bench_sel_triton.py [--out DIR] [--T 4096,...] [--G 1,4,16,32] [--D 64,128,192/128,256]
                                      [--indices topn,random] [--max-seconds 150]
    python3 bench/bench_sel_triton.py --smoke --out DIR      # tiny, CPU (Triton interpreter): CI's check

Per point (T, G, Dk/Dv, indices), bf16, B=1, Hq=64, Hkv=Hq/G, l'=64, n=16: the kernel's forward (no
autograd) and backward (torch.autograd.grad of a random output gradient, the reverse index included), and
dense causal FA-2 (scaled_dot_product_attention with the flash backend, enable_gqa, v padded to Dk when
Dv != Dk) forward and backward. Times from triton.testing.do_bench (L2 flushed between calls): median,
min, max. The paper shape (G=16, D=128, top-n indices) runs first over every T, then the rest, until
--max-seconds. Indices: "topn" = the top-n step on random scores (forced first and local blocks plus the
best-scoring others: what training sees); "random" = n random distinct visible blocks, nothing forced.

Bytes and FLOPs (counted from the indices, per (token, KV head) and its visible selected tokens):
- kv_bytes_gathered: K and V rows the forward loads (each visible selected token once per token and KV
  head); fwd_tbps = that / fwd time (traffic through L2). bwd_tbps = (the dq pass's K/V + the dk/dv
  pass's q and dO rows, G per selecting query and block) / bwd time.
- kv_bytes_unique: distinct K/V rows any query sees; fwd_hbm_tbps = (unique K/V + q + o) / fwd time, a
  lower bound of the DRAM traffic.
- FLOPs (FlashAttention's convention): forward 2*G*tokens*(Dk + Dv), backward 2*G*tokens*(3*Dk + 2*Dv);
  dense the same over the T*(T+1)/2 causal pairs.
Writes bench_sel_triton.csv and .json (environment metadata, arguments) to --out.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nsa import NSAConfig  # noqa: E402
from nsa.benchutil import env_metadata, time_fn, write_csv, write_json  # noqa: E402
from nsa.branches.selected.naive import top_n_blocks  # noqa: E402

COLUMNS = ["T", "G", "Hq", "Hkv", "Dk", "Dv", "dtype", "block_sel", "n_sel", "indices", "fwd_ms", "fwd_min_ms",
           "fwd_max_ms", "bwd_ms", "bwd_min_ms", "bwd_max_ms", "dense_fa2_fwd_ms", "dense_fa2_bwd_ms", "dense_impl",
           "speedup_fwd", "speedup_bwd", "speedup_fwd_bwd", "kv_bytes_unique", "kv_bytes_gathered", "fwd_tbps",
           "bwd_tbps", "fwd_hbm_tbps", "fwd_tflops", "bwd_tflops", "dense_fwd_tflops", "dense_bwd_tflops",
           "status"]
SMOKE = dict(T="40", G="2", D="24/8", Hq=2, block_sel=8, n_sel=3, rep_ms=1)  # fp32, CPU interpreter


def parse_dims(text):
    """'64,192/128' -> [(64, 64), (192, 128)]."""
    out = []
    for part in text.split(","):
        dk, _, dv = part.partition("/")
        out.append((int(dk), int(dv or dk)))
    return out


def make_indices(kind, T, Hkv, cfg, device, chunk=8192):
    """[1, T, Hkv, n] int32: 'topn' = top-n of random scores (forced blocks included); 'random' = n random
    distinct visible blocks (no forced ones)."""
    if kind not in ("topn", "random"):
        raise SystemExit(f"--indices: unknown kind {kind!r} (topn, random)")
    pick = cfg if kind == "topn" else cfg.with_(n_init=0, n_local=0)
    out = torch.empty(1, T, Hkv, cfg.n_sel, dtype=torch.int32, device=device)
    J = cfg.n_sel_blocks(T)
    g = torch.Generator(device=device)
    g.manual_seed(0)
    for c0 in range(0, T, chunk):
        c1 = min(T, c0 + chunk)
        pos = torch.arange(c0, c1, device=device)[None]
        scores = torch.rand(1, c1 - c0, Hkv, J, device=device, generator=g)
        out[:, c0:c1] = top_n_blocks(scores, pos, pick).to(torch.int32)
    return out


def traffic(idx, ls):
    """(visible selected tokens summed over (token, KV head), (query, block) pairs, distinct K/V rows seen)."""
    _, T, H, n = idx.shape
    pos = torch.arange(T, device=idx.device)[None, :, None, None]
    j = idx.long()
    seen = torch.where(j >= 0, torch.clamp(pos - j * ls + 1, min=0, max=ls), torch.zeros_like(j))
    pairs = int((seen > 0).sum())
    # per (KV head, block): the latest query that selects it decides how much of the block is ever read
    nb = -(-T // ls)
    key = (torch.arange(H, device=idx.device)[None, None, :, None] * nb + j.clamp(min=0)).reshape(-1)
    last = torch.full((H * nb,), -1, dtype=torch.long, device=idx.device)
    val = torch.where(j >= 0, pos.expand_as(j), torch.full_like(j, -1)).reshape(-1)
    last.scatter_reduce_(0, key, val, reduce="amax")
    start = (torch.arange(H * nb, device=idx.device) % nb) * ls
    unique = int(torch.clamp(last - start + 1, min=0, max=ls).sum())
    return int(seen.sum()), pairs, unique


def timer(device, rep_ms):
    """fn -> (median, min, max) ms: triton.testing.do_bench on a GPU, nsa.benchutil.time_fn on CPU."""
    if device.type == "cuda":
        import triton.testing

        def run(fn):
            med, lo, hi = triton.testing.do_bench(fn, warmup=max(1, rep_ms // 4), rep=rep_ms, quantiles=[0.5, 0.0, 1.0])
            return med, lo, hi
    else:
        def run(fn):
            r = time_fn(fn, iters=1, warmup=0, device=device)
            return r["median_ms"], r["min_ms"], r["max_ms"]
    return run


def dense_attention(device):
    """(callable(q, k, v, scale) on [B, H, T, D], impl name): SDPA restricted to the flash backend on a GPU."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = SDPBackend.FLASH_ATTENTION if device.type == "cuda" else SDPBackend.MATH

    def fn(q, k, v, scale):
        with sdpa_kernel([backend]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                                    enable_gqa=True)
    return fn, "sdpa_flash" if device.type == "cuda" else "sdpa_math"


def leaves(B, T, Hq, Hkv, Dk, Dv, dtype, device):
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(B, T, Hq, Dk, device=device, dtype=dtype, generator=gen).requires_grad_()
    k = torch.randn(B, T, Hkv, Dk, device=device, dtype=dtype, generator=gen).requires_grad_()
    v = torch.randn(B, T, Hkv, Dv, device=device, dtype=dtype, generator=gen).requires_grad_()
    return q, k, v


def measure_pair(run, forward, inputs, go):
    """(fwd (med, min, max), bwd (med, min, max)): forward without autograd; backward alone on a saved graph."""
    def fwd():
        with torch.no_grad():
            forward()
    f = run(fwd)
    out = forward()
    b = run(lambda: torch.autograd.grad(out, inputs, go, retain_graph=True))
    return f, b


def dense_point(run, T, G, Hq, Hkv, Dk, Dv, dtype, device, no_dense):
    if no_dense:
        return {}
    dense, impl = dense_attention(device)
    q, k, v = leaves(1, T, Hq, Hkv, Dk, Dk, dtype, device)  # v padded to Dk (the flash kernel wants one D)
    qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
    scale = 1.0 / math.sqrt(Dk)
    go = torch.randn(1, Hq, T, Dk, device=device, dtype=dtype)
    try:
        f, b = measure_pair(run, lambda: dense(qt, kt, vt, scale), (qt, kt, vt), go)
    except torch.OutOfMemoryError as e:
        return {"dense_impl": impl, "dense_status": f"oom: {str(e)[:60]}"}
    pairs = G * Hkv * T * (T + 1) / 2  # causal (query head, key) pairs
    return {"dense_fa2_fwd_ms": f[0], "dense_fa2_bwd_ms": b[0], "dense_impl": impl,
            "dense_fwd_tflops": 2 * pairs * (Dk + Dv) / (f[0] * 1e-3) / 1e12,
            "dense_bwd_tflops": 2 * pairs * (3 * Dk + 2 * Dv) / (b[0] * 1e-3) / 1e12}


def sel_point(run, T, G, Hq, Hkv, Dk, Dv, kind, cfg, dtype, device):
    from nsa.kernels.triton.selection import selected_attention_triton

    ls = cfg.block_sel
    q, k, v = leaves(1, T, Hq, Hkv, Dk, Dv, dtype, device)
    idx = make_indices(kind, T, Hkv, cfg, device)
    ss = torch.zeros(1, T, dtype=torch.int32, device=device)
    go = torch.randn(1, T, Hq, Dv, device=device, dtype=dtype)
    scale = 1.0 / math.sqrt(Dk)
    f, b = measure_pair(run, lambda: selected_attention_triton(q, k, v, idx, ss, cfg, scale), (q, k, v), go)
    tokens, pairs, unique = traffic(idx, ls)
    el = q.element_size()
    gathered = tokens * (Dk + Dv) * el
    bwd_bytes = gathered + pairs * G * (Dk + Dv) * el
    fwd_s, bwd_s = f[0] * 1e-3, b[0] * 1e-3
    return {"fwd_ms": f[0], "fwd_min_ms": f[1], "fwd_max_ms": f[2], "bwd_ms": b[0], "bwd_min_ms": b[1],
            "bwd_max_ms": b[2], "kv_bytes_unique": unique * (Dk + Dv) * el, "kv_bytes_gathered": gathered,
            "fwd_tbps": gathered / fwd_s / 1e12, "bwd_tbps": bwd_bytes / bwd_s / 1e12,
            "fwd_hbm_tbps": (unique * (Dk + Dv) + T * Hq * (Dk + Dv)) * el / fwd_s / 1e12,
            "fwd_tflops": 2 * G * tokens * (Dk + Dv) / fwd_s / 1e12,
            "bwd_tflops": 2 * G * tokens * (3 * Dk + 2 * Dv) / bwd_s / 1e12}


def points(args):
    Ts = [int(x) for x in str(args.T).split(",")]
    Gs = [int(x) for x in str(args.G).split(",")]
    dims = parse_dims(str(args.D))
    kinds = str(args.indices).split(",")
    allp = list(itertools.product(Ts, Gs, dims, kinds))
    first = [p for p in allp if p[1] == 16 and p[2] == (128, 128) and p[3] == "topn"]  # the acceptance shape
    return first + sorted((p for p in allp if p not in first), key=lambda p: (p[0], p[3], p[1], p[2]))


def prepare_device(args):
    if not args.smoke:
        if not torch.cuda.is_available():
            raise SystemExit("bench_sel_triton needs a CUDA GPU (or --smoke: tiny, on CPU)")
        return torch.device("cuda")
    # The smoke runs the kernels in Triton's interpreter; it must be chosen before the kernels are defined.
    if not {"nsa.kernels.triton.selection_fwd", "nsa.kernels.triton.selection_bwd"} & set(sys.modules):
        os.environ["TRITON_INTERPRET"] = "1"
    from nsa.kernels.triton import selection_bwd, selection_fwd

    if not all("Interpreted" in type(k).__name__ for k in (selection_fwd._sel_fwd_kernel,
                                                            selection_bwd._sel_bwd_dq_kernel)):
        raise SystemExit("--smoke: the kernels were loaded without TRITON_INTERPRET=1 in this process")
    return torch.device("cpu")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="artifacts/bench_sel_triton", help="output directory")
    ap.add_argument("--T", default="4096,8192,16384,32768,65536,131072")
    ap.add_argument("--G", default="1,4,16,32", help="query heads per KV head (Hkv = Hq / G)")
    ap.add_argument("--D", default="64,128,192/128,256", help="head dims, Dk or Dk/Dv")
    ap.add_argument("--Hq", type=int, default=64)
    ap.add_argument("--indices", default="topn,random")
    ap.add_argument("--block-sel", type=int, default=64)
    ap.add_argument("--n-sel", type=int, default=16)
    ap.add_argument("--rep-ms", type=int, default=100, help="do_bench's repetition time per measurement")
    ap.add_argument("--no-dense", action="store_true")
    ap.add_argument("--max-seconds", type=float, default=150.0, help="start no new point after this")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run under Triton's interpreter (CI)")
    args = ap.parse_args(argv)
    dtype = torch.bfloat16
    if args.smoke:
        vars(args).update(SMOKE)
        dtype = torch.float32
    device = prepare_device(args)
    cfg = NSAConfig(block_cmp=args.block_sel // 2, stride_cmp=args.block_sel // 4, block_sel=args.block_sel,
                    n_sel=args.n_sel, n_init=1, n_local=2, window=args.block_sel)
    run = timer(device, args.rep_ms)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows, dense_cache, stopped = [], {}, None
    t0 = time.perf_counter()
    for T, G, (Dk, Dv), kind in points(args):
        if time.perf_counter() - t0 > args.max_seconds:
            stopped = f"--max-seconds {args.max_seconds} reached before T={T} G={G} D={Dk}/{Dv} {kind}"
            break
        if args.Hq % G:
            raise SystemExit(f"--G {G} does not divide --Hq {args.Hq}")
        Hq, Hkv = args.Hq, args.Hq // G
        row = {"T": T, "G": G, "Hq": Hq, "Hkv": Hkv, "Dk": Dk, "Dv": Dv, "dtype": str(dtype).replace("torch.", ""),
               "block_sel": cfg.block_sel, "n_sel": cfg.n_sel, "indices": kind, "status": "ok"}
        try:
            row.update(sel_point(run, T, G, Hq, Hkv, Dk, Dv, kind, cfg, dtype, device))
            key = (T, G, Dk, Dv)
            if key not in dense_cache:
                dense_cache[key] = dense_point(run, T, G, Hq, Hkv, Dk, Dv, dtype, device, args.no_dense)
            row.update(dense_cache[key])
        except torch.OutOfMemoryError as e:
            row["status"] = f"oom: {str(e)[:80]}"
        except Exception as e:  # noqa: BLE001 - a failed point is recorded, the sweep goes on
            row["status"] = f"error: {type(e).__name__}: {str(e)[:160]}"
        if row.get("fwd_ms") and row.get("dense_fa2_fwd_ms"):
            row["speedup_fwd"] = row["dense_fa2_fwd_ms"] / row["fwd_ms"]
            row["speedup_bwd"] = row["dense_fa2_bwd_ms"] / row["bwd_ms"]
            dense_ms = row["dense_fa2_fwd_ms"] + row["dense_fa2_bwd_ms"]
            row["speedup_fwd_bwd"] = dense_ms / (row["fwd_ms"] + row["bwd_ms"])
        rows.append(row)
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
        write_csv(out_dir / "bench_sel_triton.csv", rows, columns=COLUMNS)  # after every point: a kill keeps them
        if device.type == "cuda":
            torch.cuda.empty_cache()
    write_csv(out_dir / "bench_sel_triton.csv", rows, columns=COLUMNS)
    write_json(out_dir / "bench_sel_triton.json", {"env": env_metadata(device), "args": vars(args), "rows": rows,
                                                   "stopped": stopped})
    print(f"wrote {out_dir / 'bench_sel_triton.csv'} ({len(rows)} rows){'; ' + stopped if stopped else ''}")
    return 1 if any(r["status"].startswith("error") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
