"""Launch sweep of the Triton decode step: per variant of nsa.kernels.triton.decode.Tuning, the CUDA-graph
replay time of one step, each kernel's GPU time and where each launch starts and ends within the step, paper
heads, bf16, on a filled cache.

    PYTHONPATH=. python bench/tune_decode.py --cells 65536x8,8192x8,65536x1 --csv decode_tune.csv
    PYTHONPATH=. python bench/tune_decode.py --variants "base:;w8:warps_cmp=8;dv32:dv_tile=32"

A variant is `name:field=value,...` (fields of Tuning; integers, or true/false; programs_per_sm=N and
cmp_per_sm=N set target_programs and target_cmp to N programs per SM of the GPU). Every variant's output and
blocks are compared with the first variant's on the same state (max relative error, equal index rows), so a
faster variant that computes something else shows up at once. Without --variants: the default launch, then one
change at a time. Prints a table per cell and writes a CSV (JSON sidecar with the environment).

The timeline (`<kernel>_start_us`, `<kernel>_end_us`, `step_span_us`: medians over eager steps queued while the
GPU sleeps, so the launches wait on the GPU, not on the host) shows what the kernel times cannot: how much of
each launch overlaps the one before it under programmatic dependent launch, and which launch the step waits on.
The same columns prefixed `graph_` come from CUDA-graph replays of the step (the figure of merit): a graph can
order launches otherwise than eager launches do, e.g. where a step's launches run in more than one stream.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from bench_decode import fill_cache, step_inputs, time_batches  # noqa: E402

from nsa import NSACache, NSAConfig, nsa_decode  # noqa: E402
from nsa.benchutil import console, env_metadata, sidecar_path, write_csv, write_json  # noqa: E402
from nsa.kernels.triton import decode as kd  # noqa: E402

DEFAULT_VARIANTS = (
    "base:", "sel_w1:warps_sel=1", "sel_w2:warps_sel=2", "sel_w8:warps_sel=8", "score_w8:warps_score=8",
    "cj32:chunk_j=32", "cj128:chunk_j=128", "cj128_w8:chunk_j=128,warps_score=8", "comb_w2:warps_combine=2",
    "comb_w8:warps_combine=8", "pc16:part_chunk=16", "dv16:dv_tile=16", "p2:programs_per_sm=2",
    "p8:programs_per_sm=8", "st3:stages_cmp=3", "bn32:block_n=32,stages_cmp=3", "cmp_w8:warps_cmp=8",
    "c2:cmp_per_sm=2", "c4:cmp_per_sm=4", "align16:cmp_align=16", "win_in_cmp:window_with_sel=false",
    "early:early_combine=true", "late:early_combine=false",
)
SHORT = {"_append": "append", "_cmp_win": "cmp_win", "_score": "score", "_sel_": "sel", "_combine": "combine"}


def parse_variant(text: str, sms: int) -> tuple[str, kd.Tuning]:
    name, _, body = text.partition(":")
    fields = {f.name: f for f in dataclasses.fields(kd.Tuning)}
    kw = {}
    for item in filter(None, body.split(",")):
        key, _, val = item.partition("=")
        if key in ("programs_per_sm", "cmp_per_sm"):  # per SM of this GPU
            kw["target_programs" if key == "programs_per_sm" else "target_cmp"] = int(val) * sms
            continue
        if key not in fields:
            raise SystemExit(f"--variants: unknown Tuning field {key!r} (known: {', '.join(fields)})")
        kw[key] = val.lower() == "true" if val.lower() in ("true", "false") else int(val)
    return name or "unnamed", kd.Tuning(**kw)


TIMELINE_COLUMNS = (*(f"{k}_{e}_us" for k in SHORT.values() for e in ("start", "end")), "step_span_us")
# The timeline columns again with the prefix graph_: the same from CUDA-graph replays of the step.


def short_name(kernel: str) -> str:
    return next((v for k, v in SHORT.items() if k in kernel), "other")


def kernel_times(step, steps: int) -> dict[str, float]:
    """GPU us per step of each decode kernel (torch.profiler over `steps` eager steps)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    times = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            times[short_name(e.name)] += getattr(e, "device_time_total", 0.0) or e.cuda_time_total
    return {k: v / steps for k, v in times.items()}


def step_timeline(events) -> dict[str, float]:
    """Median start and end (us) of each kernel relative to its step's first kernel, and the step's span.

    events: (start, end, short name) of the GPU kernels of consecutive steps, in any order; a step begins at each
    `append` (the step's first launch). A name that occurs twice in a step keeps its first occurrence."""
    steps: list[dict[str, tuple[float, float]]] = []
    for start, end, name in sorted(events):
        if name == "append" or not steps:
            steps.append({})
        steps[-1].setdefault(name, (start, end))
    rel = []  # each step's kernels relative to the start of its first kernel
    for s in steps:
        t0 = min(a for a, _ in s.values())
        rel.append({n: (a - t0, b - t0) for n, (a, b) in s.items()})
    out: dict[str, float] = {}
    for name in sorted({n for s in rel for n in s}):
        out[f"{name}_start_us"] = statistics.median(s[name][0] for s in rel if name in s)
        out[f"{name}_end_us"] = statistics.median(s[name][1] for s in rel if name in s)
    out["step_span_us"] = statistics.median(max(b for _, b in s.values()) for s in rel) if rel else 0.0
    return out


