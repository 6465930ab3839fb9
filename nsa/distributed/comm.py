"""Collectives of context parallelism: an all-gather of sequence slices whose backward reduce-scatters.

`gather(x, group, max_len)` pads x [B, L, ...] to max_len tokens and all-gathers it into
[W, B, max_len, ...]. The gradient of that buffer is summed over ranks and scattered back
(reduce-scatter): each rank receives d(sum of every rank's loss)/d(its own slice), what a single
process computing the whole sequence gets.

Gloo does not serve CUDA tensors for these collectives: they are staged through host memory, counted
in nsa.telemetry as event ("cp", "gloo", "host_staging").
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import telemetry

# all_gather_single / reduce_scatter_single replace the *_tensor names in newer torch releases.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def needs_staging(group, device: torch.device) -> bool:
    return device.type != "cpu" and dist.get_backend(group) == "gloo"


def all_gather_ints(values: list[int], group, device: torch.device) -> list[list[int]]:
    """Every rank's list of small ints (same length on every rank), in rank order: one tiny collective."""
    W = dist.get_world_size(group)
    dev = torch.device("cpu") if needs_staging(group, device) else device
    mine = torch.tensor(values, dtype=torch.int64, device=dev)
    out = torch.empty(W * len(values), dtype=torch.int64, device=dev)
    _all_gather(out, mine, group=group)
    return out.view(W, len(values)).tolist()


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, max_len):
        ctx.group, ctx.length = group, x.shape[1]
        W = dist.get_world_size(group)
        if x.shape[1] < max_len:
            pad = x.new_zeros(x.shape[0], max_len - x.shape[1], *x.shape[2:])
            x = torch.cat([x, pad], 1)
        x = x.contiguous()
        if needs_staging(group, x.device):
            telemetry.event("cp", "gloo", "host_staging")
            host = torch.empty(W * x.numel(), dtype=x.dtype)
            _all_gather(host, x.cpu().view(-1), group=group)
            return host.view(W, *x.shape).to(x.device)
        # Flat buffers: backends differ in the shapes they accept, never for 1-D ones.
        buf = x.new_empty(W * x.numel())
        _all_gather(buf, x.view(-1), group=group)
        return buf.view(W, *x.shape)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        if needs_staging(ctx.group, grad.device):
            telemetry.event("cp", "gloo", "host_staging")
            host = torch.empty(grad[0].numel(), dtype=grad.dtype)
            _reduce_scatter(host, grad.cpu().view(-1), group=ctx.group)
            out = host.view(grad.shape[1:]).to(grad.device)
        else:
            out = grad.new_empty(grad[0].numel())
            _reduce_scatter(out, grad.view(-1), group=ctx.group)
            out = out.view(grad.shape[1:])
        return out[:, :ctx.length], None, None


def gather(x: torch.Tensor, group, max_len: int) -> torch.Tensor:
    """Every rank's x [B, L_r, ...] padded to max_len tokens: [W, B, max_len, ...] (differentiable)."""
    return _Gather.apply(x, group, max_len)


def gather_kv(tensors, group, max_len: int, pieces) -> list[torch.Tensor]:
    """The whole stream of each [B, L, H, D] tensor (same dtype), in ONE collective each way.

    One collective, not one per tensor: the backward then has a single reduce-scatter node per call, so
    every rank issues its collectives in the same order whatever order autograd runs independent nodes
    in (per-tensor nodes could be reached in a different order on ranks whose graphs differ in size)."""
    widths = [t.shape[2] * t.shape[3] for t in tensors]
    flat = torch.cat([t.flatten(2) for t in tensors], -1) if len(tensors) > 1 else tensors[0].flatten(2)
    whole = assemble(gather(flat, group, max_len), pieces)
    parts = whole.split(widths, -1) if len(tensors) > 1 else (whole,)
    return [p.unflatten(2, t.shape[2:]) for p, t in zip(parts, tensors)]


def assemble(buf: torch.Tensor, pieces) -> torch.Tensor:
    """The stream [B, T, ...] from a gathered buffer [W, B, Lmax, ...]; pieces: (rank, start, length) in
    stream order. The common case (every rank one whole slice, rank order, B == 1) is a view."""
    W, B, Lmax = buf.shape[:3]
    whole = len(pieces) == W and all(p == (r, 0, Lmax) for r, p in enumerate(pieces))
    if whole:
        return buf.movedim(0, 1).reshape(B, W * Lmax, *buf.shape[3:])
    return torch.cat([buf[r, :, s:s + n] for r, s, n in pieces], 1)
