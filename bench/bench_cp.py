"""Context-parallel NSA: time and memory per rank over 1-8 GPUs, strong and weak scaling, against dense attention.

    # one GPU (the baseline: world size 1 is the plain call), then 2, 4, 8 GPUs of one host
    torchrun --standalone --nproc_per_node 1 bench/bench_cp.py --out bench/results/cp-h100
    torchrun --standalone --nproc_per_node 4 bench/bench_cp.py --out bench/results/cp-h100
    # two processes on ONE GPU over gloo: correctness against the one-process call (no timing claims)
    torchrun --standalone --nproc_per_node 2 bench/bench_cp.py --gloo-one-gpu --check-only --out /tmp/cp-check
    # tiny, CPU, gloo (what CI-like checks run)
    torchrun --standalone --nproc_per_node 2 bench/bench_cp.py --smoke --out /tmp/cp-smoke

Per world size W (the torchrun group), shape (--shapes: D128 = Hq 64, Hkv 4, Dk = Dv = 128; Dk192Dv128 =
the paper's heads), bf16, paper blocks, B=1, shared K/V:
  strong  fixed total tokens (--strong-T, default 128k and 256k), each rank holding T/W
  weak    fixed tokens per rank (--weak-T, default 64k), the stream growing with W
  nsa_cp     nsa_attention(..., cp_group=WORLD): forward (no grad), backward, forward+backward
  dense_cp   dense causal attention under the same split: K/V all-gathered (backward reduce-scatters, as
             NSA's) and SDPA on the local queries against the keys before them (flash backend on a GPU)
  dense_ring torch's context_parallel (ring attention over SDPA) where this torch has it and the run is
             on NCCL GPUs; a row with its error otherwise
  nsa_cp_torch (W=1 runs) the same with backend="torch": the PyTorch branches (the per-rank path of packed
             input), the baseline of the same compute for torch-path rows; nsa_cp runs the fused kernels
             per rank at a query offset where planning takes them for the plain call (column `path`:
             what served each row)
  nsa_1gpu   (W=1 runs; --single adds it on rank 0 of larger runs) the plain nsa_attention call on the whole
             stream with the fastest backend ("auto"); nsa_cp at W=1 is the same call through cp_group
Times are the median over --iters (after --warmup) of the slowest rank's time per iteration (a barrier
before each); peak memory is torch.cuda.max_memory_allocated per rank over one forward+backward,
inputs and gradients included. Every run writes bench_cp_w{W}.csv / .json (environment, arguments,
rows) to --out; rank 0 then merges every bench_cp_w*.csv there into bench_cp_summary.csv (efficiency
against W=1 of the same implementation: t1 / (W tW) for strong scaling, t1 / tW for weak; also
efficiency_same_compute, against W=1 of what served the ranks: nsa_cp_torch for nsa_cp rows on the torch
path) and bench_cp.png (matplotlib; skipped with a message without it).
--longest: after the timed cases, the longest stream one nsa_cp forward+backward fits at this world size
(tokens per rank doubling from --longest-from, then bisection), rows of mode "longest" in
bench_cp_longest_w{W}.csv; rank 0 merges them into bench_cp_longest.csv (longest per shape and W, and the
ratio to one GPU's longest). Run it with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True at every W alike.
--check (on by default): before timing, a small stream in fp32 through cp_group against the one-process
call on every rank (outputs and q/k/v/gate gradients); exit status 1 when it disagrees.
NVLink multicast stays off: NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1
are set before any process group starts (also for processes this one starts).
"""

from __future__ import annotations

import os

# Before torch.distributed starts anything: a program using NVLink multicast can take a shared host's
# GPUs out of service, so it stays off whatever the caller's environment says.
os.environ.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"})

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from nsa import NSAConfig, nsa_attention, telemetry  # noqa: E402
from nsa.benchutil import env_metadata, parse_dtype, read_csv, write_csv, write_json  # noqa: E402
from nsa.distributed import ContextParallel, shard  # noqa: E402
from nsa.distributed.comm import gather_kv  # noqa: E402
from nsa.distributed.cp import pieces_of  # noqa: E402

