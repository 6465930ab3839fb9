"""Context parallelism on CPU: 2 and 4 gloo ranks (torch.multiprocessing) against one process.

Each rank holds a slice of the stream (contiguous slices of uneven length, or zigzag), computes its
slice of NSA with cp_group and backpropagates a weighted sum of its outputs. The parent compares the
assembled outputs with the float64 oracle and the q/k/v/gate gradients (and the per-branch K/V
gradients) with the single-process float64 call on the whole stream. One launch per world size runs
every case, so the suite pays the process start-up once.
"""

from __future__ import annotations

import functools
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

from nsa import NSAAttention, nsa_attention, nsa_reference
from nsa.distributed import ContextParallel, shard
from nsa.distributed.cp import pieces_of
from nsa.validation import NSAInputError

from .helpers import SMALL, make_inputs, rel_err

CFG = SMALL["l8d4s8n4"]  # stride 4 < block 8: compressed blocks straddle every rank boundary
CFG_WIDE = SMALL["l16d4s8n5i1l1"]
CFG_MLP = CFG.with_(compress="mlp")

# name -> (world-size-dependent lengths per rank or "zigzag", T, B, cu_seqlens, dtype, branch K/V, config)
CASES = {
    "dense_fp64": ("even", 64, 2, None, torch.float64, False, CFG),
    "dense_fp32": ("even", 64, 1, None, torch.float32, False, CFG),
    "dense_uneven_branch_kv": ("uneven", 100, 1, None, torch.float64, True, CFG_WIDE),
    "packed_fp64": ("uneven", 100, 1, [0, 5, 40, 41, 41, 90, 100], torch.float64, False, CFG),
    "packed_fp32_branch_kv": ("uneven", 100, 1, [0, 37, 38, 100], torch.float32, True, CFG),
    "zigzag_packed_fp64": ("zigzag", 96, 1, [0, 30, 31, 77, 96], torch.float64, False, CFG),
}
UNEVEN = {2: [37, 63], 4: [20, 31, 17, 32]}
# Four ranks on the CI's two cores: the cases that exercise what more ranks change (slices that neither
# start nor end a sequence, zigzag's pairing), to keep the test a few seconds.
CASES_4 = ("dense_fp32", "packed_fp64", "zigzag_packed_fp64")
TOL = {torch.float64: 1e-10, torch.float32: 2e-5}
H_Q, H_KV, D_K, D_V = 4, 2, 8, 6


def _inputs(name):
    kind, T, B, cu, dtype, branch_kv, cfg = CASES[name]
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    q, k, v, g = make_inputs(gen, B, T, H_Q, H_KV, D_K, D_V, dtype=dtype)
    extra = [x.to(dtype) for x in make_inputs(gen, B, T, H_Q, H_KV, D_K, D_V)[1:3]] if branch_kv else []
    extra += [x.to(dtype) for x in make_inputs(gen, B, T, H_Q, H_KV, D_K, D_V)[1:3]] if branch_kv else []
    weight = torch.randn(B, T, H_Q, D_V, generator=gen, dtype=torch.float64).to(dtype)
    cu_t = torch.tensor(cu, dtype=torch.int32) if cu is not None else None
    return [q, k, v, g, *extra], weight, cu_t, cfg


