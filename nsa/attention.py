"""NSAAttention: the NSA layer as an nn.Module (projections, RoPE, compression phi, gates, output).

One `forward(x, cache=None)` serves training (no cache), prefill (empty cache) and decode (a cache that
already holds the prefix). Following the paper, each branch has its own key/value projections
(`shared_kv=True` shares one pair). RoPE is applied to queries and to every branch's raw keys; the
compressed keys are then compressed from the rotated keys (a documented choice: docs/semantics.md).
"""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import nn

from . import telemetry
from .cache import NSACache
from .compiling import compiling, trace_constant
from .config import NSAConfig
from .decode import nsa_decode, nsa_prefill
from .functional import nsa_attention
from .layout import sequence_of
from .validation import NSAInputError

BRANCHES = ("cmp", "sel", "win")


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (half-split convention). x [B, T, H, D] with D even, positions [B or 1, T].

    On CUDA one Triton pass (nsa.kernels.triton.rope: cos/sin once per token and frequency for every head; the
    `nsa::rope` operator under torch.compile), counted as a ("rope", "triton", "rotate") event; elsewhere, or
    where Triton does not import (a ("rope", "torch", "no_triton") event), the torch formula (rope_torch).
    Both agree to fp32 rounding."""
    half = x.shape[-1] // 2
    freqs = theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    if x.is_cuda:
        if rope_kernel_imports():
            telemetry.event("rope", "triton", "rotate")
            if compiling():
                return torch.ops.nsa.rope(x, positions, freqs, False)
            return _Rope.apply(x, positions, freqs)
        telemetry.event("rope", "torch", "no_triton")
    return rope_torch(x, positions, freqs)


@trace_constant
@lru_cache(maxsize=1)
def rope_kernel_imports() -> bool:
    """Whether the Triton rope kernel imports here (triton installed and importable)."""
    try:
        from .kernels.triton import rope as _  # noqa: F401
    except ImportError:
        return False
    from .kernels import ops as _ops  # noqa: F401 - registers nsa::rope
    return True


class _Rope(torch.autograd.Function):
    """Eager mode's rope kernel with its backward (the rotation by minus the angle); no operator dispatch."""

    @staticmethod
    def forward(ctx, x, positions, freqs):
        from .kernels.triton.rope import rope_apply

        ctx.save_for_backward(positions, freqs)
        return rope_apply(x, positions, freqs)

    @staticmethod
    def backward(ctx, dy):
        from .kernels.triton.rope import rope_apply

        positions, freqs = ctx.saved_tensors
        return rope_apply(dy, positions, freqs, inverse=True), None, None


def rope_torch(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """The rotary embedding in torch ops (freqs [D/2] fp32, as rope computes them)."""
    angles = positions.to(torch.float32)[..., None] * freqs  # [B, T, half]
    half = freqs.shape[0]
    cos, sin = angles.cos()[:, :, None, :], angles.sin()[:, :, None, :]
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


class CompressMLP(nn.Module):
    """phi of the paper: a learnable intra-block position encoding, then an MLP over the l tokens of a block.

    Input [N, l, H, D] -> [N, H, D]; the weights are shared across heads.
    """

    def __init__(self, block: int, head_dim: int, hidden: int | None = None):
        super().__init__()
        hidden = hidden or 2 * head_dim
        self.pos = nn.Parameter(torch.zeros(block, head_dim))
        self.mlp = nn.Sequential(nn.Linear(block * head_dim, hidden), nn.GELU(), nn.Linear(hidden, head_dim))
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, blocks: torch.Tensor) -> torch.Tensor:
        N, l, H, D = blocks.shape
        x = blocks + self.pos[None, :, None, :].to(blocks.dtype)
        x = x.permute(0, 2, 1, 3).reshape(N, H, l * D)
        return self.mlp(x.to(self.mlp[0].weight.dtype)).to(blocks.dtype)


class NSAAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, d_k: int, d_v: int,
                 config: NSAConfig | None = None, *, shared_kv: bool = False, rope_theta: float | None = 10000.0,
                 gate_hidden: int | None = None, backend: str = "auto", bias: bool = False,
                 decode_backend: str | None = None, cp_group=None):
        super().__init__()
        self.cp_group = cp_group  # context parallelism (docs/context-parallel.md); forward may override it
        if n_heads % n_kv_heads:
            raise NSAInputError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
        if rope_theta is not None and d_k % 2:
            raise NSAInputError(f"d_k must be even for RoPE, got {d_k} (pass rope_theta=None to disable RoPE)")
        self.config = config or NSAConfig()
        self.n_heads, self.n_kv_heads, self.d_k, self.d_v = n_heads, n_kv_heads, d_k, d_v
        self.rope_theta = rope_theta
        self.backend = backend
        self.decode_backend = decode_backend
        self.shared_kv = shared_kv
        self.q_proj = nn.Linear(dim, n_heads * d_k, bias=bias)
        kv_names = ("sel",) if shared_kv else BRANCHES
        self.k_proj = nn.ModuleDict({b: nn.Linear(dim, n_kv_heads * d_k, bias=bias) for b in kv_names})
        self.v_proj = nn.ModuleDict({b: nn.Linear(dim, n_kv_heads * d_v, bias=bias) for b in kv_names})
        if gate_hidden:
            self.gate = nn.Sequential(nn.Linear(dim, gate_hidden), nn.SiLU(), nn.Linear(gate_hidden, n_heads * 3))
        else:
            self.gate = nn.Linear(dim, n_heads * 3)
        if self.config.compress == "mlp":
            self.phi_k = CompressMLP(self.config.block_cmp, d_k)
            self.phi_v = CompressMLP(self.config.block_cmp, d_v)
        self.o_proj = nn.Linear(n_heads * d_v, dim, bias=bias)

    def _cache_env_vars(self) -> None:
        """Kept for the seeds' runbook, which calls it to refresh flags: there is nothing to refresh here,
        every NSA_* toggle is read at call time (nsa.toggles)."""

    def compress_fn(self):
        return (self.phi_k, self.phi_v) if self.config.compress == "mlp" else None

    def new_cache(self, batch: int, max_len: int, *, device=None, dtype=None) -> NSACache:
        w = self.q_proj.weight
        return NSACache(self.config, batch, max_len, self.n_kv_heads, self.d_k, self.d_v,
                        device=device or w.device, dtype=dtype or w.dtype)

    def _positions(self, B, T, cu_seqlens, device):
        """Prompt positions [B or 1, T]: 0.. per row, or per packed sequence with cu_seqlens."""
        if cu_seqlens is None:
            return torch.arange(T, device=device)[None].expand(B, T)
        tokens = torch.arange(T, device=device)
        cu = cu_seqlens.long()
        seq = sequence_of(cu, tokens).clamp(max=cu.numel() - 2)
        return (tokens - cu[seq])[None]

    def project(self, x, positions):
        """q [B,T,Hq,Dk], per-branch (k, v) dict, gates [B,T,Hq,3]."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.d_k)
        kv = {}
        for b in self.k_proj:
            k = self.k_proj[b](x).view(B, T, self.n_kv_heads, self.d_k)
            v = self.v_proj[b](x).view(B, T, self.n_kv_heads, self.d_v)
            kv[b] = (rope(k, positions, self.rope_theta) if self.rope_theta else k, v)
        if self.rope_theta:
            q = rope(q, positions, self.rope_theta)
        if self.shared_kv:
            kv = {b: kv["sel"] for b in BRANCHES}
        gates = torch.sigmoid(self.gate(x)).view(B, T, self.n_heads, 3).to(q.dtype)
        return q, kv, gates

    def forward(self, x: torch.Tensor, cache: NSACache | None = None, *, cu_seqlens=None,
                backend: str | None = None, cp_group=None) -> torch.Tensor:
        """x [B, T, dim] -> [B, T, dim]. With a cache: prefill when it is empty, else decode T new tokens.

        Prefill of prompts of different lengths: x [1, total, dim] packed with cu_seqlens (int32
        [batch + 1]) into an empty cache of that batch; decode then takes x [batch, T, dim], each sequence
        at its own position (cache.cache_seqlens). Packed input into a cache that holds tokens appends
        cu_seqlens[b+1] - cu_seqlens[b] tokens to row b (a prompt for a freed row of a paged cache, a chunk
        of a prompt): nsa_prefill's append. `backend` (else the module's) routes the prefill; decode
        uses it too unless the module has a `decode_backend` (decode takes "auto", "torch", "triton").
        cp_group (else the module's): x is this rank's slice of a sequence split over the group's ranks
        (training and prefill without a cache; docs/context-parallel.md).
        """
        if x.dim() != 3:
            raise NSAInputError(f"x must be [B, T, dim], got shape {tuple(x.shape)}")
        cp_group = cp_group if cp_group is not None else self.cp_group
        if cp_group is not None:
            if cache is not None:
                raise NSAInputError("cp_group splits a sequence for training or prefill without a cache; "
                                    "decode with a cache runs on one rank (pass cache=None or no cp_group)")
            from .distributed import single_rank
            from .distributed.module import cp_forward

            if not single_rank(cp_group):  # one rank: the plain layer below
                return cp_forward(self, x, cp_group, cu_seqlens=cu_seqlens, backend=backend or self.backend)
        B, T, _ = x.shape
        decoding = cache is not None and not cache.is_empty
        appending = decoding and cu_seqlens is not None  # packed new tokens per row, appended (nsa_prefill)
        if appending:
            positions = self._positions(B, T, cu_seqlens, x.device)
            seq = sequence_of(cu_seqlens.long(), torch.arange(T, device=x.device))
            positions = positions + cache.cache_seqlens.long()[seq.clamp(max=cache.batch - 1)][None]
        elif decoding:
            positions = cache.cache_seqlens.long()[:, None] + torch.arange(T, device=x.device)
        else:
            positions = self._positions(B, T, cu_seqlens, x.device)
        q, kv, gates = self.project(x, positions)
        k, v = kv["sel"]
        branch_kv = dict(kv_cmp=kv["cmp"], kv_win=kv["win"], compress_fn=self.compress_fn())
        prefill_backend = backend or self.backend
        if cache is None:
            out = nsa_attention(q, k, v, gates, self.config, cu_seqlens=cu_seqlens, backend=prefill_backend,
                                **branch_kv)
        elif not decoding or appending:
            out = nsa_prefill(q, k, v, gates, cache, cu_seqlens=cu_seqlens, backend=prefill_backend, **branch_kv)
        else:
            step_backend = backend or self.decode_backend or self.backend
            steps = []
            for t in range(T):  # decode: one token per sequence at a time through the cache
                one = slice(t, t + 1)
                steps.append(nsa_decode(q[:, one], k[:, one], v[:, one], gates[:, one], cache,
                                        kv_cmp=tuple(x_[:, one] for x_ in kv["cmp"]),
                                        kv_win=tuple(x_[:, one] for x_ in kv["win"]),
                                        compress_fn=self.compress_fn(), backend=step_backend))
            out = torch.cat(steps, dim=1) if T > 1 else steps[0]
        return self.o_proj(out.flatten(2))
