"""Context parallelism for NSA: the sequence split over the ranks of a process group.

Each rank holds a slice of the token stream: its queries, gates, keys and values. Every query may select
blocks anywhere before it and the compressed branch sees every block before it, so each rank all-gathers
the keys and values of the stream,
then computes NSA for its own queries against the stream before them (nsa.distributed.local). The
backward of the gather reduce-scatters the K/V gradients back to the ranks that own those tokens. All
K/V sources of a call travel in one collective each way (nsa.distributed.comm.gather_kv says why).

Slices (`layout`):
- "contiguous": rank r holds one run of tokens, ranks in stream order; runs may differ in length.
- "zigzag": the stream is cut into 2W equal chunks and rank r holds chunks r and 2W-1-r. The compressed
  branch's cost per query grows with its position (t/d blocks), so contiguous slices give the last rank
  the most work; zigzag evens it out (docs/context-parallel.md).

World size 1 is the plain call: no gather, no copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import telemetry
from ..config import NSAConfig
from ..layout import sequence_of
from ..validation import NSAInputError, Shapes, check_block_indices, check_branch_kv, check_cu_seqlens, check_qkv
from .comm import all_gather_ints, gather_kv
from .local import compress_prefix, nsa_local, plan_local

LAYOUTS = ("contiguous", "zigzag")
CP_BACKENDS = ("auto", "torch")


@dataclass(frozen=True)
class ContextParallel:
    """A context-parallel group and how the stream is split over it (see the module doc for `layout`).

    group: a torch.distributed ProcessGroup, a one-dimensional DeviceMesh, or (DeviceMesh, dim name or
    index) for one dimension of a larger mesh.
    """

    group: object
    layout: str = "contiguous"

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise NSAInputError(f"ContextParallel.layout must be one of {LAYOUTS}, got {self.layout!r}")


def resolve(cp_group) -> tuple[object, str]:
    """(ProcessGroup, layout) from what nsa_attention's cp_group accepts."""
    layout = "contiguous"
    if isinstance(cp_group, ContextParallel):
        cp_group, layout = cp_group.group, cp_group.layout
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(cp_group, tuple) and len(cp_group) == 2 and isinstance(cp_group[0], DeviceMesh):
        return cp_group[0].get_group(cp_group[1]), layout
    if isinstance(cp_group, DeviceMesh):
        if cp_group.ndim != 1:
            raise NSAInputError(f"cp_group: a DeviceMesh of {cp_group.ndim} dims needs the dimension to split "
                                f"over: pass (mesh, dim name), e.g. (mesh, 'cp')")
        return cp_group.get_group(), layout
    if isinstance(cp_group, dist.ProcessGroup):
        return cp_group, layout
    raise NSAInputError("cp_group must be a torch.distributed ProcessGroup, a 1-D DeviceMesh, (DeviceMesh, dim) "
                        f"or nsa.distributed.ContextParallel, got {type(cp_group).__name__}")


def pieces_of(layout: str, lengths: list[int]) -> tuple[list[tuple[int, int]], list[tuple[int, int, int]]]:
    """(this layout's segments per rank as (stream offset, length) lists, the stream as (rank, local start,
    length) pieces in stream order), from every rank's local length."""
    W = len(lengths)
    if layout == "contiguous":
        starts = [sum(lengths[:r]) for r in range(W)]
        segs = [[(starts[r], lengths[r])] for r in range(W)]
        return segs, [(r, 0, lengths[r]) for r in range(W)]
    L = lengths[0]
    if any(n != L for n in lengths) or L % 2:
        raise NSAInputError(f"cp layout 'zigzag' needs the same even number of tokens on every rank, got {lengths}")
    c = L // 2
    segs = [[(r * c, c), ((2 * W - 1 - r) * c, c)] for r in range(W)]
    order = sorted((s, r, i * c) for r in range(W) for i, (s, _) in enumerate(segs[r]))
    return segs, [(r, ls, c) for _, r, ls in order]


def shard(x: torch.Tensor, cp_group, dim: int = 1) -> torch.Tensor:
    """This rank's slice of a whole-stream tensor x (tokens along `dim`) under cp_group's layout; for tests,
    examples and data loaders. Contiguous slices split T as evenly as torch.tensor_split does."""
    group, layout = resolve(cp_group)
    W, r = dist.get_world_size(group), dist.get_rank(group)
    T = x.shape[dim]
    if layout == "contiguous":
        return x.tensor_split(W, dim=dim)[r]
    if T % (2 * W):
        raise NSAInputError(f"cp layout 'zigzag' needs T divisible by 2 * world size = {2 * W}, got T={T}")
    parts = x.chunk(2 * W, dim=dim)
    return torch.cat([parts[r], parts[2 * W - 1 - r]], dim=dim)


