"""LlamaBlockNSA (the block the seed documents call) and TinyNSALM, a tiny multi-layer NSA language model.

Both take the same `cache` convention as NSAAttention: no cache = training (full causal NSA over the
input); an empty cache = prefill; a cache that already holds a prefix = decode of the new tokens.

    blk = LlamaBlockNSA(dim=256, n_heads=8, n_kv_groups=2, d_k=32, d_v=32)
    y = blk(torch.randn(1, 128, 256))

`n_kv_groups` is the number of KV heads (GQA groups): query head h reads KV head h // (n_heads / n_kv_groups).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import NSAAttention
from ..cache import NSACache
from ..config import NSAConfig
from ..validation import NSAInputError


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, the statistics in float32 (bf16-safe), the result in x's dtype."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return y.to(x.dtype) * self.weight.to(x.dtype)


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x), hidden = mlp_ratio * dim rounded up to a multiple of `multiple_of`."""

    def __init__(self, dim: int, mlp_ratio: float = 8 / 3, multiple_of: int = 16, bias: bool = False):
        super().__init__()
        hidden = int(mlp_ratio * dim)
        hidden = multiple_of * -(-hidden // multiple_of)
        self.hidden = hidden
        self.w1 = nn.Linear(dim, hidden, bias=bias)
        self.w3 = nn.Linear(dim, hidden, bias=bias)
        self.w2 = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlockNSA(nn.Module):
    """Pre-norm transformer block: h = x + attn(norm(x), cache); out = h + mlp(norm(h))."""

    def __init__(self, dim: int, n_heads: int, n_kv_groups: int, d_k: int, d_v: int, *,
                 config: NSAConfig | None = None, mlp_ratio: float = 8 / 3, shared_kv: bool = False,
                 backend: str = "auto", rope_theta: float | None = 10000.0, norm_eps: float = 1e-6,
                 decode_backend: str | None = None):
        super().__init__()
        if n_heads % n_kv_groups:
            raise NSAInputError(f"n_heads ({n_heads}) must be a multiple of n_kv_groups ({n_kv_groups})")
        self.dim = dim
        self.attn_norm = RMSNorm(dim, norm_eps)
        self.attn = NSAAttention(dim, n_heads, n_kv_groups, d_k, d_v, config, shared_kv=shared_kv,
                                 rope_theta=rope_theta, backend=backend, decode_backend=decode_backend)
        self.mlp_norm = RMSNorm(dim, norm_eps)
        self.mlp = SwiGLU(dim, mlp_ratio)

    @property
    def config(self) -> NSAConfig:
        return self.attn.config

    def new_cache(self, batch: int, max_len: int, *, device=None, dtype=None) -> NSACache:
        return self.attn.new_cache(batch, max_len, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, cache: NSACache | None = None, *, cu_seqlens=None) -> torch.Tensor:
        """x [B, T, dim]; cu_seqlens: documents packed along T (B == 1), as in NSAAttention.forward."""
        h = x + self.attn(self.attn_norm(x), cache, cu_seqlens=cu_seqlens)
        return h + self.mlp(self.mlp_norm(h))


class TinyNSALM(nn.Module):
    """Embedding -> n_layers x LlamaBlockNSA -> RMSNorm -> LM head. For smoke runs, tests and benches."""

    def __init__(self, vocab: int, dim: int, n_layers: int, n_heads: int, n_kv_groups: int, d_k: int, d_v: int,
                 config: NSAConfig | None = None, *, mlp_ratio: float = 8 / 3, shared_kv: bool = False,
                 backend: str = "auto", tie_embeddings: bool = False, rope_theta: float | None = 10000.0,
                 decode_backend: str | None = None):
        super().__init__()
        if vocab < 2 or n_layers < 1:
            raise NSAInputError(f"need vocab >= 2 and n_layers >= 1, got vocab={vocab}, n_layers={n_layers}")
        self.vocab = vocab
        self.config = config or NSAConfig()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            LlamaBlockNSA(dim, n_heads, n_kv_groups, d_k, d_v, config=self.config, mlp_ratio=mlp_ratio,
                          shared_kv=shared_kv, backend=backend, rope_theta=rope_theta,
                          decode_backend=decode_backend)
            for _ in range(n_layers))
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tie_embeddings:
            self.head.weight = self.embed.weight
        nn.init.normal_(self.embed.weight, std=0.02)
        self._decode_graphs: dict = {}  # (batch, max_len) -> DecodeGraph (generate(cuda_graph=True))

    # -- caches ---------------------------------------------------------------------------------------
    def new_caches(self, batch: int, max_len: int, *, device=None, dtype=None) -> list[NSACache]:
        """One empty NSACache per layer (buffers in the model's device and dtype unless given)."""
        return [blk.new_cache(batch, max_len, device=device, dtype=dtype) for blk in self.blocks]

    def _check_caches(self, caches) -> int:
        """All layers' caches must hold the same lengths; returns their longest (host bound, no sync)."""
        if len(caches) != len(self.blocks):
            raise NSAInputError(f"caches must hold one NSACache per layer ({len(self.blocks)}), got {len(caches)}")
        bounds = {(c.max_seqlen_bound, c.min_seqlen) for c in caches}
        if len(bounds) != 1:
            raise NSAInputError(f"caches are at different lengths {sorted(bounds)}")
        return bounds.pop()[0]

    # -- forward --------------------------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, caches: list[NSACache] | None = None, *,
                cu_seqlens=None) -> torch.Tensor:
        """tokens [B, T] (int64) -> logits [B, T, vocab]. caches: see the module docstring. cu_seqlens: int32
        offsets of documents packed along T (B == 1); attention stays inside each document."""
        if tokens.dim() != 2:
            raise NSAInputError(f"tokens must be [B, T], got shape {tuple(tokens.shape)}")
        if caches is not None:
            self._check_caches(caches)
        x = self.embed(tokens)
        for i, blk in enumerate(self.blocks):
            x = blk(x, caches[i] if caches is not None else None, cu_seqlens=cu_seqlens)
        return self.head(self.norm(x))

    def prefill(self, tokens: torch.Tensor, caches: list[NSACache]) -> torch.Tensor:
        """Fill empty caches with the prompt; returns the prompt's logits [B, T, vocab]."""
        if self._check_caches(caches) != 0:
            raise NSAInputError("prefill needs empty caches (use forward(tokens, caches) to decode)")
        return self(tokens, caches)

    def decode_step(self, token: torch.Tensor, caches: list[NSACache]) -> torch.Tensor:
        """token [B, 1] -> logits [B, vocab] of that position, appending it to non-empty caches (each sequence
        at its own length)."""
        if self._check_caches(caches) == 0:
            raise NSAInputError("decode_step needs prefilled caches")
        return self(token, caches)[:, -1]

    @staticmethod
    def _pick(logits, greedy, temperature, generator):
        if greedy:
            return logits.argmax(dim=-1, keepdim=True)
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        return torch.multinomial(probs, 1, generator=generator)

    @torch.no_grad()
    def generate(self, tokens: torch.Tensor, max_new_tokens: int, *, greedy: bool = True,
                 temperature: float = 1.0, generator: torch.Generator | None = None,
                 return_logits: bool = False, cuda_graph: bool = False, max_len: int | None = None):
        """Prefill the prompt through fresh caches, then decode one token at a time through them.

        cuda_graph=True (CUDA only): the first decode step runs eagerly (it compiles the kernels), the next
        ones replay one CUDA graph of the whole model step with static input/output buffers. The graph and
        its caches are kept per (batch, max_len) and reused by later calls with the same sizes (max_len:
        cache capacity, default prompt + max_new_tokens); `release_graphs()` frees them.
        Returns tokens [B, T + max_new_tokens] (and, with return_logits, the logits [B, max_new_tokens,
        vocab] each new token was picked from).
        """
        if max_new_tokens < 0:
            raise NSAInputError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        B, T = tokens.shape
        if T < 1:
            raise NSAInputError("generate needs a prompt of at least one token")
        max_len = max_len or T + max_new_tokens
        if max_len < T + max_new_tokens:
            raise NSAInputError(f"max_len={max_len} < prompt ({T}) + max_new_tokens ({max_new_tokens})")
        if cuda_graph:
            if tokens.device.type != "cuda":
                raise NSAInputError(f"cuda_graph=True needs CUDA tensors, got tokens on {tokens.device}")
            runner = self._decode_graphs.get((B, max_len))
            if runner is None:
                runner = self._decode_graphs[(B, max_len)] = DecodeGraph(self, self.new_caches(B, max_len), B)
            runner.reset()
            caches, step = runner.caches, runner.step
        else:
            caches = self.new_caches(B, max_len)

            def step(tok):
                return self.decode_step(tok, caches)

        out, picked = tokens, []
        if max_new_tokens:
            logits = self.prefill(tokens, caches)[:, -1]
            for i in range(max_new_tokens):
                picked.append(logits.clone() if cuda_graph else logits)
                nxt = self._pick(logits, greedy, temperature, generator)
                out = torch.cat([out, nxt], dim=1)
                if i + 1 < max_new_tokens:
                    logits = step(nxt)
        if return_logits:
            empty = tokens.new_zeros(B, 0, self.vocab, dtype=self.head.weight.dtype)
            return out, (torch.stack(picked, dim=1) if picked else empty)
        return out

    def release_graphs(self) -> None:
        """Drop the CUDA graphs (and their caches) kept by generate(cuda_graph=True)."""
        self._decode_graphs.clear()

    @torch.no_grad()
    def generate_uncached(self, tokens: torch.Tensor, max_new_tokens: int, *, return_logits: bool = False):
        """Greedy decoding by recomputing the full forward over the growing sequence (the oracle of generate)."""
        out, picked = tokens, []
        for _ in range(max_new_tokens):
            logits = self(out)[:, -1]
            picked.append(logits)
            out = torch.cat([out, logits.argmax(dim=-1, keepdim=True)], dim=1)
        if return_logits:
            return out, (torch.stack(picked, dim=1) if picked else None)
        return out

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of tokens [B, T] (T >= 2), computed in float32."""
        if tokens.dim() != 2 or tokens.shape[1] < 2:
            raise NSAInputError(f"loss needs tokens [B, T >= 2], got shape {tuple(tokens.shape)}")
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


class DecodeGraph:
    """One CUDA graph of TinyNSALM.decode_step for a fixed batch and caches, with static token/logit buffers.

    The first step runs eagerly (compiling the decode kernels, warming cuBLAS) and then captures the step;
    every later step copies the token into the static buffer and replays. Capture records the kernels
    without running them, so the caches' host-side lengths are put back after capture and advanced by
    one after each replay (the graph itself advances cache_seqlens on the device).
    """

    def __init__(self, model: TinyNSALM, caches: list[NSACache], batch: int):
        self.model = model
        self.caches = caches
        self.token = torch.zeros(batch, 1, dtype=torch.long, device=caches[0].device)
        self.graph = None
        self.logits = None

    def reset(self) -> None:
        for c in self.caches:
            c.reset()

    def step(self, token: torch.Tensor) -> torch.Tensor:
        for c in self.caches:
            c.check_room(1)
        self.token.copy_(token)
        if self.graph is None:
            logits = self.model.decode_step(self.token, self.caches)
            saved = [c.host_state() for c in self.caches]
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.logits = self.model.decode_step(self.token, self.caches)
            for c, state in zip(self.caches, saved):
                c.set_host_state(state)
            self.graph = graph
            return logits
        self.graph.replay()
        for c in self.caches:
            c.commit_step(on_device=False)
        return self.logits
