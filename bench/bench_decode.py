"""Decode bench: per-step NSA decode latency (eager and CUDA-graph replay), K/V bytes read, achieved TB/s,
against dense FA-2 decode (and flash-attn's flash_attn_with_kvcache when installed) in the same process.

Two modes, one CSV format (columns a mode does not measure are left empty).

Layer mode (the default; the seeds' command line):

    PYTHONPATH=. python bench/bench_decode.py --B 1 --dim 256 --heads 8 --groups 2 --dk 32 --dv 32 \\
        --l 32 --d 16 --l_sel 64 --n_sel 16 --w 512 --S_list 512,1024,2048,4096 --iters 64 --warmup 8 \\
        --csv decode.csv --branch_force_mode env

  For each S an NSAAttention layer prefills S tokens into an NSACache (timed once: prefill_ms), then the
  step at position S is timed, the cache's lengths put back before every timed batch of steps:
  step_ms (nsa_decode on precomputed q/k/v/gates), layer_step_ms (the whole layer for one token), and each
  torch branch alone on the same state (cmp_ms, topk_ms = scores + top-n, sel_ms, win_ms; only the one named
  by --branch_force_mode cmp|sel|win, all for env|all; env also records the NSA_* toggles in the metadata).

  With --config FILE (configs/base.yaml: the seeds' small layer) the shapes, S (bench.seq_len) and B come
  from the file, command-line flags still override them. --steps N (default: the file's bench.steps, else
  none) then also runs the prefill of S tokens followed by N decode steps through the layer, as generation
  does: run_tok_per_s = B * (S + N) / (prefill + decode time), decode_tok_per_s = B * N / decode time.
  The seeds' runbook line:

    PYTHONPATH=. python bench/bench_decode.py --config configs/base.yaml --steps 200

Fill mode (--preset paper|small|all, or --sweep, or --smoke):

    python bench/bench_decode.py --sweep --csv decode_sweep.csv          # the GPU sweep (about 3 minutes)
    python bench/bench_decode.py --smoke --csv /tmp/decode_smoke.csv      # tiny, CPU, seconds

  No prefill: the cache is filled with random K/V through NSACache.write (in chunks; the cache compresses
  its own blocks), so S = 128k costs no O(S^2) attention. Presets: paper (Hq=64, Hkv=4, Dk=Dv=128,
  l=32, d=16, l'=64, n=16, w=512) and small (the seeds' layer: Hq=8, Hkv=2, Dk=Dv=32, same blocks). --sweep:
  both presets, S in 4k..128k, B in 1, 8, 32, plus ragged batches (B=8, lengths spread evenly over
  [S/8, S]) at S = 16k and 64k.

  --paged (--page-size N, default 64): every cell also on a paged cache (nsa.PagedNSACache, pages handed
  out in shuffled order, as a serving engine's pool ends up), the row after the contiguous one; its dense
  and fa_kvcache columns stay empty (the contiguous row beside it has them). The serving rows:

    python bench/bench_decode.py --preset paper --S_list 8192,65536,131072 --B_list 1,8,32 --paged \
        --page-size 64 --csv decode_paged.csv

Columns (ms are medians over --repeats batches of --inner back-to-back steps; the device state is put back
between batches, untimed):
  step_eager_ms   one nsa_decode step (backend --backend, default auto) called from Python
  step_graph_ms   the same step captured in a CUDA graph and replayed (CUDA only)
  step_ms         step_graph_ms where measured, else step_eager_ms (the figure of merit)
  step_min_ms, step_max_ms  the fastest and slowest batch of step_ms's measurement (dense_min_ms and
                  dense_max_ms likewise for dense_ms)
  kv_bytes*       K/V bytes the step reads: compressed blocks + selected tokens + window, counted from the
                  cache by nsa_decode(return_stats=True); dense_kv_bytes: all S+1 keys and values
  tbps            kv_bytes / step_ms in TB/s; hbm_tbps: the device's HBM limit (H100 3.35, H200 4.8, from
                  the device name); hbm_frac = tbps / hbm_tbps
  dense_*         dense FA-2 decode: write the token into the cache, then SDPA with the flash backend of the
                  one query over all S+1 keys, GQA natively (no K/V copy; dense_backend says which backend
                  ran); eager and graph; dense_ms = the faster. Ragged rows: SDPA over the longest sequence
                  (what a padded dense batch costs), dense_backend "...+padded"
  read_floor_ms   the fastest the device reads kv_bytes: the faster of one torch.sum and one streaming
                  read kernel (stream_read: 16 KiB tiles, 4 programs per SM, evict-first loads) over a
                  buffer of that many bytes, captured in a CUDA graph and replayed (re-read every replay, as
                  every step re-reads its K/V, so what stays in L2 between calls counts for both alike);
                  CUDA only. floor_frac = read_floor_ms / step_ms; speedup_ceiling = dense_ms /
                  read_floor_ms: the most a step reading these bytes could gain on dense decode, with nothing
                  but its reads. Small reads do not reach the HBM limit: on an H100 the streaming kernel read
                  64 MiB at 2.8 TB/s and 1 GiB at 3.1, torch.sum 2.3 and 3.0 (torch.sum alone overstated the
                  floor of a 64k x 8 step by 4 us)
  speedup_vs_dense = dense_ms / step_ms; fa_kvcache_ms: flash_attn_with_kvcache (ragged natively), when the
                  flash-attn package is installed
  check_rel_err / check_idx_agree  the step's output and blocks against the torch step on the same state
  target_programs / splits  the Triton step's program target and split plan (--tune: the held-to cells again
                  with other targets)
A JSON sidecar (CSV path with .json) holds the environment, the arguments and the rows.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from nsa import NSAAttention, NSACache, NSAConfig, PagedNSACache, nsa_decode, telemetry  # noqa: E402
from nsa.benchutil import (  # noqa: E402
    console,
    device_name,
    env_metadata,
    fmt_bytes,
    parse_dtype,
    print_table,
    resolve_device,
    sidecar_path,
    sync,
    time_fn,
    write_csv,
    write_json,
)
from nsa.branches.compressed.naive import compressed_chunk  # noqa: E402
from nsa.branches.decode.naive import torch_step_view  # noqa: E402
from nsa.branches.selected.naive import selected_chunk, topn_chunk  # noqa: E402
from nsa.branches.sliding.naive import sliding_chunk  # noqa: E402

MODES = ("env", "cmp", "sel", "win", "all")
PRESETS = {
    "paper": dict(heads=64, groups=4, dk=128, dv=128, l=32, d=16, l_sel=64, n_sel=16, w=512),
    "small": dict(heads=8, groups=2, dk=32, dv=32, l=32, d=16, l_sel=64, n_sel=16, w=512),
    "tiny": dict(heads=4, groups=2, dk=16, dv=16, l=8, d=4, l_sel=8, n_sel=4, w=16),  # --smoke
}
SWEEP_S = (4096, 8192, 16384, 32768, 65536, 131072)
SWEEP_B = (1, 8, 32)
RAGGED_S = (16384, 65536)
HBM_TBPS = {"H200": 4.8, "H100": 3.35}
COLUMNS = [
    "preset", "S", "B", "ragged", "dim", "heads", "groups", "dk", "dv", "l", "d", "l_sel", "n_sel", "w",
    "branch_force_mode", "device", "dtype", "backend", "prefill_ms", "step_ms", "step_eager_ms", "step_graph_ms",
    "step_min_ms", "step_max_ms", "layer_step_ms", "tok_per_s", "cmp_ms", "topk_ms", "sel_ms", "win_ms",
    "cmp_blocks", "kv_bytes", "kv_bytes_cmp", "kv_bytes_sel", "kv_bytes_win", "dense_kv_bytes", "kv_bytes_ratio",
    "tbps", "hbm_tbps", "hbm_frac",
    "read_floor_ms", "floor_frac", "speedup_ceiling", "dense_ms", "dense_eager_ms", "dense_graph_ms",
    "dense_min_ms", "dense_max_ms", "dense_backend", "dense_tbps", "dense_tok_per_s",
    "speedup_vs_dense", "fa_kvcache_ms", "speedup_vs_fa_kvcache", "check_rel_err", "check_idx_agree",
    "target_programs", "splits", "run_steps", "run_prefill_ms", "run_decode_ms", "run_tok_per_s",
    "decode_tok_per_s", "run_finite", "cache", "page_size",
]
# --config FILE: (section, key) -> argument. configs/base.yaml has every key.
CONFIG_KEYS = {
    ("model", "dim"): "dim", ("model", "n_heads"): "heads", ("model", "n_kv_groups"): "groups",
    ("model", "d_k"): "dk", ("model", "d_v"): "dv", ("nsa", "block_cmp"): "l", ("nsa", "stride_cmp"): "d",
    ("nsa", "block_sel"): "l_sel", ("nsa", "n_sel"): "n_sel", ("nsa", "window"): "w",
    ("bench", "seq_len"): "S_list", ("bench", "batch_size"): "B", ("bench", "steps"): "steps",
}


def load_config(path: str) -> dict:
    """The argument defaults a --config YAML file sets ({argument: value}); errors name the file and key."""
    try:
        import yaml
    except ModuleNotFoundError:
        raise SystemExit(f"--config {path}: reading YAML needs PyYAML (pip install pyyaml)") from None
    try:
        with open(path) as fh:
            data = yaml.safe_load(fh) or {}
    except OSError as e:
        raise SystemExit(f"--config {path}: {e.strerror}") from None
    if not isinstance(data, dict):
        raise SystemExit(f"--config {path}: expected a mapping of sections (model, nsa, bench)")
    out = {}
    for (section, key), arg in CONFIG_KEYS.items():
        value = (data.get(section) or {}).get(key)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < (0 if arg == "steps" else 1):
            raise SystemExit(f"--config {path}: {section}.{key} must be a positive integer, got {value!r}")
        out[arg] = str(value) if arg == "S_list" else value
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=None, help="YAML file of shapes, S, B and steps (configs/base.yaml); "
                   "flags given on the command line override it")
    p.add_argument("--steps", type=int, default=None, help="layer mode: also run the prefill of S tokens then "
                   "this many decode steps through the layer (default: the config's bench.steps, else none)")
    p.add_argument("--B", type=int, default=1, help="batch (layer mode)")
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
    p.add_argument("--S_list", default=None, help="comma-separated cache lengths (layer mode default "
                   "512,1024,2048,4096; fill mode default the sweep's 4k..128k)")
    p.add_argument("--iters", type=int, default=64, help="layer mode: timed steps per figure")
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--csv", default="decode.csv", help="output CSV (JSON sidecar beside it)")
    p.add_argument("--branch_force_mode", choices=MODES, default="env")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--compress", choices=("avg", "mlp"), default="avg")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", choices=("auto", "torch", "triton"), default="auto", help="decode backend")
    p.add_argument("--preset", choices=("paper", "small", "all"), default=None, help="fill mode with these shapes")
    p.add_argument("--sweep", action="store_true", help="fill mode: both presets, S 4k..128k, B 1/8/32, ragged")
    p.add_argument("--smoke", action="store_true", help="fill mode on CPU, tiny shapes (CI)")
    p.add_argument("--B_list", default=None, help="fill mode batches (default 1,8,32)")
    p.add_argument("--ragged_S", default=None, help="fill mode: S of the ragged rows (B=8; default with --sweep "
                   "16384,65536)")
    p.add_argument("--inner", type=int, default=20, help="back-to-back steps per timed batch")
    p.add_argument("--repeats", type=int, default=5, help="timed batches per figure (median)")
    p.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph timings")
    p.add_argument("--paged", action="store_true", help="fill mode: every cell also on a paged cache")
    p.add_argument("--page-size", type=int, default=64, help="tokens per page of --paged (a power of two)")
    p.add_argument("--no-check", action="store_true", help="skip the comparison with the torch step")
    p.add_argument("--max-seconds", type=float, default=None, help="stop starting new rows after this long")
    p.add_argument("--tune", default=None, help="fill mode, CUDA: also measure the held-to cells with these "
                   "program targets of the Triton step, as multiples of the SM count (default with --sweep: 2,8; "
                   "the step's own default is 4)")
    pre, _ = p.parse_known_args(argv)
    if pre.config:
        p.set_defaults(**load_config(pre.config))
    args = p.parse_args(argv)
    args.fill = bool(args.preset or args.sweep or args.smoke)
    if args.steps is not None and args.steps < 0:
        p.error("--steps must be >= 0")
    if args.steps and args.fill:
        p.error("--steps applies to layer mode (not with --preset, --sweep or --smoke)")
    if args.paged and not args.fill:
        p.error("--paged applies to fill mode (--preset, --sweep or --smoke)")
    if args.page_size < 1 or args.page_size & (args.page_size - 1):
        p.error(f"--page-size must be a power of two, got {args.page_size}")

    def ints(text, name):
        try:
            vals = [int(s) for s in text.split(",") if s.strip()]
        except ValueError:
            p.error(f"--{name} must be comma-separated integers, got {text!r}")
        if not vals or min(vals) < 1:
            p.error(f"--{name} needs positive integers")
        return vals

    if args.smoke:
        args.device = "cpu" if args.device == "auto" else args.device
        args.presets = ["tiny"]
        args.S = ints(args.S_list or "40,70", "S_list")
        args.B_list_ = ints(args.B_list or "1,3", "B_list")
        args.ragged = ints(args.ragged_S or "70", "ragged_S")
        args.inner, args.repeats = min(args.inner, 2), min(args.repeats, 2)
    elif args.fill:
        args.presets = ["paper", "small"] if args.sweep or args.preset == "all" else [args.preset]
        args.S = ints(args.S_list or ",".join(map(str, SWEEP_S)), "S_list")
        args.B_list_ = ints(args.B_list or ",".join(map(str, SWEEP_B)), "B_list")
        args.ragged = ints(args.ragged_S, "ragged_S") if args.ragged_S else (list(RAGGED_S) if args.sweep else [])
    else:
        args.S = ints(args.S_list or "512,1024,2048,4096", "S_list")
    try:
        args.tune_ = [float(x) for x in (args.tune or ("2,8" if args.sweep else "")).split(",") if x.strip()]
    except ValueError:
        p.error(f"--tune must be comma-separated numbers, got {args.tune!r}")
    if args.iters < 1 or args.warmup < 0 or args.inner < 1 or args.repeats < 1:
        p.error("--iters, --inner and --repeats must be >= 1 and --warmup >= 0")
    return args


# --- timing ----------------------------------------------------------------------------------------------


class Ms(float):
    """A median in ms that keeps the fastest and slowest batch it was taken over (min_ms, max_ms)."""

    def __new__(cls, times: list[float]):
        self = super().__new__(cls, statistics.median(times))
        self.min_ms, self.max_ms = min(times), max(times)
        return self


def time_steps(fn, restore, device, inner: int, repeats: int, warmup: int = 2, warm_seconds: float = 0.1) -> Ms:
    """Median ms per call of fn over `repeats` batches of `inner` back-to-back calls (time_batches)."""
    return Ms(time_batches(fn, restore, device, inner, repeats, warmup, warm_seconds))


def put_spread(row: dict, key: str) -> None:
    """row[key + "_min_ms"] / row[key + "_max_ms"] from the Ms in row[key + "_ms"]."""
    ms = row[key + "_ms"]
    row[key + "_min_ms"], row[key + "_max_ms"] = ms.min_ms, ms.max_ms


def time_batches(fn, restore, device, inner: int, repeats: int, warmup: int = 2,
                 warm_seconds: float = 0.1) -> list[float]:
    """Ms per call of fn in each of `repeats` batches of `inner` back-to-back calls (restore() before each
    batch, untimed). Warm-up: `warmup` calls, then more (restoring as timed batches do) until `warm_seconds`
    have passed, so the GPU runs at its working clocks when the timed batches start (a 70 us step timed
    right after a pause measured a few percent slower)."""
    restore()
    for _ in range(warmup):
        fn()
    sync(device)
    t_end = time.perf_counter() + warm_seconds
    while time.perf_counter() < t_end:
        restore()
        for _ in range(inner):
            fn()
        sync(device)
    times = []
    for _ in range(repeats):
        restore()
        sync(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / inner)
        else:
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            times.append((time.perf_counter() - t0) * 1e3 / inner)
    restore()
    return times


def eager_and_graph(fn, restore, device, args, after_capture=None) -> tuple[Ms, Ms | None]:
    """(eager ms, CUDA-graph replay ms or None). after_capture() undoes host state the capture touched."""
    eager = time_steps(fn, restore, device, args.inner, args.repeats)
    if device.type != "cuda" or args.no_graph:
        return eager, None
    restore()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    if after_capture is not None:
        after_capture()
    replay = time_steps(graph.replay, restore, device, args.inner, args.repeats)
    del graph
    return eager, replay


@triton.jit
def stream_read(X, OUT, n, TILE: tl.constexpr, NPROG: tl.constexpr):
    """Sum of X[:n] (one partial per program): each of NPROG programs takes every NPROG-th tile of TILE
    elements, loads marked evict-first (read once). The fastest plain read measured on an H100 (64 MiB to
    1 GiB, against 2-16 KiB tiles, 1-4 programs per SM, 2-4 stages, 4 or 8 warps)."""
    pid = tl.program_id(0)
    acc = tl.zeros([TILE], tl.float32)
    for t in range(pid, tl.cdiv(n, TILE), NPROG):
        offs = t.to(tl.int64) * TILE + tl.arange(0, TILE)
        acc += tl.load(X + offs, mask=offs < n, other=0.0, eviction_policy="evict_first").to(tl.float32)
    tl.store(OUT + pid, tl.sum(acc))


def read_floor_ms(n_bytes: int, device, args) -> float | None:
    """Ms of the fastest read of n_bytes on a CUDA device (the faster of one torch.sum and one stream_read over
    a bf16 buffer of that size, eager or graph replay); None elsewhere."""
    if device.type != "cuda":
        return None
    n = max(1, n_bytes // 2)
    buf = torch.randn(n, device=device, dtype=torch.bfloat16)
    res = torch.empty((), device=device, dtype=torch.bfloat16)
    tile = 8192
    nprog = max(1, min(triton.cdiv(n, tile), 4 * torch.cuda.get_device_properties(device).multi_processor_count))
    part = torch.empty(nprog, device=device, dtype=torch.float32)
    times = []
    for fn in (lambda: torch.sum(buf, dim=0, out=res),
               lambda: stream_read[(nprog,)](buf, part, n, TILE=tile, NPROG=nprog, num_warps=4, num_stages=3)):
        times += [x for x in eager_and_graph(fn, lambda: None, device, args) if x is not None]
    return min(times)


def hbm_tbps(device) -> float | None:
    name = device_name(device)
    return next((v for k, v in HBM_TBPS.items() if k in name), None) if device.type == "cuda" else None


# --- dense baselines ---------------------------------------------------------------------------------------


def sdpa_decode(q, k, v, scale):
    """One query per head over all keys. q [B, Hq, 1, Dk], k/v [B, Hkv, N, D]. No mask: every key is past."""
    Hq, Hkv = q.shape[1], k.shape[1]
    try:
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=Hq != Hkv)
    except TypeError:  # torch < 2.5: fold the G query heads of a group into the query length (no K/V copy)
        B, _, _, Dk = q.shape
        qf = q.reshape(B, Hkv, Hq // Hkv, Dk)
        return F.scaled_dot_product_attention(qf, k, v, scale=scale).reshape(B, Hq, 1, v.shape[-1])


def flash_backend_context(device):
    """SDPA restricted to the FA-2 (flash) backend on CUDA, and its name; the default selection elsewhere."""
    if device.type != "cuda":
        return contextlib.nullcontext, "sdpa-default"
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return contextlib.nullcontext, "sdpa-default"
    return (lambda: sdpa_kernel([SDPBackend.FLASH_ATTENTION])), "sdpa-flash"


def dense_step_fn(cache: NSACache, q, k, v, S: int, scale: float, device):
    """Dense decode on the cache's own raw K/V (no copy): write the token at position S, attend S+1 keys."""
    ctx, name = flash_backend_context(device)
    kd = cache.k_sel[:, :S + 1].transpose(1, 2)  # [B, Hkv, S+1, D] view
    vd = cache.v_sel[:, :S + 1].transpose(1, 2)
    qd = q.transpose(1, 2)

    def step():
        cache.k_sel[:, S] = k[:, 0]
        cache.v_sel[:, S] = v[:, 0]
        with ctx():
            return sdpa_decode(qd, kd, vd, scale)

    try:
        step()
    except RuntimeError:  # the flash backend refused these inputs: say so, use SDPA's own choice
        ctx, name = contextlib.nullcontext, "sdpa-default"
    return step, name