def _lengths(name, W):
    kind, T = CASES[name][0], CASES[name][1]
    if kind == "uneven":
        return UNEVEN[W] if sum(UNEVEN[W]) == T else [T // W] * W
    return [T // W] * W


def _call(tensors, cfg, cu, **kw):
    q, k, v, g, *extra = tensors
    branch = {"kv_cmp": tuple(extra[0:2]), "kv_win": tuple(extra[2:4])} if extra else {}
    return nsa_attention(q, k, v, g, cfg, cu_seqlens=cu, **branch, **kw)


def _cases(world):
    return tuple(CASES) if world == 2 else CASES_4


@functools.cache
def _expected(name):
    """(the oracle's output, the single-process float64 gradients of every input) for a case."""
    tensors, weight, cu, cfg = _inputs(name)
    branch = {"kv_cmp": tuple(tensors[4:6]), "kv_win": tuple(tensors[6:8])} if len(tensors) > 4 else {}
    ref = nsa_reference(*tensors[:4], cfg, cu_seqlens=cu, **branch).out
    leaves = [x.double().requires_grad_() for x in tensors]
    (_call(leaves, cfg, cu, backend="torch") * weight.double()).sum().backward()
    return ref, [x.grad for x in leaves]


def _worker(rank, world, port, outdir):
    torch.set_num_threads(1)  # ranks share the machine's cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        for name in _cases(world):
            tensors, weight, cu, cfg = _inputs(name)
            if CASES[name][0] == "zigzag":
                spec = ContextParallel(dist.group.WORLD, layout="zigzag")
                local = [shard(x, spec) for x in [*tensors, weight]]
            else:
                spec = dist.group.WORLD
                cuts = torch.tensor(_lengths(name, world)).cumsum(0)[:-1].tolist()
                local = [x.tensor_split(cuts, dim=1)[rank] for x in [*tensors, weight]]
            leaves = [x.clone().requires_grad_() for x in local[:-1]]
            out = _call(leaves, cfg, cu, backend="torch", cp_group=spec)
            (out * local[-1]).sum().backward()
            torch.save({"out": out.detach(), "grads": [x.grad for x in leaves]}, os.path.join(outdir, f"{name}.{rank}"))
        # A group of one rank is the plain call: bitwise the same.
        singles = [dist.new_group([r]) for r in range(world)]
        tensors, _, cu, cfg = _inputs("packed_fp64")
        assert torch.equal(_call(tensors, cfg, cu, cp_group=singles[rank]), _call(tensors, cfg, cu))
    finally:
        dist.destroy_process_group()


def _launch(fn, world, *args):
    """Run fn(rank, world, port, *args) on `world` processes. Fork where the platform has it: a spawned
    rank imports torch anew (seconds per rank on a loaded two-core runner), a forked one does not. Spawn
    once this process has initialised CUDA (GPU tests earlier in the same run): a forked child cannot use it,
    and the optimizer's step asks CUDA whether a graph is being captured."""
    fork = "fork" in mp.get_all_start_methods() and not torch.cuda.is_initialized()
    method = "fork" if fork else "spawn"
    mp.start_processes(fn, args=(world, _free_port(), *args), nprocs=world, join=True, start_method=method)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _assemble(parts, name, W):
    """The whole-stream tensor from the ranks' slices (in rank order)."""
    if CASES[name][0] != "zigzag":
        return torch.cat(parts, 1)
    segs, order = pieces_of("zigzag", [parts[0].shape[1]] * W)
    return torch.cat([parts[r][:, s:s + n] for r, s, n in order], 1)


@pytest.mark.parametrize("world", [2, 4])
def test_cp_matches_one_process(world, tmp_path):
    _launch(_worker, world, str(tmp_path))
    for name in _cases(world):
        dtype = CASES[name][4]
        got = [torch.load(tmp_path / f"{name}.{r}") for r in range(world)]
        ref, grads = _expected(name)
        out = _assemble([g["out"] for g in got], name, world)
        assert rel_err(out, ref) < TOL[dtype], (name, rel_err(out, ref))
        # Gradients (q, k, v, gates, then the branch K/V): the single-process float64 call.
        assert len(got[0]["grads"]) == len(grads)
        for i, want in enumerate(grads):
            grad = _assemble([g["grads"][i] for g in got], name, world)
            assert rel_err(grad, want) < 10 * TOL[dtype], (name, i, rel_err(grad, want))


def _module_worker(rank, world, port, outdir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        mod = NSAAttention(16, H_Q, H_KV, D_K, D_V, CFG_MLP).double()
        x = torch.randn(1, 60, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        cu = torch.tensor([0, 23, 60], dtype=torch.int32)
        mesh = init_device_mesh("cpu", (world,))  # a one-dimensional DeviceMesh as the group
        y = mod(x.tensor_split(world, 1)[rank], cu_seqlens=cu, cp_group=mesh)
        y.sum().backward()
        grads = {n: p.grad.clone() for n, p in mod.named_parameters()}
        torch.save({"y": y.detach(), "grads": grads}, os.path.join(outdir, f"mod.{rank}"))
        singles = [dist.new_group([r]) for r in range(world)]
        with torch.no_grad():  # a group of one rank: the plain layer, bitwise
            assert torch.equal(mod(x, cu_seqlens=cu, cp_group=singles[rank]), mod(x, cu_seqlens=cu))
        with pytest.raises(NSAInputError, match="without a cache"):
            mod(x[:, :8], cache=mod.new_cache(1, 16), cp_group=mesh)
        # A rank with no token: every rank raises (none is left waiting in a collective).
        with pytest.raises(NSAInputError, match="at least one token"):
            nsa_attention(*make_inputs(torch.Generator(), 1, 8 if rank == 0 else 0, H_Q, H_KV, D_K, D_V), CFG,
                          cp_group=dist.group.WORLD)
        with pytest.raises(NSAInputError, match="backend must be one of"):
            nsa_attention(*make_inputs(torch.Generator(), 1, 8, H_Q, H_KV, D_K, D_V), CFG, backend="sdpa",
                          cp_group=dist.group.WORLD)
    finally:
        dist.destroy_process_group()


def test_cp_module_matches_one_process(tmp_path):
    """NSAAttention with cp_group (a 1-D DeviceMesh): RoPE at stream positions, per-branch projections, a
    learned compression phi; parameter gradients summed over ranks equal the one-process ones."""
    world = 2
    _launch(_module_worker, world, str(tmp_path))
    got = [torch.load(tmp_path / f"mod.{r}") for r in range(world)]
    torch.manual_seed(0)
    mod = NSAAttention(16, H_Q, H_KV, D_K, D_V, CFG_MLP).double()
    x = torch.randn(1, 60, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = mod(x, cu_seqlens=torch.tensor([0, 23, 60], dtype=torch.int32), backend="torch")
    y.sum().backward()
    assert rel_err(torch.cat([g["y"] for g in got], 1), y) < 1e-10
    # Against the largest gradient of any parameter: some are zero up to rounding (phi_k's output bias
    # shifts every compressed key of a query alike, which the softmax ignores).
    scale = max(float(p.grad.abs().max()) for p in mod.parameters())
    for n, p in mod.named_parameters():
        assert float((sum(g["grads"][n] for g in got) - p.grad).abs().max()) < 1e-10 * scale, n


def test_cp_group_rejects_other_objects():
    with pytest.raises(NSAInputError, match="cp_group must be"):
        nsa_attention(*make_inputs(torch.Generator(), 1, 8, H_Q, H_KV, D_K, D_V), CFG, cp_group="world")
    with pytest.raises(NSAInputError, match="layout must be one of"):
        ContextParallel(None, layout="ring")


def _script_worker(rank, world, port, script, argv):
    """Run a torchrun-style script's main(argv) as rank `rank` (environment as torchrun sets it)."""
    import importlib.util

    torch.set_num_threads(1)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    spec = importlib.util.spec_from_file_location(f"cp_script_{rank}", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(argv) in (None, 0)


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_cp_smoke_two_ranks(tmp_path):
    """bench/bench_cp.py end to end on two gloo ranks: its own check against one process, then every row."""
    _launch(_script_worker, 2, os.path.join(ROOT, "bench", "bench_cp.py"),
            ["--smoke", "--out", str(tmp_path), "--iters", "1", "--warmup", "0"])
    import csv
    import json

    rows = list(csv.DictReader(open(tmp_path / "bench_cp_w2.csv")))
    assert {(r["mode"], r["impl"]) for r in rows if r["status"] == "ok"} >= {
        ("strong", "nsa_cp"), ("strong", "dense_cp"), ("weak", "nsa_cp"), ("weak", "dense_cp")}
    # the rows name what served the ranks (CPU: the PyTorch branches, as the plain call here)
    assert {r["path"] for r in rows if r["impl"].startswith("nsa_cp")} == {"torch"}
    meta = json.loads((tmp_path / "bench_cp_w2.json").read_text())
    assert meta["check"]["ok"] and meta["multicast_env"]["NCCL_NVLS_ENABLE"] == "0"
    assert (tmp_path / "bench_cp_summary.csv").exists()


def test_train_cp_example_fsdp2_two_ranks():
    """examples/train_cp.py with FSDP2 over "dp" and context parallelism over "cp": its step-0 check
    (the split loss equals the one-process loss) raises on a mismatch."""
    _launch(_script_worker, 2, os.path.join(ROOT, "examples", "train_cp.py"),
            ["--dp", "1", "--cp", "2", "--tiny", "--steps", "2"])
