"""The bench gate's headline figures: a few fixed NSA timings, median over repeats.

    python bench/bench_headline.py --out bench-headline.json [--device cuda] [--full] [--repeats 5]

Figures (bf16 on CUDA, fp32 on CPU; paper block sizes; B=1, Hq=16, Hkv=2, D=128; T = S = 4096, --full 16384):
  prefill_fwd_ms, prefill_fwd_bwd_ms   nsa_attention forward; forward plus backward w.r.t. q, k, v, gates (ms);
                       the forward alone (about 1 ms) is host-bound, so recorded, not gated
  decode_step_ms       one eager nsa_decode step after a prefill of S tokens into an NSACache (ms): bound by the
                       host's launch speed (about 15 us of GPU work), so recorded, not gated (bench/baselines.json
                       policy "informational")
  decode_graph_step_ms CUDA only: the same step captured in a CUDA graph, `GRAPH_ITERS` replays per repeat (ms):
                       the GPU's own time for the step, which the gate compares
  speedup_fwd_bwd_vs_fa2_8k, _64k   CUDA only: dense causal FA-2 forward+backward time (SDPA, flash backend, GQA)
                       over nsa_attention's, both in each repeat; Hq=64, Hkv=4, T=8192 / 65536 (x, higher is better)
  seed_*               CUDA only, the seed runbooks' acceptance figures (bench/baselines.json "acceptance" gives
                       each its fixed limit, on every GPU): seed_block_fwd_s128_ms, the runbook's tiny LlamaBlockNSA
                       (dim 256, 8 heads, 2 KV groups, d 32) forward at S=128 in fp32 (< 1000 ms);
                       seed_prefill_decode_tok_per_s_2k, configs/base.yaml's layer prefilling S=2048 then 200 decode
                       steps (bench/bench_decode.py --config configs/base.yaml --steps 200; > 300 tok/s);
                       seed_fa2_over_sdpa_cmp / _win, the FA-2 provider that serves here over the SDPA provider on
                       each branch at T=4096, Hq=64, Hkv=4, D=128, bf16 (> 1.2x)
Each figure: `warmup` untimed calls, then `repeats` repeats of `iters` calls timed with a device
synchronization at both ends; a repeat's value is the mean per call, the figure the median of the repeats
(min/max kept). The clock is wall time on CUDA and this process's CPU time on CPU (so a loaded CI machine
does not move CPU figures). `--tiny` shrinks every shape (CPU tests). The gate that compares the figures
with stored baselines is ci/evidence/bench_gate.py.

NSA_TEST_SLOWDOWN=<factor> (test-only) deliberately slows every timed function, so that a test can prove the
gate fails: after each call `slowed()` synchronizes the device, measures the call and spins for (factor - 1)
times that duration, proportional on CPU and GPU alike. Nothing in nsa/ reads it; the JSON records the factor.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

SCHEMA = "nsa-bench-headline/1"
ENV = "NSA_TEST_SLOWDOWN"


def factor(environ=None) -> float:
    """The slowdown factor from NSA_TEST_SLOWDOWN (1.0 when unset); a bad value is an error, not ignored."""
    raw = (os.environ if environ is None else environ).get(ENV, "").strip()
    try:
        value = float(raw or 1)
    except ValueError:
        value = float("nan")
    if not value >= 1.0:
        raise ValueError(f"{ENV} must be a number >= 1, got {raw!r}")
    return value


def slowed(fn: Callable, sync: Callable[[], None] | None = None, environ=None,
           clock: Callable[[], float] = time.perf_counter) -> Callable:
    """fn itself when no slowdown is asked; else a wrapper that makes each call ~factor times longer, as
    measured by `clock` (wall time by default; the CPU headline bench passes time.process_time)."""
    f = factor(environ)
    if f == 1.0:
        return fn

    def wrapper(*args, **kwargs):
        t0 = clock()
        out = fn(*args, **kwargs)
        if sync is not None:
            sync()
        t1 = clock()
        while clock() < t1 + (f - 1.0) * (t1 - t0):
            pass
        return out

    wrapper.__wrapped__, wrapper.slowdown = fn, f
    return wrapper


SHAPES = {
    "quick": dict(B=1, T=4096, Hq=16, Hkv=2, D=128, S=4096),
    "full": dict(B=1, T=16384, Hq=16, Hkv=2, D=128, S=16384),
    "tiny": dict(B=1, T=96, Hq=2, Hkv=1, D=16, S=96),
}


def measure(fn, *, sync, warmup: int, iters: int, repeats: int, clock=time.perf_counter) -> dict:
    """Median over `repeats` of the mean ms per call over `iters` calls (fn already slowed if asked)."""
    for _ in range(warmup):
        fn()
    sync()
    values = []
    for _ in range(repeats):
        sync()
        t0 = clock()
        for _ in range(iters):
            fn()
        sync()
        values.append((clock() - t0) * 1e3 / iters)
    return {"value": statistics.median(values), "min": min(values), "max": max(values), "repeats": values,
            "iters": iters, "warmup": warmup, "unit": "ms", "better": "lower"}


def _inputs(shape, device, dtype, requires_grad=False, seed=0):
    import torch

    g = torch.Generator().manual_seed(seed)
    B, T, Hq, Hkv, D = shape["B"], shape["T"], shape["Hq"], shape["Hkv"], shape["D"]
    qkvg = (torch.randn(B, T, Hq, D, generator=g), torch.randn(B, T, Hkv, D, generator=g),
            torch.randn(B, T, Hkv, D, generator=g), torch.rand(B, T, Hq, 3, generator=g))
    return [x.to(device=device, dtype=dtype).requires_grad_(requires_grad) for x in qkvg]


GRAPH_ITERS = 200  # replays per repeat (a replay is ~17 us on an H100): the synchronizations' cost stays out
GRAPH_WARM_S = 0.3  # replays before the timing: a GPU idle a moment before ramps its clock for ~10 ms, which
# made the first repeats of a fresh machine's first process 3x slower than the rest (0.052 -> 0.020 ms)


def decode_graph_step(shape, cfg, device, dtype, slow, *, sync, warmup: int, repeats: int, clock) -> dict:
    """decode_graph_step_ms: one nsa_decode step recorded in a CUDA graph after a prefill of S tokens, replayed.
    A replay appends one token (the length lives on the device), so each repeat first puts the lengths back:
    every repeat times the same GRAPH_ITERS positions after S, and the cache needs room for those only."""
    import torch

    from nsa import NSACache, nsa_decode, nsa_prefill

    cache = NSACache(cfg, shape["B"], shape["S"] + 8 + GRAPH_ITERS, shape["Hkv"], shape["D"], shape["D"],
                     device=device, dtype=dtype)
    one = _inputs(dict(shape, T=1), device, dtype, seed=2)
    out = torch.empty(shape["B"], 1, shape["Hq"], shape["D"], device=device, dtype=dtype)
    with torch.no_grad():
        nsa_prefill(*_inputs(dict(shape, T=shape["S"]), device, dtype), cache)
        for _ in range(3):  # compiles the kernels outside the capture (lengths of either parity)
            nsa_decode(*one, cache, out=out)
        sync()
        lengths, host = cache.cache_seqlens.clone(), cache.host_state()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            nsa_decode(*one, cache, out=out)
        cache.set_host_state(host)  # the capture advanced the host copy; the device's did not move

    def replays():  # one copy kernel (~2 us) against GRAPH_ITERS replays: under 0.1 % of the figure
        cache.cache_seqlens.copy_(lengths)
        for _ in range(GRAPH_ITERS):
            graph.replay()

    t_end = clock() + GRAPH_WARM_S
    while clock() < t_end:
        replays()
        sync()
    fig = measure(slow(replays), sync=sync, warmup=warmup, iters=1, repeats=repeats, clock=clock)
    per = {k: fig[k] / GRAPH_ITERS for k in ("value", "min", "max")}
    return {**fig, **per, "repeats": [x / GRAPH_ITERS for x in fig["repeats"]], "iters": GRAPH_ITERS,
            "warm_s": GRAPH_WARM_S, "S": shape["S"]}


SPEEDUP_T = (8192, 65536)
SEED_FA2_T = 4096  # the seeds' FA-2 over SDPA figure: a length above the tuned FA-2 thresholds
SPEEDUP_SHAPE = dict(B=1, Hq=64, Hkv=4, D=128)


def speedup_vs_fa2(T: int, device, dtype, cfg, slow, sync, clock, *, warmup: int, repeats: int) -> dict:
    """Median over repeats of dense FA-2 fwd+bwd ms / NSA fwd+bwd ms (NSA slowed by NSA_TEST_SLOWDOWN)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from nsa import nsa_attention

    q, k, v, g = _inputs(dict(SPEEDUP_SHAPE, T=T), device, dtype, requires_grad=True)
    go = torch.randn(q.shape[:3] + (v.shape[-1],), generator=torch.Generator().manual_seed(3)).to(device, dtype)

    def nsa_fwd_bwd():
        torch.autograd.grad(nsa_attention(q, k, v, g, cfg), (q, k, v, g), go)

    def dense_fwd_bwd():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True, enable_gqa=True)
        torch.autograd.grad(o, (q, k, v), go.transpose(1, 2))

    nsa_fn = slow(nsa_fwd_bwd)
    one = dict(sync=sync, warmup=0, iters=1, repeats=1, clock=clock)
    for _ in range(warmup):
        nsa_fn()
        dense_fwd_bwd()
    nsa_ms, dense_ms = zip(*[(measure(nsa_fn, **one)["value"], measure(dense_fwd_bwd, **one)["value"])
                             for _ in range(repeats)])
    ratios = [d / n for n, d in zip(nsa_ms, dense_ms)]
    return {"value": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "repeats": ratios,
            "iters": 1, "warmup": warmup, "unit": "x", "better": "higher", "T": T, **SPEEDUP_SHAPE,
            "nsa_fwd_bwd_ms": statistics.median(nsa_ms), "dense_fa2_fwd_bwd_ms": statistics.median(dense_ms)}