SHAPES = {"D128": (64, 4, 128, 128), "Dk192Dv128": (64, 4, 192, 128)}
SMOKE_SHAPES = {"small": (4, 2, 16, 8)}
SMOKE_CFG = NSAConfig(block_cmp=8, stride_cmp=4, block_sel=8, n_sel=4, window=16)
COLUMNS = ["mode", "impl", "shape", "world", "layout", "T_total", "T_local", "Hq", "Hkv", "Dk", "Dv", "fwd_ms",
           "bwd_ms", "fwdbwd_ms", "peak_mib_max", "peak_mib_ranks", "backend", "path", "status"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for CSV / JSON / PNG")
    p.add_argument("--strong-T", default="131072,262144", help="total tokens for strong scaling ('' = none)")
    p.add_argument("--weak-T", default="65536", help="tokens per rank for weak scaling ('' = none)")
    p.add_argument("--shapes", default="D128,Dk192Dv128")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--layout", default="zigzag", choices=("contiguous", "zigzag"),
                   help="how the stream is split (zigzag balances the compressed branch's causal cost)")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--impls", default="nsa_cp,nsa_cp_torch,dense_cp,dense_ring,nsa_1gpu",
                   help="which implementations to time")
    p.add_argument("--single", action="store_true", help="also time the one-GPU call on rank 0 of a W>1 run")
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                   help="check cp_group against the one-process call before timing")
    p.add_argument("--check-only", action="store_true", help="run the check and stop")
    p.add_argument("--check-T", type=int, default=4096, help="stream length of the check")
    p.add_argument("--gloo-one-gpu", action="store_true",
                   help="every rank on cuda:0 over gloo (correctness on one GPU; K/V staged through the host)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes and blocks on CPU over gloo")
    p.add_argument("--budget-s", type=float, default=540.0,
                   help="start no new case after this many seconds (its rows say 'skipped: time budget')")
    p.add_argument("--baseline-iters", type=int, default=None,
                   help="timed iterations of the dense rows, after one warm-up call (default: --iters and --warmup; "
                        "dense is slow at 256k on one GPU)")
    p.add_argument("--longest", action="store_true",
                   help="find the longest stream one nsa_cp forward+backward fits at this world size (after "
                        "the timed cases; pass --strong-T '' --weak-T '' for the search alone)")
    p.add_argument("--longest-from", type=int, default=131072, help="tokens per rank of the search's first try")
    p.add_argument("--longest-max", type=int, default=1 << 24, help="tokens per rank the search does not pass")
    p.add_argument("--longest-refine", type=int, default=2,
                   help="bisection steps between the last stream that fits and the first that does not")
    return p.parse_args(argv)