def fa_kvcache_fn(cache: NSACache, q, k, v, lengths: list[int]):
    try:
        from flash_attn import flash_attn_with_kvcache
    except ImportError:
        return None
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=q.device)

    def step():
        return flash_attn_with_kvcache(q, cache.k_sel, cache.v_sel, k=k, v=v, cache_seqlens=seqlens)

    return step


# --- fill mode ---------------------------------------------------------------------------------------------


def fill_cache(cache: NSACache, lengths: list[int], gen, chunk: int) -> None:
    """Random K/V appended through cache.write in chunks (packed with cu_seqlens when the chunk is ragged)."""
    B, H, Dk, Dv = cache.batch, cache.n_kv_heads, cache.d_k, cache.d_v
    done = [0] * B
    while any(d < L for d, L in zip(done, lengths)):
        take = [min(chunk, L - d) for d, L in zip(done, lengths)]

        def rnd(*shape):
            return torch.randn(*shape, generator=gen, device=cache.device, dtype=torch.float32).to(cache.dtype)

        if len(set(take)) == 1:
            cache.write(rnd(B, take[0], H, Dk), rnd(B, take[0], H, Dv))
        else:
            cu = torch.tensor([0] + torch.tensor(take).cumsum(0).tolist(), dtype=torch.int32, device=cache.device)
            cache.write(rnd(1, sum(take), H, Dk), rnd(1, sum(take), H, Dv), cu_seqlens=cu)
        done = [d + t for d, t in zip(done, take)]