def kernel_timeline(step, steps: int) -> dict[str, float]:
    """step_timeline of `steps` calls of step (eager steps, or replays of a step's CUDA graph), queued behind a
    GPU sleep so that each launch waits on the GPU, not on the host."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        torch.cuda._sleep(50_000_000)  # tens of ms: longer than queueing the steps takes the host
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return step_timeline((e.time_range.start, e.time_range.end, short_name(e.name)) for e in prof.events()
                         if e.device_type == torch.autograd.DeviceType.CUDA and "sleep" not in e.name.lower())


def format_timeline(tl: dict[str, float]) -> str:
    parts = [f"{k} {tl[k + '_start_us']:.1f}-{tl[k + '_end_us']:.1f}" for k in SHORT.values() if k + "_start_us" in tl]
    return "timeline (us) " + " ".join(parts) + f" | step {tl.get('step_span_us', 0.0):.1f}"


def replay_us(step, restore, inner: int, repeats: int) -> tuple[float, float, float, torch.cuda.CUDAGraph]:
    """(median, min, max) us per CUDA-graph replay of one step, timed as bench_decode times its steps, and the
    graph."""
    restore()
    graph = torch.cuda.CUDAGraph()
    step()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        step()
    times = [ms * 1e3 for ms in time_batches(graph.replay, restore, torch.device("cuda"), inner, repeats,
                                             warmup=0, warm_seconds=0.0)]
    return statistics.median(times), min(times), max(times), graph


def tune_cell(S: int, B: int, variants, args, dev, cfg, dtype) -> list[dict]:
    """Every variant on one filled cache (paper heads): replay time, kernel times, agreement with the first."""
    Hq, Hkv, D = 64, 4, 128
    gen = torch.Generator(device=dev).manual_seed(0)
    cache = NSACache(cfg, B, S + args.room, Hkv, D, D, device=dev, dtype=dtype)
    fill_cache(cache, [S] * B, gen, 8192)
    q, k, v, g = step_inputs(gen, B, Hq, Hkv, D, D, dev, dtype)
    seq0, host0 = cache.cache_seqlens.clone(), cache.host_state()
    # A step overwrites the ring slots it appends to (window, raw compression ring); timed batches run many
    # steps, so the rings are put back too: every variant then computes the step at S on the same state.
    rings = {name: getattr(cache, name).clone() for name in ("k_win", "v_win", "k_raw_cmp", "v_raw_cmp")}
    out = torch.empty(B, 1, Hq, D, device=dev, dtype=dtype)

    def restore():
        cache.cache_seqlens.copy_(seq0)
        cache.set_host_state(host0)
        for name, saved in rings.items():
            getattr(cache, name).copy_(saved)

    def step():
        return nsa_decode(q, k, v, g, cache, backend="triton", out=out)

    rows, ref = [], None
    for name, tuning in variants:
        kd.TUNING = tuning
        with torch.no_grad():
            restore()
            o, idx = nsa_decode(q, k, v, g, cache, backend="triton", return_indices=True)
            if ref is None:
                ref = (o.float().clone(), idx.clone())
            err = float((o.float() - ref[0]).abs().max() / ref[0].abs().max().clamp_min(1e-30))
            same = float((idx == ref[1]).all(-1).float().mean())
            med, lo, hi, graph = replay_us(step, restore, args.inner, args.repeats)
            restore()
            # the replays' own timeline (module doc)
            gtl = kernel_timeline(graph.replay, args.steps)
            del graph
            restore()
            kt = kernel_times(step, args.steps)
            restore()
            tl = kernel_timeline(step, args.steps)
            restore()
        rows.append({"S": S, "B": B, "variant": name, "step_us": med, "step_min_us": lo, "step_max_us": hi,
                     **{f"{k}_us": kt.get(k, 0.0) for k in (*SHORT.values(), "other")},
                     **{c: tl.get(c, float("nan")) for c in TIMELINE_COLUMNS},
                     **{f"graph_{c}": gtl.get(c, float("nan")) for c in TIMELINE_COLUMNS},
                     "rel_err_vs_first": err, "idx_agree_vs_first": same,
                     "splits": kd.workspace_for(cache, Hq).describe(), "tuning": str(dataclasses.asdict(tuning))})
        console().print(f"S={S} B={B} {name:10s} step {med:7.1f} us [{lo:.1f}, {hi:.1f}]  " + " ".join(
            f"{k} {kt.get(k, 0.0):5.1f}" for k in SHORT.values()) + f"  err {err:.1e} idx {same:.3f}")
        console().print("    " + format_timeline(tl))
        console().print("    graph " + format_timeline(gtl))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cells", default="65536x8,8192x8,65536x1", help="SxB,... (paper heads)")
    ap.add_argument("--variants", default=";".join(DEFAULT_VARIANTS), help="name:field=value,...;...")
    ap.add_argument("--inner", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--steps", type=int, default=10, help="eager steps profiled per variant")
    ap.add_argument("--room", type=int, default=94, help="cache capacity = S + room (room > inner + steps)")
    ap.add_argument("--csv", default="decode_tune.csv")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("tune_decode.py needs a CUDA device")
    dev, cfg, dtype = torch.device("cuda"), NSAConfig(), torch.bfloat16
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    variants = [parse_variant(v, sms) for v in args.variants.split(";") if v.strip()]
    rows = []
    saved = kd.TUNING
    try:
        for cell in args.cells.split(","):
            S, B = (int(x) for x in cell.split("x"))
            rows += tune_cell(S, B, variants, args, dev, cfg, dtype)
            torch.cuda.empty_cache()
    finally:
        kd.TUNING = saved
    write_csv(args.csv, rows)
    # the CSV's name only: the sidecar travels with the results, not the machine's paths
    write_json(sidecar_path(args.csv), {"env": env_metadata(dev), "args": {**vars(args), "csv": Path(args.csv).name},
                                        "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
