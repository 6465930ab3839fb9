"""Train a small NSA language model with context parallelism and FSDP2 on a 2-D device mesh (dp, cp).

    # 8 GPUs: 2-way data parallel (FSDP2) x 4-way context parallel, 64k-token sequences
    torchrun --standalone --nproc_per_node 8 examples/train_cp.py --dp 2 --cp 4 --seq-len 65536
    # CPU, gloo, two processes, tiny (what the CPU tests run)
    torchrun --standalone --nproc_per_node 2 examples/train_cp.py --dp 1 --cp 2 --tiny --steps 3

Mesh dimension "cp" splits every sequence: each rank embeds its slice of the tokens, every NSAAttention
runs with cp_group=(mesh, "cp") (K/V all-gathered over "cp", their gradients reduce-scattered back) and
the loss is the sum of the rank's token losses over the whole batch's token count, so the ranks' losses
add up to the loss of the whole sequence. Mesh dimension "dp" holds different sequences; FSDP2
(fully_shard) shards the parameters over it and averages gradients across it. The "cp" ranks hold the
same parameter shards and see different tokens: their gradients are summed over "cp" after backward.

Step 0 checks the split: the loss equals the one-process loss of the whole sequences (a replica without
cp_group on every rank; --no-check skips it).
"""

from __future__ import annotations

import os

os.environ.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"})

import argparse  # noqa: E402
import copy  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

from nsa import NSAConfig  # noqa: E402
from nsa.distributed import shard  # noqa: E402
from nsa.model.llama_block_nsa import TinyNSALM  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dp", type=int, default=1, help="data-parallel (FSDP2) ranks")
    p.add_argument("--cp", type=int, default=None, help="context-parallel ranks (default: world size / dp)")
    p.add_argument("--seq-len", type=int, default=16384, help="tokens per sequence (split over the cp ranks)")
    p.add_argument("--batch", type=int, default=1, help="sequences per dp rank")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--tiny", action="store_true", help="tiny model and blocks, fp32, CPU over gloo")
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=True)
    return p.parse_args(argv)


def cp_loss(model, tokens, cp_mesh, n_total):
    """Sum of this rank's next-token losses / the whole batch's token count (the cp ranks' losses add up to
    the mean loss of the whole sequences). tokens [B, T + 1] whole; this rank takes its slice."""
    inputs, targets = shard(tokens[:, :-1], cp_mesh), shard(tokens[:, 1:], cp_mesh)
    logits = model(inputs)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum") / n_total


def main(argv=None):
    args = parse_args(argv)
    cpu = args.tiny or not torch.cuda.is_available()
    if not cpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("gloo" if cpu else "nccl")
    world, rank = dist.get_world_size(), dist.get_rank()
    cp = args.cp or world // args.dp
    if args.dp * cp != world:
        raise SystemExit(f"--dp {args.dp} x --cp {cp} must equal the world size {world}")
    device = torch.device("cpu") if cpu else torch.device("cuda", torch.cuda.current_device())
    mesh = init_device_mesh(device.type, (args.dp, cp), mesh_dim_names=("dp", "cp"))
    cp_mesh = (mesh, "cp")

    if args.tiny:
        cfg = NSAConfig(block_cmp=8, stride_cmp=4, block_sel=8, n_sel=4, window=16)
        dims = dict(vocab=64, dim=32, n_layers=2, n_heads=4, n_kv_groups=2, d_k=16, d_v=8)
        seq_len, dtype = 32 * cp, torch.float32
    else:
        cfg = NSAConfig()
        dims = dict(vocab=32000, dim=1024, n_layers=4, n_heads=16, n_kv_groups=2, d_k=128, d_v=128)
        seq_len, dtype = args.seq_len, torch.bfloat16
    torch.manual_seed(0)  # the same initial weights on every rank
    model = TinyNSALM(config=cfg, **dims).to(device, dtype)
    reference = copy.deepcopy(model) if args.check else None
    for blk in model.blocks:
        blk.attn.cp_group = cp_mesh  # every attention layer splits the sequence over "cp"

    from torch.distributed.fsdp import fully_shard

    for blk in model.blocks:
        fully_shard(blk, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    cp_group = mesh.get_group("cp")

    # Each dp rank draws its own sequences; the cp ranks of one dp rank share them.
    gen = torch.Generator().manual_seed(1000 + mesh.get_local_rank("dp"))
    for step in range(args.steps):
        tokens = torch.randint(0, dims["vocab"], (args.batch, seq_len + 1), generator=gen).to(device)
        loss = cp_loss(model, tokens, cp_mesh, args.batch * seq_len)
        loss.backward()
        # The cp ranks computed gradients of different tokens of the same loss: sum them.
        for p in model.parameters():
            if p.grad is not None:
                g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                dist.all_reduce(g, group=cp_group)
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total, group=cp_group)  # the whole sequences' loss on this dp rank
        if step == 0 and reference is not None:
            with torch.no_grad():
                logits = reference(tokens[:, :-1])
                want = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
            err = abs(float(total) - float(want)) / max(abs(float(want)), 1e-12)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            print(f"[rank {rank}] step 0 loss {float(total):.6f}, one process {float(want):.6f}, rel err {err:.2e}",
                  flush=True)
            if err > tol:
                raise SystemExit(f"context-parallel loss differs from the one-process loss: rel err {err:.2e}")
            reference = None
        if rank == 0:
            print(f"step {step}: loss {float(total):.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