def step_inputs(gen, B, Hq, Hkv, Dk, Dv, device, dtype):
    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    return rnd(B, 1, Hq, Dk), rnd(B, 1, Hkv, Dk), rnd(B, 1, Hkv, Dv), torch.rand(
        B, 1, Hq, 3, generator=gen, device=device, dtype=torch.float32).to(dtype)


def check_against_torch(cache, q, k, v, g, restore, backend) -> tuple[float, float]:
    """The step's output and blocks against the torch step on the same state: (max rel err, rows with equal blocks)."""
    restore()
    o, i = nsa_decode(q, k, v, g, cache, backend=backend, return_indices=True)
    restore()
    o_ref, i_ref = nsa_decode(q, k, v, g, cache, backend="torch", return_indices=True)
    restore()
    same = (i == i_ref).all(dim=-1)
    err = float((o.float() - o_ref.float()).abs().max() / o_ref.float().abs().max().clamp_min(1e-30))
    return err, float(same.float().mean())


@contextlib.contextmanager
def decode_tuning(target_programs: int | None):
    """Run with another program target of the Triton decode step (its workspace is keyed by the tuning)."""
    if target_programs is None:
        yield
        return
    from nsa.kernels.triton import decode as kd

    saved = kd.TUNING
    kd.TUNING = kd.Tuning(target_programs=target_programs)
    try:
        yield
    finally:
        kd.TUNING = saved