def setup(args):
    """(device, backend name) after starting the process group (world size 1 without torchrun)."""
    if args.smoke:
        device, backend = torch.device("cpu"), "gloo"
    elif args.gloo_one_gpu:
        device, backend = torch.device("cuda", 0), "gloo"
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        backend = "nccl"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if "RANK" not in os.environ:  # plain `python bench_cp.py`: a group of one
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533"})
    kw = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(backend, **kw)
    return device, backend


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, args, device, iters=None):
    """Median over iters (default args.iters, after args.warmup calls; given iters: after one) of the slowest
    rank's ms per call (a barrier before each)."""
    for _ in range(args.warmup if iters is None else min(args.warmup, 1)):
        fn()
    times = []
    for _ in range(iters or args.iters):
        dist.barrier()
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        t = torch.tensor([(time.perf_counter() - t0) * 1e3], dtype=torch.float64,
                         device=device if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(float(t))
    return statistics.median(times)


def peak_mib(fn, device):
    """Every rank's peak allocated MiB over one call (None on CPU)."""
    if device.type != "cuda":
        fn()
        return None
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    sync(device)
    mine = torch.tensor([torch.cuda.max_memory_allocated(device) / 2**20], device=device)
    out = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    if dist.get_backend() == "nccl":
        dist.all_gather(out, mine)
    else:
        host = [torch.zeros(1) for _ in out]
        dist.all_gather(host, mine.cpu())
        out = host
    return [round(float(x), 1) for x in out]


def make_local(T_total, shape, dtype, device, spec, seed=0):
    """This rank's slice of q, k, v, gates of a stream of T_total tokens (random, reproducible)."""
    Hq, Hkv, Dk, Dv = shape
    gen = torch.Generator(device=device).manual_seed(seed)
    full = [torch.randn(1, T_total, Hq, Dk, generator=gen, device=device, dtype=dtype),
            torch.randn(1, T_total, Hkv, Dk, generator=gen, device=device, dtype=dtype),
            torch.randn(1, T_total, Hkv, Dv, generator=gen, device=device, dtype=dtype),
            torch.rand(1, T_total, Hq, 3, generator=gen, device=device, dtype=dtype)]
    return [shard(x, spec).contiguous() for x in full], full


def dense_cp(q, k, v, spec):
    """Causal dense attention of this rank's queries under the same split as NSA's: the stream's K/V gathered
    in one collective (backward: reduce-scatter), then attention of each local segment against the keys
    before its end. On a GPU: FlashAttention-2 (aten._flash_attention_forward: native GQA, and causal with
    fewer queries than keys aligns the queries to the END of the keys, what a segment at an offset needs;
    v zero-padded to Dk where Dk != Dv, as FA-2 wants one head dim). On CPU: SDPA with an explicit mask."""
    group = spec.group
    W, rank = dist.get_world_size(group), dist.get_rank(group)
    segs, pieces = pieces_of(spec.layout, [q.shape[1]] * W)
    kf, vf = gather_kv([k, v], group, q.shape[1], pieces)
    Dk, Dv = q.shape[-1], v.shape[-1]
    outs, c0 = [], 0
    for s, n in segs[rank]:
        e = s + n
        qs, ks, vs = q[:, c0:c0 + n], kf[:, :e], vf[:, :e]
        if q.is_cuda:
            if Dv < Dk:
                vs = F.pad(vs, (0, Dk - Dv))
            o = torch.ops.aten._flash_attention_forward(qs, ks.contiguous(), vs.contiguous(), None, None, n, e, 0.0,
                                                        True, False)[0][..., :Dv]
        else:
            mask = torch.ones(n, e, dtype=torch.bool, device=q.device).tril(diagonal=s)
            o = F.scaled_dot_product_attention(qs.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2),
                                               attn_mask=mask, enable_gqa=True).transpose(1, 2)
        outs.append(o)
        c0 += n
    return torch.cat(outs, 1)


def dense_ring(q, k, v, mesh):
    """torch's context_parallel (ring attention) over SDPA; q, k, v of the WHOLE stream [B, H, T, D], sharded
    by the context manager in place; with grad enabled the backward of a random output gradient runs inside
    the context too. Raises where this torch or backend cannot run it."""
    from torch.distributed.tensor.experimental import context_parallel

    # Fresh inputs per call: nothing to restore (and leaves that require grad cannot be resized back).
    with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2], no_restore_buffers={q, k, v}):
        if torch.is_grad_enabled():  # the shards (made in place on entry) are the leaves
            for x in (q, k, v):
                x.requires_grad_()
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if torch.is_grad_enabled():
            o.backward(torch.randn_like(o))
        return o