def seed_figures(device, slow, sync, clock, *, repeats: int) -> dict:
    """The seed runbooks' acceptance figures (see the module docstring), CUDA only."""
    import importlib.util

    import torch

    from nsa import NSAConfig, plan, toggles
    from nsa.branches.compressed.fa2 import compressed_fa2
    from nsa.branches.compressed.sdpa import compressed_sdpa
    from nsa.branches.context import CallContext
    from nsa.branches.sliding.fa2 import sliding_fa2
    from nsa.branches.sliding.sdpa import sliding_sdpa
    from nsa.compress import compress_kv
    from nsa.kernels.flash_wrappers import flash_provider
    from nsa.layout import dense_layout
    from nsa.model.llama_block_nsa import LlamaBlockNSA
    from nsa.validation import Shapes

    figs, one = {}, dict(sync=sync, clock=clock)
    torch.manual_seed(0)
    blk = LlamaBlockNSA(dim=256, n_heads=8, n_kv_groups=2, d_k=32, d_v=32).to(device).eval()
    x = torch.randn(1, 128, 256, device=device)

    def block_fwd():
        with torch.inference_mode():
            return blk(x)

    figs["seed_block_fwd_s128_ms"] = measure(slow(block_fwd), warmup=2, iters=3, repeats=repeats, **one)
    spec = importlib.util.spec_from_file_location("bench_decode", Path(__file__).resolve().parent / "bench_decode.py")
    dec = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dec)
    args = dec.parse_args(["--config", str(Path(__file__).resolve().parents[1] / "configs" / "base.yaml")])
    cfg = NSAConfig(block_cmp=args.l, stride_cmp=args.d, block_sel=args.l_sel, n_sel=args.n_sel, window=args.w)
    layer = dec.NSAAttention(args.dim, args.heads, args.groups, args.dk, args.dv, cfg).to(device, torch.bfloat16).eval()
    rates = [dec.run_generation(layer, args.dim, args.B, args.S[0], args.steps, device, torch.bfloat16)["run_tok_per_s"]
             for _ in range(repeats)]
    figs["seed_prefill_decode_tok_per_s_2k"] = {"value": statistics.median(rates), "min": min(rates),
                                                "max": max(rates), "repeats": rates, "iters": 1, "warmup": 1,
                                                "unit": "tok/s", "better": "higher", "S": args.S[0],
                                                "steps": args.steps}
    name = flash_provider(varlen=False)
    if name is None:
        return figs
    T, Hq, Hkv, D = SEED_FA2_T, 64, 4, 128
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, T, h, D, device=device, dtype=torch.bfloat16, generator=g) for h in (Hq, Hkv, Hkv))
    ncfg, tg, scale = NSAConfig(), toggles.read(), D ** -0.5
    layout = dense_layout(1, T, ncfg, torch.device(device))
    kc, vc = compress_kv(k, v, layout, ncfg)
    ctx = CallContext(Shapes(1, T, Hq, Hkv, D, D), q.dtype, torch.device(device), False, kernel_dtype=q.dtype)
    for branch, fa2, sdpa, kv in (("cmp", compressed_fa2, compressed_sdpa, (kc, vc)),
                                  ("win", sliding_fa2, sliding_sdpa, (k, v))):
        with torch.no_grad():
            f = measure(lambda fa2=fa2, kv=kv: fa2(plan.PROVIDERS[name], ctx, tg, q, *kv, layout, ncfg, scale),
                        warmup=2, iters=5, repeats=repeats, **one)
            s_ = measure(lambda sdpa=sdpa, kv=kv: sdpa(tg, q, *kv, layout, ncfg, scale), warmup=2, iters=5,
                         repeats=repeats, **one)
        ratios = [b / a for a, b in zip(f["repeats"], s_["repeats"])]
        figs[f"seed_fa2_over_sdpa_{branch}"] = {"value": statistics.median(ratios), "min": min(ratios),
                                                 "max": max(ratios), "repeats": ratios, "unit": "x",
                                                 "better": "higher", "provider": name, "T": T, "D": D,
                                                 "fa2_ms": f["value"], "sdpa_ms": s_["value"]}
    return figs