def split_plan(cache, Hq: int) -> tuple:
    """(target programs, split plan) of the Triton step's workspace for this cache, if it has one."""
    ws = next((w for key, w in cache.workspaces.items() if key[:2] == ("triton_decode", Hq)), None)
    return (ws.target_programs, ws.describe()) if ws is not None else (None, None)


def fill_row(preset: str, S: int, B: int, lengths: list[int], args, device, dtype, target=None, page=None) -> dict:
    with decode_tuning(target):
        return _fill_row(preset, S, B, lengths, args, device, dtype, page)


def new_cache(cfg, B: int, lengths: list[int], room: int, Hkv, Dk, Dv, device, dtype, page, seed: int):
    """The contiguous cache of a cell, or (page: tokens per page) a paged one with its pages in shuffled order."""
    if page is None:
        return NSACache(cfg, B, max(lengths) + room, Hkv, Dk, Dv, device=device, dtype=dtype)
    per_seq = -(-(max(lengths) + room) // page)
    num_pages = sum(-(-(n + room) // page) for n in lengths)
    cache = PagedNSACache(cfg, B, num_pages, page, per_seq, Hkv, Dk, Dv, device=device, dtype=dtype)
    cache._free = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
    return cache


def _fill_row(preset: str, S: int, B: int, lengths: list[int], args, device, dtype, page=None) -> dict:
    shp = PRESETS[preset]
    cfg = NSAConfig(block_cmp=shp["l"], stride_cmp=shp["d"], block_sel=shp["l_sel"], n_sel=shp["n_sel"],
                    window=shp["w"])
    Hq, Hkv, Dk, Dv = shp["heads"], shp["groups"], shp["dk"], shp["dv"]
    ragged = len(set(lengths)) > 1
    row = {"preset": preset, "S": S, "B": B, "ragged": f"{min(lengths)}-{max(lengths)}" if ragged else "",
           **{k: v for k, v in shp.items()}, "device": str(device), "dtype": str(dtype).replace("torch.", ""),
           "cache": "contiguous" if page is None else "paged", "page_size": page}
    gen = torch.Generator(device=device).manual_seed(args.seed)
    room = args.inner + 8
    cache = new_cache(cfg, B, lengths, room, Hkv, Dk, Dv, device, dtype, page, args.seed)
    fill_cache(cache, lengths, gen, chunk=8192)
    if page is not None:
        cache.reserve(room)  # every page the timed steps touch, before the CUDA graph is captured
    q, k, v, g = step_inputs(gen, B, Hq, Hkv, Dk, Dv, device, dtype)
    seqlens0, host0 = cache.cache_seqlens.clone(), cache.host_state()

    def restore():
        cache.cache_seqlens.copy_(seqlens0)
        cache.set_host_state(host0)

    with torch.no_grad():
        telemetry.reset()
        _, stats = nsa_decode(q, k, v, g, cache, backend=args.backend, return_stats=True)
        row["backend"] = ",".join(sorted(telemetry.served("sel")))
        row["target_programs"], row["splits"] = split_plan(cache, Hq)
        restore()
        out = torch.empty(B, 1, Hq, Dv, device=device, dtype=dtype)

        def step():
            return nsa_decode(q, k, v, g, cache, backend=args.backend, out=out)

        eager, graph = eager_and_graph(step, restore, device, args, after_capture=lambda: cache.set_host_state(host0))
        row["step_eager_ms"], row["step_graph_ms"] = eager, graph
        row["step_ms"] = graph if graph is not None else eager
        put_spread(row, "step")
        row["tok_per_s"] = B / (row["step_ms"] / 1e3)
        row["cmp_blocks"] = stats["cmp_blocks"] if not ragged else max(stats["cmp_blocks"])
        for key in ("kv_bytes", "kv_bytes_cmp", "kv_bytes_sel", "kv_bytes_win"):
            row[key] = stats[key]
        elem = cache.dtype.itemsize
        row["dense_kv_bytes"] = B * Hkv * (max(lengths) + 1) * (Dk + Dv) * elem
        row["kv_bytes_ratio"] = row["kv_bytes"] / row["dense_kv_bytes"]
        row["tbps"] = row["kv_bytes"] / (row["step_ms"] * 1e-3) / 1e12
        row["hbm_tbps"] = hbm_tbps(device)
        row["hbm_frac"] = row["tbps"] / row["hbm_tbps"] if row["hbm_tbps"] else None
        if not args.no_check:
            row["check_rel_err"], row["check_idx_agree"] = check_against_torch(cache, q, k, v, g, restore,
                                                                               args.backend)
        if page is not None:  # the baselines read contiguous K/V: the contiguous row of this cell has them
            return row
        dense, dense_name = dense_step_fn(cache, q, k, v, max(lengths), cfg.softmax_scale(Dk), device)
        d_eager, d_graph = eager_and_graph(dense, lambda: None, device, args)
        row["dense_eager_ms"], row["dense_graph_ms"] = d_eager, d_graph
        row["dense_ms"] = min(x for x in (d_eager, d_graph) if x is not None)
        put_spread(row, "dense")
        row["dense_backend"] = dense_name + ("+padded" if ragged else "")
        row["dense_tbps"] = row["dense_kv_bytes"] / (row["dense_ms"] * 1e-3) / 1e12
        row["dense_tok_per_s"] = B / (row["dense_ms"] / 1e3)
        row["speedup_vs_dense"] = row["dense_ms"] / row["step_ms"]
        row["read_floor_ms"] = read_floor_ms(row["kv_bytes"], device, args)
        if row["read_floor_ms"]:
            row["floor_frac"] = row["read_floor_ms"] / row["step_ms"]
            row["speedup_ceiling"] = row["dense_ms"] / row["read_floor_ms"]
        fa = fa_kvcache_fn(cache, q, k, v, lengths) if device.type == "cuda" else None
        if fa is not None:
            fa_eager, fa_graph = eager_and_graph(fa, lambda: None, device, args)
            row["fa_kvcache_ms"] = min(x for x in (fa_eager, fa_graph) if x is not None)
            row["speedup_vs_fa_kvcache"] = row["fa_kvcache_ms"] / row["step_ms"]
    return row


# Measured first when the sweep includes them (a --max-seconds cut keeps them): the figures the step is held to.
FIRST = (("paper", 65536, 8), ("paper", 65536, 1), ("paper", 8192, 8))


def fill_cells(args):
    cells = []
    for preset in args.presets:
        for B in args.B_list_:
            for S in args.S:
                cells.append((preset, S, B, [S] * B))
        for S in args.ragged:
            B = 8 if not args.smoke else 3
            cells.append((preset, S, B, [max(1, round(S * (i + 1) / B)) for i in range(B)]))
    first = [c for key in FIRST for c in cells if c[:3] == key and len(set(c[3])) == 1]
    cells = [c + (None, None) for c in first + [c for c in cells if c not in first]]
    if args.tune_ and args.device_.type == "cuda":
        sms = torch.cuda.get_device_properties(args.device_).multi_processor_count
        tuned = [c[:4] + (int(f * sms), None) for c in cells[:len(first)] for f in args.tune_]
        cells = cells[:len(first)] + tuned + cells[len(first):]
    if args.paged:  # each untuned cell, then the same on the paged cache
        cells = [x for c in cells for x in ([c, c[:5] + (args.page_size,)] if c[4] is None else [c])]
    return cells


# --- layer mode --------------------------------------------------------------------------------------------


def layer_row(S, args, device, dtype) -> dict:
    cfg = NSAConfig(block_cmp=args.l, stride_cmp=args.d, block_sel=args.l_sel, n_sel=args.n_sel,
                    window=args.w, compress=args.compress)
    torch.manual_seed(args.seed)
    layer = NSAAttention(args.dim, args.heads, args.groups, args.dk, args.dv, cfg).to(device=device, dtype=dtype)
    layer.eval()
    B, Hq, Hkv = args.B, args.heads, args.groups
    timing = _timing(args)
    cache = layer.new_cache(B, S + 1 + timing.inner + 8)  # room for one timed batch of steps
    run = run_generation(layer, args.dim, B, S, args.steps, device, dtype) if args.steps else {}
    row = {"S": S, "B": B, "dim": args.dim, "heads": Hq, "groups": Hkv, "dk": args.dk, "dv": args.dv,
           "l": args.l, "d": args.d, "l_sel": args.l_sel, "n_sel": args.n_sel, "w": args.w,
           "branch_force_mode": args.branch_force_mode, "device": str(device),
           "dtype": str(dtype).replace("torch.", "")}
    with torch.no_grad():
        x = torch.randn(B, S + 1, args.dim, device=device, dtype=dtype)
        pre = time_fn(lambda: layer(x[:, :S], cache), iters=1, warmup=0, device=device)
        row["prefill_ms"] = pre["median_ms"]
        seqlens0, host0 = cache.cache_seqlens.clone(), cache.host_state()

        def restore():
            cache.cache_seqlens.copy_(seqlens0)
            cache.set_host_state(host0)

        # Inputs of the new token at position S, as the layer computes them.
        pos = torch.full((B, 1), S, device=device, dtype=torch.long)
        q, kv, gates = layer.project(x[:, S:], pos)
        k, v = kv["sel"]
        kw = dict(kv_cmp=kv["cmp"], kv_win=kv["win"], compress_fn=layer.compress_fn(), backend=args.backend)
        telemetry.reset()
        _, stats = nsa_decode(q, k, v, gates, cache, return_stats=True, **kw)
        row["backend"] = ",".join(sorted(telemetry.served("sel")))
        restore()

        def step():
            nsa_decode(q, k, v, gates, cache, **kw)

        eager, graph = eager_and_graph(step, restore, device, timing, after_capture=restore)
        row["step_eager_ms"], row["step_graph_ms"] = eager, graph
        row["step_ms"] = graph if graph is not None else eager
        put_spread(row, "step")
        row["layer_step_ms"] = time_steps(lambda: layer(x[:, S:], cache), restore, device, timing.inner,
                                          timing.repeats, args.warmup)
        row["tok_per_s"] = B / (row["step_ms"] / 1e3)
        row["cmp_blocks"] = stats["cmp_blocks"]
        for key in ("kv_bytes", "kv_bytes_cmp", "kv_bytes_sel", "kv_bytes_win"):
            row[key] = stats[key]

        # Each torch branch alone on the cache as the torch step sees it: the token at S appended, not published.
        restore()
        cache.append_step(k, v, *kv["cmp"], *kv["win"], compress_fn=layer.compress_fn())
        sv = torch_step_view(q, cache)
        n, ct = sv.n_cmp, sv.qc.dtype
        valid = torch.ones(B, n, dtype=torch.bool, device=device)

        k_cmp = cache.k_cmp[:, :n].to(ct)
        cmp_start = sv.seq_start + sv.cmp_local

        def run_cmp():
            return compressed_chunk(sv.qc, k_cmp, cache.v_cmp[:, :n].to(ct), cmp_start, valid, sv.t_glob, sv.seq_start,
                                    cfg, sv.scale)

        _, lse = run_cmp()

        def run_topk():
            return topn_chunk(sv.qc, k_cmp, lse, cmp_start, sv.cmp_local, valid, sv.t_glob, sv.seq_start,
                              sv.n_sel_blocks, cfg, sv.scale)

        indices = run_topk()

        def run_sel():
            return selected_chunk(sv.qc, cache.k_sel, cache.v_sel, indices, sv.pos, torch.zeros_like(sv.pos), cfg,
                                  sv.scale)

        def run_win():
            return sliding_chunk(sv.qc, cache.k_win.to(ct), cache.v_win.to(ct), sv.win_key_pos, sv.t_glob,
                                 sv.seq_start, cfg, sv.scale)

        mode = args.branch_force_mode
        wanted = {"cmp": ("cmp",), "sel": ("sel",), "win": ("win",)}.get(mode, ("cmp", "sel", "win"))
        for name, fn in (("cmp", run_cmp), ("topk", run_topk), ("sel", run_sel), ("win", run_win)):
            branch = "sel" if name == "topk" else name
            row[f"{name}_ms"] = (time_fn(fn, args.iters, args.warmup, device)["median_ms"]
                                 if branch in wanted else float("nan"))

        scale = cfg.softmax_scale(args.dk)
        dense, dense_name = dense_step_fn(cache, q, k, v, S, scale, device)
        d_eager, d_graph = eager_and_graph(dense, lambda: None, device, timing)
        row["dense_eager_ms"], row["dense_graph_ms"] = d_eager, d_graph
        row["dense_ms"] = min(x for x in (d_eager, d_graph) if x is not None)
        put_spread(row, "dense")
        row["dense_backend"] = dense_name
        row["dense_tok_per_s"] = B / (row["dense_ms"] / 1e3)
        row["speedup_vs_dense"] = row["dense_ms"] / row["step_ms"]
        row["dense_kv_bytes"] = B * Hkv * (S + 1) * (args.dk + args.dv) * cache.k_sel.element_size()
        row["kv_bytes_ratio"] = row["kv_bytes"] / row["dense_kv_bytes"]
        row["tbps"] = row["kv_bytes"] / (row["step_ms"] * 1e-3) / 1e12
        row["dense_tbps"] = row["dense_kv_bytes"] / (row["dense_ms"] * 1e-3) / 1e12
        row["hbm_tbps"] = hbm_tbps(device)
        row["hbm_frac"] = row["tbps"] / row["hbm_tbps"] if row["hbm_tbps"] else None
    row.update(run)
    return row


def run_generation(layer, dim: int, B: int, S: int, steps: int, device, dtype) -> dict:
    """Prefill S tokens, then `steps` decode steps one token at a time through the layer (its own cache), as
    generation runs: the run_* columns. Warmed up once on a short prefix so compilation is not timed."""
    with torch.no_grad():
        x = torch.randn(B, S + steps, dim, device=device, dtype=dtype)
        warm = layer.new_cache(B, 64)
        layer(x[:, :32], warm)
        layer(x[:, 32:33], warm)
        cache = layer.new_cache(B, S + steps)
        sync(device)
        t0 = time.perf_counter()
        out = layer(x[:, :S], cache)
        sync(device)
        t1 = time.perf_counter()
        finite = bool(torch.isfinite(out).all())
        for i in range(S, S + steps):
            out = layer(x[:, i:i + 1], cache)
        sync(device)
        t2 = time.perf_counter()
        finite = finite and bool(torch.isfinite(out).all())
    return dict(run_steps=steps, run_prefill_ms=(t1 - t0) * 1e3, run_decode_ms=(t2 - t1) * 1e3,
                run_tok_per_s=B * (S + steps) / (t2 - t0), decode_tok_per_s=B * steps / (t2 - t1),
                run_finite=finite)


def _timing(args):
    """Layer mode: --iters timed steps, in batches of at most 16 back to back (the position drifts by at most 16
    before the lengths are put back)."""
    inner = min(args.iters, 16)
    return argparse.Namespace(inner=inner, repeats=max(1, args.iters // inner), no_graph=args.no_graph)


# --- main --------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    args = parse_args(argv)
    device = resolve_device(args.device)
    dtype = parse_dtype(args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    con = console()
    args.device_ = device
    if args.fill:
        cells = [(f"{p} S={S} B={B}{' ragged' if len(set(L)) > 1 else ''}{f' target={t}' if t else ''}"
                  f"{f' paged {pg}' if pg else ''}",
                  lambda p=p, S=S, B=B, L=L, t=t, pg=pg: fill_row(p, S, B, L, args, device, dtype, t, pg))
                 for p, S, B, L, t, pg in fill_cells(args)]
    else:
        cells = [(f"S={S}", lambda S=S: layer_row(S, args, device, dtype)) for S in args.S]
    rows, t0, skipped = [], time.perf_counter(), []
    progress = contextlib.nullcontext()
    if con is not None:
        from rich.progress import Progress

        progress = Progress(console=con, transient=True)
    with progress as prog:
        task = prog.add_task("decode bench", total=len(cells)) if prog is not None else None
        for label, run in cells:
            if args.max_seconds is not None and time.perf_counter() - t0 > args.max_seconds:
                skipped.append(label)
                continue
            if prog is not None:
                prog.update(task, description=f"decode bench {label}")
            else:
                print(f"decode bench {label}", flush=True)
            rows.append(run())
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the row's cache is gone: give its memory back before the next size
            write_csv(args.csv, rows, COLUMNS)  # partial results survive an interrupted run
            if prog is not None:
                prog.advance(task)
    if not rows:
        print("no rows measured (--max-seconds too small?)", file=sys.stderr)
        return 1
    csv_path = write_csv(args.csv, rows, COLUMNS)
    meta = env_metadata(device)
    args_out = {**vars(args), "csv": Path(args.csv).name}  # the file's name only, not the machine's path
    side = write_json(sidecar_path(csv_path), {"meta": meta, "args": args_out,
                                                "columns": COLUMNS, "rows": rows, "skipped": skipped})
    f = lambda x, p=3: "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{p}f}"  # noqa: E731
    title = f"NSA decode ({device_name(device)}, {rows[0]['dtype']}"
    if args.fill:
        print_table(title + ")",
                    ["preset", "S", "B", "ragged", "cache", "step ms", "eager ms", "KV read", "TB/s", "read floor ms",
                     "dense ms", "x dense", "x ceiling", "fa_kvcache", "check"],
                    [[r["preset"], r["S"], r["B"], r["ragged"] or "-",
                      r["cache"] + (f" {r['page_size']}" if r["page_size"] else ""), f(r["step_ms"]),
                      f(r["step_eager_ms"]), fmt_bytes(r["kv_bytes"]), f(r["tbps"], 2), f(r.get("read_floor_ms"), 4),
                      f(r.get("dense_ms")), f(r.get("speedup_vs_dense"), 2), f(r.get("speedup_ceiling"), 2),
                      f(r.get("fa_kvcache_ms")), f(r.get("check_rel_err"), 4)] for r in rows], con)
    else:
        print_table(title + f", B={args.B}, Hq={args.heads}, Hkv={args.groups}, dk={args.dk}, dv={args.dv}, "
                    f"mode={args.branch_force_mode})",
                    ["S", "step ms", "eager ms", "layer ms", "tok/s", "cmp", "topk", "sel", "win", "KV read",
                     "dense KV", "dense ms", "x dense"],
                    [[r["S"], f(r["step_ms"]), f(r["step_eager_ms"]), f(r["layer_step_ms"]), f(r["tok_per_s"], 0),
                      f(r["cmp_ms"]), f(r["topk_ms"]), f(r["sel_ms"]), f(r["win_ms"]), fmt_bytes(r["kv_bytes"]),
                      fmt_bytes(r["dense_kv_bytes"]), f(r["dense_ms"]), f(r["speedup_vs_dense"], 2)] for r in rows],
                    con)
    for r in rows:
        if r.get("run_steps"):
            print(f"S={r['S']} B={r['B']}: prefill {f(r['run_prefill_ms'], 1)} ms + {r['run_steps']} decode steps "
                  f"{f(r['run_decode_ms'], 1)} ms = {f(r['run_tok_per_s'], 0)} tok/s (decode alone "
                  f"{f(r['decode_tok_per_s'], 0)} tok/s), outputs finite: {r['run_finite']}")
    if skipped:
        print(f"skipped after --max-seconds: {', '.join(skipped)}")
    print(f"wrote {csv_path} and {side}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