def check(args, device, cfg, spec):
    """cp_group against the one-process call on a small fp32 stream: (ok, {name: rel err})."""
    shape = SMOKE_SHAPES["small"] if args.smoke else (8, 2, 64, 64)
    T = args.check_T if not args.smoke else 8 * 2 * dist.get_world_size()
    local, full = make_local(T, shape, torch.float32, device, spec, seed=1)
    leaves = [x.clone().requires_grad_() for x in local]
    out = nsa_attention(*leaves, cfg, backend="torch", cp_group=spec)
    gen = torch.Generator(device=device).manual_seed(2)
    w = torch.randn(1, T, shape[0], shape[3], generator=gen, device=device)
    (out * shard(w, spec)).sum().backward()
    ref_leaves = [x.clone().requires_grad_() for x in full]
    ref = nsa_attention(*ref_leaves, cfg, backend="torch")
    (ref * w).sum().backward()

    def rel(a, b):
        a, b = a.detach().double(), b.detach().double()
        return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))

    errs = {"out": rel(out, shard(ref, spec))}
    for name, a, b in zip(("dq", "dk", "dv", "dgates"), leaves, ref_leaves):
        errs[name] = rel(a.grad, shard(b.grad, spec))
    worst = torch.tensor([max(errs.values())], dtype=torch.float64,
                         device=device if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # every rank returns the same verdict
    return float(worst) < 1e-4, errs


def local_leaves(T_local, shape, dtype, device):
    """This rank's own random q, k, v, gates (leaves that require grad) and an output gradient."""
    Hq, Hkv, Dk, Dv = shape
    gen = torch.Generator(device=device).manual_seed(dist.get_rank())
    leaves = [torch.randn(1, T_local, h, d, generator=gen, device=device, dtype=dtype).requires_grad_()
              for h, d in ((Hq, Dk), (Hkv, Dk), (Hkv, Dv))]
    leaves.append(torch.rand(1, T_local, Hq, 3, generator=gen, device=device, dtype=dtype).requires_grad_())
    return leaves, torch.randn(1, T_local, Hq, Dv, generator=gen, device=device, dtype=dtype)


def run_case(args, device, cfg, spec, mode, shape_name, shape, T_total, dtype, impls, mesh):
    W = dist.get_world_size()
    rows = []
    base = {"mode": mode, "shape": shape_name, "world": W, "layout": spec.layout, "T_total": T_total,
            "T_local": T_total // W, "Hq": shape[0], "Hkv": shape[1], "Dk": shape[2], "Dv": shape[3]}
    # Timing needs no common stream: each rank draws its own slice (the whole stream on every rank would
    # cost T_total * Hq * Dk elements per rank, 6 GB at 256k tokens).
    leaves, dout = local_leaves(T_total // W, shape, dtype, device)

    def nsa_fwd():
        with torch.no_grad():
            return nsa_attention(*leaves, cfg, cp_group=spec)

    def nsa_fwdbwd():
        nsa_attention(*leaves, cfg, cp_group=spec).backward(dout)

    def torch_fwd():
        with torch.no_grad():
            return nsa_attention(*leaves, cfg, cp_group=spec, backend="torch")

    def torch_fwdbwd():
        nsa_attention(*leaves, cfg, cp_group=spec, backend="torch").backward(dout)

    def dense_fwd():
        with torch.no_grad():
            return dense_cp(*leaves[:3], spec)

    def dense_fwdbwd():
        dense_cp(*leaves[:3], spec).backward(dout)

    cases = {"nsa_cp": (nsa_fwd, nsa_fwdbwd), "dense_cp": (dense_fwd, dense_fwdbwd)}
    if W == 1:  # the baseline of torch-path rows (slow at these lengths: not repeated at every W)
        cases["nsa_cp_torch"] = (torch_fwd, torch_fwdbwd)
    backends = {"nsa_cp": "auto", "nsa_cp_torch": "torch", "dense_cp": "fa2" if device.type == "cuda" else "sdpa"}
    for impl in impls:
        if impl not in cases:
            continue
        row = dict(base, impl=impl, backend=backends[impl], status="ok")
        telemetry.reset()
        try:
            measure(row, *cases[impl], args, device, None if impl.startswith("nsa") else args.baseline_iters)
        except torch.OutOfMemoryError:
            row["status"] = "oom"
        row["path"] = served_path(impl, W)
        rows.append(row)
        for x in leaves:
            x.grad = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if "dense_ring" in impls:
        rows.append(ring_row(args, device, base, shape, T_total, dtype, mesh, dout))
    if (W == 1 and "nsa_1gpu" in impls) or (W > 1 and args.single and mode == "strong"):
        rows.append(single_row(args, device, cfg, base, shape, T_total, dtype))
    return rows


def served_path(impl: str, W: int) -> str:
    """What served an NSA row's per-rank compute (nsa.telemetry's "cp" decisions since the last reset):
    "fused" (the fused kernels at a query offset), "torch" (the PyTorch branches), "plain" (W = 1: the
    plain call); "" for the other implementations."""
    if not impl.startswith("nsa"):
        return ""
    if W == 1:
        return "plain"
    return "+".join(sorted(telemetry.served("cp"))) or "none"


def measure(row, fwd, fwdbwd, args, device, iters=None) -> None:
    """Fill a row's forward, forward+backward and backward times and the ranks' peak memory."""
    row["fwd_ms"] = timed(fwd, args, device, iters)
    row["fwdbwd_ms"] = timed(fwdbwd, args, device, iters)
    row["bwd_ms"] = row["fwdbwd_ms"] - row["fwd_ms"]
    peaks = peak_mib(fwdbwd, device)
    if peaks:
        row["peak_mib_max"], row["peak_mib_ranks"] = max(peaks), ";".join(map(str, peaks))


def ring_row(args, device, base, shape, T_total, dtype, mesh, dout):
    row = dict(base, impl="dense_ring", backend="sdpa",
               status="ok (K/V with Hq heads; whole-stream inputs made inside the timed call)")
    if device.type != "cuda" or dist.get_backend() != "nccl" or dist.get_world_size() == 1:
        row["status"] = "skipped: needs NCCL GPUs and W > 1"
        return row
    Hq, _, Dk, Dv = shape
    try:
        gen = torch.Generator(device=device).manual_seed(0)

        def fresh():
            # K/V repeated to Hq heads (ring attention's SDPA kernels do not all take GQA): the row's status says so.
            return [torch.randn(1, Hq, T_total, d, generator=gen, device=device, dtype=dtype) for d in (Dk, Dk, Dv)]

        def fwd():
            with torch.no_grad():
                dense_ring(*fresh(), mesh)

        def fwdbwd():
            dense_ring(*fresh(), mesh)  # forward and backward inside the context

        measure(row, fwd, fwdbwd, args, device, args.baseline_iters)
    except Exception as exc:  # noqa: BLE001 - recorded in the row: torch's experimental API varies by release
        row["status"] = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    return row


def single_row(args, device, cfg, base, shape, T_total, dtype):
    """The plain one-GPU call on the whole stream (rank 0; the others wait)."""
    row = dict(base, impl="nsa_1gpu", world=1, T_local=T_total, backend="auto", status="ok")
    if dist.get_rank() == 0:
        try:
            gen = torch.Generator(device=device).manual_seed(0)
            Hq, Hkv, Dk, Dv = shape
            x = [torch.randn(1, T_total, h, d, generator=gen, device=device, dtype=dtype, requires_grad=True)
                 for h, d in ((Hq, Dk), (Hkv, Dk), (Hkv, Dv))]
            g = torch.rand(1, T_total, Hq, 3, generator=gen, device=device, dtype=dtype, requires_grad=True)
            dout = torch.randn(1, T_total, Hq, Dv, device=device, dtype=dtype)
            one = argparse.Namespace(iters=args.iters, warmup=args.warmup)

            def fwd():
                with torch.no_grad():
                    nsa_attention(*x, g, cfg)

            def fwdbwd():
                nsa_attention(*x, g, cfg).backward(dout)

            row["fwd_ms"] = local_timed(fwd, one, device)
            row["fwdbwd_ms"] = local_timed(fwdbwd, one, device)
            row["bwd_ms"] = row["fwdbwd_ms"] - row["fwd_ms"]
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                fwdbwd()
                row["peak_mib_max"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
        except torch.OutOfMemoryError:
            row["status"] = "oom"
    dist.barrier()
    return row


def longest(args, device, cfg, spec, shape_name, shape, dtype, out: Path, started: float) -> list[dict]:
    """The longest stream whose nsa_cp forward+backward fits at this world size. Tokens per rank double from
    --longest-from until a try runs out of memory (or passes --longest-max), then --longest-refine bisection
    steps between the last fit and the first failure (a first try that does not fit halves instead). One call
    per try, after one small call that compiles the kernels. Rows of mode "longest" (status ok / oom), written
    to bench_cp_longest_w{W}.csv after every try: a rank that runs out of memory while another waits in a
    collective can hang the group, and what was measured before stays."""
    W, rank = dist.get_world_size(), dist.get_rank()
    quantum = 2 * W * (16 if args.smoke else 1024)  # zigzag halves of whole blocks on every rank
    rows: list[dict] = []

    def attempt(t_local: int, record: bool = True) -> bool:
        T = max(quantum, t_local * W // quantum * quantum)
        row = {"mode": "longest", "impl": "nsa_cp", "shape": shape_name, "world": W, "layout": spec.layout,
               "T_total": T, "T_local": T // W, "Hq": shape[0], "Hkv": shape[1], "Dk": shape[2], "Dv": shape[3],
               "backend": "auto", "status": "ok"}
        ms, peak, ok = 0.0, 0.0, 1.0
        telemetry.reset()
        try:
            leaves, dout = local_leaves(T // W, shape, dtype, device)
            sync(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
            nsa_attention(*leaves, cfg, cp_group=spec).backward(dout)
            sync(device)
            ms = (time.perf_counter() - t0) * 1e3
            peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else 0.0
        except torch.OutOfMemoryError:
            ok = 0.0
        leaves = dout = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
        # one collective per try, the same on every rank: (fits, ms, peak MiB) of each
        where = device if dist.get_backend() == "nccl" else "cpu"
        mine = torch.tensor([ok, ms, peak], dtype=torch.float64, device=where)
        every = [torch.zeros_like(mine) for _ in range(W)]
        dist.all_gather(every, mine)
        fits = all(float(e[0]) == 1.0 for e in every)
        row["status"] = "ok" if fits else "oom"
        if fits:
            row["fwdbwd_ms"] = round(max(float(e[1]) for e in every), 2)
            peaks = [round(float(e[2]), 1) for e in every]
            row["peak_mib_max"], row["peak_mib_ranks"] = max(peaks), ";".join(map(str, peaks))
        row["path"] = served_path("nsa_cp", W)
        if record:
            rows.append(row)
            if rank == 0:
                write_csv(out / f"bench_cp_longest_w{W}.csv", rows, COLUMNS)
                print({k: row.get(k) for k in ("shape", "world", "T_total", "fwdbwd_ms", "peak_mib_max", "status")},
                      flush=True)
        return fits

    attempt(min(8192, args.longest_from), record=False)
    fit, fail, t = None, None, args.longest_from
    while quantum // W <= t <= args.longest_max and not over_budget(started, args.budget_s, device):
        if attempt(t):
            fit, t = t, t * 2
            if fail is not None:
                break
        else:
            fail, t = t, t // 2
            if fit is not None:
                break
    for _ in range(args.longest_refine if fit and fail else 0):
        mid = (fit + fail) // 2
        if mid - fit < quantum // W or over_budget(started, args.budget_s, device):
            break
        if attempt(mid):
            fit = mid
        else:
            fail = mid
    return rows


def summarize_longest(out: Path) -> list[dict]:
    """bench_cp_longest.csv: per shape and world size the longest stream that fit, the shortest that did not,
    and the ratio to one GPU's longest."""
    rows = [r for f in sorted(out.glob("bench_cp_longest_w*.csv")) for r in read_csv(f)]
    best: dict[tuple, dict] = {}
    for r in rows:
        k = (r["shape"], int(r["world"]))
        b = best.setdefault(k, {"shape": r["shape"], "world": int(r["world"]), "longest_T": 0, "first_oom_T": "",
                                "fwdbwd_ms": "", "peak_mib_max": ""})
        T = int(r["T_total"])
        if r["status"] == "ok" and T > b["longest_T"]:
            b.update(longest_T=T, fwdbwd_ms=r["fwdbwd_ms"], peak_mib_max=r["peak_mib_max"])
        elif r["status"] == "oom" and (b["first_oom_T"] == "" or T < b["first_oom_T"]):
            b["first_oom_T"] = T
    table = sorted(best.values(), key=lambda b: (b["shape"], b["world"]))
    for b in table:
        one = best.get((b["shape"], 1))
        b["x_one_gpu"] = round(b["longest_T"] / one["longest_T"], 2) if one and one["longest_T"] else ""
    if table:
        write_csv(out / "bench_cp_longest.csv", table)
    return table


def over_budget(started: float, budget_s: float, device) -> bool:
    """Whether the slowest rank has run past the budget (every rank gets the same answer)."""
    t = torch.tensor([time.perf_counter() - started], dtype=torch.float64,
                     device=device if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t) > budget_s


def local_timed(fn, args, device):
    for _ in range(args.warmup):
        fn()
    times = []
    for _ in range(args.iters):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def summarize(out: Path):
    """Merge every bench_cp_w*.csv in out: efficiency against W=1 of the same implementation, and the PNG."""
    rows = [r for f in sorted(out.glob("bench_cp_w*.csv")) for r in read_csv(f)]
    def key(r, impl=None):
        return (impl or r["impl"], r["shape"], r["mode"], int(r["T_total" if r["mode"] == "strong" else "T_local"]))

    base = {key(r): float(r["fwdbwd_ms"]) for r in rows if r["world"] == "1" and r["fwdbwd_ms"]}

    def eff(t1, r):
        W, tw = int(r["world"]), float(r["fwdbwd_ms"])
        return None if t1 is None else (t1 / (W * tw) if r["mode"] == "strong" else t1 / tw)

    summary = []
    for r in rows:
        if not r["fwdbwd_ms"] or r["impl"] not in ("nsa_cp", "nsa_cp_torch", "dense_cp"):
            continue
        # efficiency: against W=1 of the same call (nsa_cp at W=1 is the fused one-GPU call);
        # efficiency_same_compute: against W=1 of what served the ranks (an nsa_cp row whose ranks ran the
        # PyTorch branches is compared with nsa_cp_torch at W=1).
        torch_ranks = r["impl"] == "nsa_cp" and r.get("path") == "torch"
        same = base.get(key(r, "nsa_cp_torch")) if torch_ranks else base.get(key(r))
        summary.append({**{c: r.get(c, "") for c in ("mode", "impl", "shape", "world", "T_total", "T_local",
                                                     "fwd_ms", "bwd_ms", "fwdbwd_ms", "peak_mib_max", "path")},
                        "efficiency": eff(base.get(key(r)), r), "efficiency_same_compute": eff(same, r)})
    write_csv(out / "bench_cp_summary.csv", summary)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench_cp: matplotlib is not installed: no bench_cp.png")
        return summary
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, mode in zip(axes, ("strong", "weak")):
        series = {}
        for s in summary:
            if s["mode"] == mode:
                tokens = int(s["T_total" if mode == "strong" else "T_local"])
                tag = f"{s['impl']} {s['shape']} T={tokens // 1024}k" if tokens >= 1024 else f"{s['impl']} T={tokens}"
                series.setdefault(tag, []).append((int(s["world"]), float(s["fwdbwd_ms"])))
        for tag, pts in sorted(series.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=tag)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("GPUs")
        ax.set_ylabel("forward+backward ms (slowest rank)")
        ax.set_title(f"{mode} scaling" + (" (fixed total tokens)" if mode == "strong" else " (fixed tokens per GPU)"))
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "bench_cp.png", dpi=120)
    return summary


def main(argv=None):
    args = parse_args(argv)
    started = time.perf_counter()
    device, backend = setup(args)
    W, rank = dist.get_world_size(), dist.get_rank()
    spec = ContextParallel(dist.group.WORLD, layout=args.layout)
    cfg = SMOKE_CFG if args.smoke else NSAConfig()
    out = Path(args.out)
    status = 0
    meta = {"env": env_metadata(device), "args": vars(args), "world": W, "process_group_backend": backend,
            "multicast_env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                              "NVSHMEM_DISABLE_NVLS")}}
    if args.check or args.check_only:
        ok, errs = check(args, device, cfg, spec)
        meta["check"] = {"ok": ok, "rel_err": errs, "rank": rank}
        print(f"[rank {rank}] check {'ok' if ok else 'FAILED'}: {errs}", flush=True)
        status = 0 if ok else 1
    rows = []
    if not args.check_only:
        shapes = SMOKE_SHAPES if args.smoke else {s: SHAPES[s] for s in args.shapes.split(",")}
        dtype = torch.float32 if args.smoke else parse_dtype(args.dtype)
        strong = [int(t) for t in args.strong_T.split(",") if t] if not args.smoke else [128]
        weak = [int(t) for t in args.weak_T.split(",") if t] if not args.smoke else [32]
        impls = args.impls.split(",")
        mesh = None
        if device.type == "cuda" and backend == "nccl" and W > 1 and "dense_ring" in impls:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cuda", (W,))
        cases = [(name, shape, "strong", T - T % (2 * W)) for name, shape in shapes.items() for T in strong]
        cases += [(name, shape, "weak", t * W) for name, shape in shapes.items() for t in weak]
        for name, shape, mode, T in cases:
            if over_budget(started, args.budget_s, device):
                rows.append({"mode": mode, "impl": "all", "shape": name, "world": W, "layout": args.layout,
                             "T_total": T, "T_local": T // W, "status": "skipped: time budget"})
                continue
            rows += run_case(args, device, cfg, spec, mode, name, shape, T, dtype, impls, mesh)
            if rank == 0:
                for r in rows[-4:]:
                    print({k: r.get(k) for k in ("mode", "impl", "shape", "world", "T_total", "fwd_ms", "bwd_ms",
                                                 "peak_mib_max", "status")}, flush=True)
    if args.longest and not args.check_only:
        shapes = SMOKE_SHAPES if args.smoke else {s: SHAPES[s] for s in args.shapes.split(",")}
        dtype = torch.float32 if args.smoke else parse_dtype(args.dtype)
        for name, shape in shapes.items():
            longest(args, device, cfg, spec, name, shape, dtype, out, started)
        if rank == 0:
            for b in summarize_longest(out):
                print(f"bench_cp: longest {b['shape']} W={b['world']}: {b['longest_T']} tokens "
                      f"(first out of memory: {b['first_oom_T'] or 'none tried'}; x one GPU: {b['x_one_gpu']})",
                      flush=True)
    meta["telemetry"] = telemetry.snapshot()
    if rank == 0:
        if rows or not args.longest:
            write_csv(out / f"bench_cp_w{W}.csv", rows, COLUMNS)
            write_json(out / f"bench_cp_w{W}.json", {**meta, "rows": rows})
        if rows:
            summarize(out)
        print(f"bench_cp: wrote {out}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