def run(device: str = "cuda", size: str = "quick", repeats: int = 5, iters: int | None = None,
        warmup: int | None = None, only: list[str] | None = None) -> dict:
    import torch

    from nsa import NSACache, NSAConfig, nsa_attention, nsa_decode, nsa_prefill

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("bench_headline: --device cuda but torch sees no CUDA GPU")
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    shape = SHAPES[size]
    cfg = NSAConfig() if size != "tiny" else NSAConfig(block_cmp=16, stride_cmp=8, block_sel=16, n_sel=4, window=32)
    iters = iters or (10 if size != "tiny" else 3)
    warmup = warmup if warmup is not None else (3 if size != "tiny" else 1)
    sync = (lambda: torch.cuda.synchronize(device)) if device.startswith("cuda") else (lambda: None)
    clock = time.perf_counter if device.startswith("cuda") else time.process_time
    timed = dict(sync=sync, warmup=warmup, repeats=repeats, clock=clock)

    def slow(fn):
        return slowed(fn, sync, clock=clock)

    figures: dict[str, dict] = {}
    want = set(only or ("prefill_fwd_ms", "prefill_fwd_bwd_ms", "decode_step_ms", "decode_graph_step_ms"))

    if "prefill_fwd_ms" in want:
        q, k, v, g = _inputs(shape, device, dtype)

        def fwd():
            with torch.no_grad():
                return nsa_attention(q, k, v, g, cfg)

        figures["prefill_fwd_ms"] = measure(slow(fwd), iters=iters, **timed)
    if "prefill_fwd_bwd_ms" in want:
        q, k, v, g = _inputs(shape, device, dtype, requires_grad=True)
        grad = torch.randn(shape["B"], shape["T"], shape["Hq"], shape["D"], generator=torch.Generator().manual_seed(1))
        grad = grad.to(device=device, dtype=dtype)

        def fwd_bwd():
            out = nsa_attention(q, k, v, g, cfg)
            torch.autograd.backward(out, grad)
            for x in (q, k, v, g):
                x.grad = None

        figures["prefill_fwd_bwd_ms"] = measure(slow(fwd_bwd), iters=max(1, iters // 2), **timed)
    if "decode_step_ms" in want:
        cache = NSACache(cfg, shape["B"], shape["S"] + warmup + repeats * iters, shape["Hkv"], shape["D"],
                         shape["D"], device=device, dtype=dtype)
        with torch.no_grad():
            nsa_prefill(*_inputs(dict(shape, T=shape["S"]), device, dtype), cache)
        one = _inputs(dict(shape, T=1), device, dtype, seed=2)

        def step():
            with torch.no_grad():
                return nsa_decode(*one, cache)

        figures["decode_step_ms"] = measure(slow(step), iters=iters, **timed)
    if "decode_graph_step_ms" in want and device.startswith("cuda"):
        figures["decode_graph_step_ms"] = decode_graph_step(shape, cfg, device, dtype, slow, **timed)

    if device.startswith("cuda"):
        for T in SPEEDUP_T:
            name = f"speedup_fwd_bwd_vs_fa2_{T // 1024}k"
            if name in want or only is None:
                figures[name] = speedup_vs_fa2(T, device, dtype, NSAConfig(), slow, sync, clock, warmup=1,
                                               repeats=min(repeats, 3))

    if device.startswith("cuda") and (only is None or any(n.startswith("seed_") for n in want)):
        figures.update(seed_figures(device, slow, sync, clock, repeats=min(repeats, 3)))

    return {"schema": SCHEMA, "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "host": socket.gethostname(), "device": device,
            "gpu": torch.cuda.get_device_name(device) if device.startswith("cuda") else None,
            "dtype": str(dtype).replace("torch.", ""), "size": size, "shape": shape,
            "config": {k_: getattr(cfg, k_) for k_ in ("block_cmp", "stride_cmp", "block_sel", "n_sel", "window")},
            "torch": torch.__version__, "python": platform.python_version(), "slowdown": factor(),
            "clock": clock.__name__, "figures": figures}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON output path")
    ap.add_argument("--device", default="cuda")
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--full", action="store_true", help="the long shapes (T = S = 16384)")
    size.add_argument("--tiny", action="store_true", help="tiny shapes (CPU tests)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--only", default=None, help="comma-separated figure names (default: every figure)")
    args = ap.parse_args(argv)
    only = args.only.split(",") if args.only else None
    res = run(args.device, "full" if args.full else "tiny" if args.tiny else "quick", args.repeats, args.iters,
              only=only)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    for name, f in res["figures"].items():
        print(f"summary: {name} = {f['value']:.4f} {f.get('unit', 'ms')} (median of {len(f['repeats'])} repeats, "
              f"min {f['min']:.4f}, max {f['max']:.4f})")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's nsa when it is not installed
    sys.exit(main())
