"""Where each token's sequence starts and where each compressed block lies, for dense and packed input.

Dense input [B, T] is B sequences starting at position 0. Packed input (cu_seqlens, B == 1) holds many
sequences along T. Everything is computed on the device from the offsets with static shapes, so the
forward never waits on the host: compressed-block "slots" are allotted per sequence by prefix sums, with
an upper bound on their number that depends on T alone.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .compiling import compiling
from .config import NSAConfig


@dataclass
class SeqLayout:
    seq_start: torch.Tensor  # [B, T] global index of the first token of each token's sequence
    cmp_start: torch.Tensor  # [B, Nc] global index of each compressed block's first token
    cmp_local: torch.Tensor  # [B, Nc] that start relative to its sequence (i * stride_cmp)
    cmp_valid: torch.Tensor  # [B, Nc] bool: the slot holds a real block
    n_sel_blocks: int  # upper bound on selection blocks of any one sequence
    cmp_slot0: torch.Tensor  # [B, T] slot of block 0 of each token's sequence (its blocks follow in order)
    packed: bool = False  # built from cu_seqlens (else slot i is block i of every batch row)

    @functools.cached_property
    def seq_start_i32(self) -> torch.Tensor:
        """seq_start as int32, what the Triton kernels read (made once per layout: reused layouts skip the copy)."""
        return self.seq_start.to(torch.int32)

    @property
    def n_cmp(self) -> int:
        return self.cmp_start.shape[1]

    def cmp_visible_bound(self, stop: int, cfg: NSAConfig) -> int:
        """Slots [0, bound) hold every block visible to a query before global position `stop`.

        A block ending at or before stop-1 starts at or before stop-l; slots are allotted in order of
        position and a sequence of length L has at most L // d of them, so slot index <= (stop - l) // d.
        """
        if stop < cfg.block_cmp:
            return 0
        return min(self.n_cmp, (stop - cfg.block_cmp) // cfg.stride_cmp + 1)


def dense_layout(B: int, T: int, cfg: NSAConfig, device) -> SeqLayout:
    """The layout of B sequences of T tokens. Layouts are read, never written, so the last few are reused
    (about 45 us of host time per call, before the GPU's first kernel); not inside torch.inference_mode,
    whose tensors could not serve a later call that records autograd. Under torch.compile the layout is
    part of the graph (a few small tensors the compiler builds or folds), so nothing is cached."""
    if compiling() or torch.is_inference_mode_enabled():
        return _dense_layout(B, T, cfg, torch.device(device))
    return _dense_layout_cached(B, T, cfg, torch.device(device))


def _dense_layout(B: int, T: int, cfg: NSAConfig, device: torch.device) -> SeqLayout:
    n = cfg.n_cmp_blocks(T)
    start = (torch.arange(n, device=device) * cfg.stride_cmp).expand(B, n)
    return SeqLayout(
        seq_start=torch.zeros(B, T, dtype=torch.long, device=device),
        cmp_start=start,
        cmp_local=start,
        cmp_valid=torch.ones(B, n, dtype=torch.bool, device=device),
        n_sel_blocks=cfg.n_sel_blocks(T),
        cmp_slot0=torch.zeros(1, 1, dtype=torch.long, device=device).expand(B, T),
    )


_dense_layout_cached = functools.lru_cache(maxsize=8)(_dense_layout)


def sequence_of(cu: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The index of the sequence that holds each stream position (positions >= 0; cu: the int64 offsets, S + 1
    of them): the number of sequence starts at or before it, minus one (S for a position past the end).
    Searched over the whole cu, not cu[1:]: torch 2.11's Inductor cannot lower searchsorted over a slice."""
    return torch.searchsorted(cu, positions, right=True) - 1


def packed_layout(cu_seqlens: torch.Tensor, T: int, cfg: NSAConfig) -> SeqLayout:
    device = cu_seqlens.device
    cu = cu_seqlens.long()
    lengths = cu[1:] - cu[:-1]
    tokens = torch.arange(T, device=device)
    seq_of_token = sequence_of(cu, tokens)
    seq_start = cu[seq_of_token.clamp(max=len(lengths) - 1)]

    l, d = cfg.block_cmp, cfg.stride_cmp
    counts = torch.where(lengths >= l, torch.div(lengths - l, d, rounding_mode="floor") + 1, 0)
    ends = torch.cumsum(counts, 0)
    n_slots = T // d  # sum over sequences of floor(L / d) bounds the block count
    slots = torch.arange(n_slots, device=device)
    slot_seq = torch.searchsorted(ends, slots, right=True)
    valid = slot_seq < len(lengths)
    slot_seq = slot_seq.clamp(max=len(lengths) - 1)
    block = slots - (ends[slot_seq] - counts[slot_seq])
    local = block * d
    start = torch.where(valid, cu[slot_seq] + local, torch.zeros_like(local))
    return SeqLayout(
        seq_start=seq_start[None],
        cmp_start=start[None],
        cmp_local=torch.where(valid, local, torch.zeros_like(local))[None],
        cmp_valid=valid[None],
        n_sel_blocks=cfg.n_sel_blocks(T),
        cmp_slot0=(ends - counts)[seq_of_token.clamp(max=len(lengths) - 1)][None],
        packed=True,
    )


def gather_blocks(x: torch.Tensor, starts: torch.Tensor, length: int) -> torch.Tensor:
    """x [B, T, H, D], starts [B, N] -> [B, N, length, H, D] (indices clamped into range)."""
    B, T = x.shape[:2]
    idx = (starts[..., None] + torch.arange(length, device=x.device)).clamp_(0, max(T - 1, 0))
    batch = torch.arange(B, device=x.device)[:, None, None]
    return x[batch, idx]