def positions(cp_group, local_len: int, device, cu_seqlens=None) -> torch.Tensor:
    """Stream positions [T_local] of this rank's tokens, or with cu_seqlens each token's position within
    its sequence (what RoPE needs). One small collective (the ranks' lengths)."""
    group, layout = resolve(cp_group)
    if dist.get_world_size(group) == 1:  # no collective (and no host sync) for a group of one
        segs = [(0, local_len)]
    else:
        lengths = [n for (n,) in all_gather_ints([local_len], group, device)]
        segs = pieces_of(layout, lengths)[0][dist.get_rank(group)]
    tok = torch.cat([torch.arange(s, s + n, device=device) for s, n in segs])
    if cu_seqlens is None:
        return tok
    cu = cu_seqlens.long()
    seq = sequence_of(cu, tok).clamp(max=cu.numel() - 2)
    return tok - cu[seq]


def single_rank(cp_group) -> bool:
    """Whether cp_group (anything cp_nsa_attention accepts) has one rank: then the plain call is the result."""
    group, _ = resolve(cp_group)
    return dist.get_world_size(group) == 1


def cp_nsa_attention(q, k, v, gates, config: NSAConfig, *, cp_group, cu_seqlens=None, block_indices=None,
                     return_indices=False, backend="auto", kv_cmp=None, kv_win=None, compress_fn=None,
                     chunk_size=None):
    """nsa_attention over a sequence split across cp_group's ranks; arguments as nsa.nsa_attention, every
    tensor being this rank's slice except cu_seqlens (int32 offsets of the whole stream, on every rank).
    Returns this rank's slice of the output (and of the indices). nsa_attention and NSAAttention take the
    plain path for a group of one rank (single_rank) before they come here: this module sits above neither."""
    group, layout = resolve(cp_group)
    if not isinstance(config, NSAConfig):
        raise NSAInputError(f"config must be an nsa.NSAConfig, got {type(config).__name__}")
    if backend not in CP_BACKENDS:
        raise NSAInputError(f"with cp_group, backend must be one of {CP_BACKENDS} (each rank runs the fused "
                            f"kernels or the chunked PyTorch branches at a query offset), got {backend!r}")
    local = check_qkv(q, k, v, gates)
    for name, kv in (("kv_cmp", kv_cmp), ("kv_win", kv_win)):
        if kv is not None:
            check_branch_kv(name, kv, k, v)
    if config.compress == "mlp" and compress_fn is None:
        raise NSAInputError("config.compress='mlp' needs compress_fn=(phi_k, phi_v); 'avg' needs none")
    if block_indices is not None:
        check_block_indices(block_indices, local, config.n_sel, q.device)
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise NSAInputError(f"chunk_size must be a positive int or None, got {chunk_size!r}")

    rank = dist.get_rank(group)
    # Every rank sees every rank's sizes, so a mismatch raises the same error on all of them (rather than
    # leaving the others waiting in a collective).
    info = all_gather_ints([local.T, local.B, local.Hq, local.Hkv, local.Dk, local.Dv], group, q.device)
    if any(row[1:] != info[0][1:] for row in info):
        raise NSAInputError("every rank must pass the same B, Hq, Hkv, Dk, Dv; got "
                            f"{[tuple(row[1:]) for row in info]} per rank")
    lengths = [row[0] for row in info]
    if 0 in lengths:
        raise NSAInputError(f"with cp_group every rank must hold at least one token, got lengths {lengths}")
    segs, pieces = pieces_of(layout, lengths)
    total = sum(lengths)
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, Shapes(local.B, total, local.Hq, local.Hkv, local.Dk, local.Dv), q.device)
    # The fused kernels per rank where planning takes them for the plain call of this rank's tensors.
    plan, path, reason = plan_local(backend, q, k, v, config, kv_cmp, kv_win, cu_seqlens, block_indices is not None)
    telemetry.record("cp", path, reason, layout=layout)

    srcs = [k, v] + list(kv_cmp or ()) + list(kv_win or ())
    whole = gather_kv(srcs, group, max(lengths), pieces)
    kf, vf = whole[0], whole[1]
    kcf = tuple(whole[2:4]) if kv_cmp is not None else (kf, vf)
    win = tuple(whole[-2:]) if kv_win is not None else None

    end = max(s + n for s, n in segs[rank])
    compressed = compress_prefix(*kcf, config, end, local.B, cu_seqlens, compress_fn)
    outs, idxs, c0 = [], [], 0
    for s, n in segs[rank]:
        bi = block_indices[:, c0:c0 + n] if block_indices is not None else None
        o, idx = nsa_local(q[:, c0:c0 + n], gates[:, c0:c0 + n], kf, vf, config, s, cu_seqlens=cu_seqlens,
                           kv_win=win, compressed=compressed, prefix_end=end, block_indices=bi,
                           need_indices=return_indices, chunk=chunk_size, plan=plan)
        outs.append(o)
        idxs.append(idx)
        c0 += n
    out = torch.cat(outs, 1) if len(outs) > 1 else outs[0]
    if not return_indices:
        return out
    return out, (torch.cat(idxs, 1) if len(idxs) > 1 else idxs[0])
