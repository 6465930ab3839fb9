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
                 backend: str = "auto", rope_theta: float | None = 10000.0, norm_eps: float = 1e-6):
        super().__init__()
        if n_heads % n_kv_groups:
            raise NSAInputError(f"n_heads ({n_heads}) must be a multiple of n_kv_groups ({n_kv_groups})")
        self.dim = dim
        self.attn_norm = RMSNorm(dim, norm_eps)
        self.attn = NSAAttention(dim, n_heads, n_kv_groups, d_k, d_v, config, shared_kv=shared_kv,
                                 rope_theta=rope_theta, backend=backend)
        self.mlp_norm = RMSNorm(dim, norm_eps)
        self.mlp = SwiGLU(dim, mlp_ratio)

    @property
    def config(self) -> NSAConfig:
        return self.attn.config

    def new_cache(self, batch: int, max_len: int, *, device=None, dtype=None) -> NSACache:
        return self.attn.new_cache(batch, max_len, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, cache: NSACache | None = None) -> torch.Tensor:
        h = x + self.attn(self.attn_norm(x), cache)
        return h + self.mlp(self.mlp_norm(h))


class TinyNSALM(nn.Module):
    """Embedding -> n_layers x LlamaBlockNSA -> RMSNorm -> LM head. For smoke runs, tests and benches."""

    def __init__(self, vocab: int, dim: int, n_layers: int, n_heads: int, n_kv_groups: int, d_k: int, d_v: int,
                 config: NSAConfig | None = None, *, mlp_ratio: float = 8 / 3, shared_kv: bool = False,
                 backend: str = "auto", tie_embeddings: bool = False, rope_theta: float | None = 10000.0):
        super().__init__()
        if vocab < 2 or n_layers < 1:
            raise NSAInputError(f"need vocab >= 2 and n_layers >= 1, got vocab={vocab}, n_layers={n_layers}")
        self.vocab = vocab
        self.config = config or NSAConfig()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            LlamaBlockNSA(dim, n_heads, n_kv_groups, d_k, d_v, config=self.config, mlp_ratio=mlp_ratio,
                          shared_kv=shared_kv, backend=backend, rope_theta=rope_theta)
            for _ in range(n_layers))
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tie_embeddings:
            self.head.weight = self.embed.weight
        nn.init.normal_(self.embed.weight, std=0.02)

    # -- caches ---------------------------------------------------------------------------------------
    def new_caches(self, batch: int, max_len: int, *, device=None, dtype=None) -> list[NSACache]:
        """One empty NSACache per layer (buffers in the model's device and dtype unless given)."""
        return [blk.new_cache(batch, max_len, device=device, dtype=dtype) for blk in self.blocks]

    def _check_caches(self, caches):
        if len(caches) != len(self.blocks):
            raise NSAInputError(f"caches must hold one NSACache per layer ({len(self.blocks)}), got {len(caches)}")
        lengths = {c.length for c in caches}
        if len(lengths) != 1:
            raise NSAInputError(f"caches are at different lengths {sorted(lengths)}")
        return lengths.pop()

    # -- forward --------------------------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, caches: list[NSACache] | None = None) -> torch.Tensor:
        """tokens [B, T] (int64) -> logits [B, T, vocab]. caches: see the module docstring."""
        if tokens.dim() != 2:
            raise NSAInputError(f"tokens must be [B, T], got shape {tuple(tokens.shape)}")
        if caches is not None:
            self._check_caches(caches)
        x = self.embed(tokens)
        for i, blk in enumerate(self.blocks):
            x = blk(x, caches[i] if caches is not None else None)
        return self.head(self.norm(x))

    def prefill(self, tokens: torch.Tensor, caches: list[NSACache]) -> torch.Tensor:
        """Fill empty caches with the prompt; returns the prompt's logits [B, T, vocab]."""
        if self._check_caches(caches) != 0:
            raise NSAInputError("prefill needs empty caches (use forward(tokens, caches) to decode)")
        return self(tokens, caches)

    def decode_step(self, token: torch.Tensor, caches: list[NSACache]) -> torch.Tensor:
        """token [B, 1] -> logits [B, vocab] of that position, appending it to non-empty caches."""
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
                 return_logits: bool = False):
        """Prefill the prompt through fresh caches, then decode one token at a time through them.

        Returns tokens [B, T + max_new_tokens] (and, with return_logits, the logits [B, max_new_tokens,
        vocab] each new token was picked from).
        """
        if max_new_tokens < 0:
            raise NSAInputError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        B, T = tokens.shape
        if T < 1:
            raise NSAInputError("generate needs a prompt of at least one token")
        caches = self.new_caches(B, T + max_new_tokens)
        out, picked = tokens, []
        if max_new_tokens:
            logits = self.prefill(tokens, caches)[:, -1]
            for i in range(max_new_tokens):
                picked.append(logits)
                nxt = self._pick(logits, greedy, temperature, generator)
                out = torch.cat([out, nxt], dim=1)
                if i + 1 < max_new_tokens:
                    logits = self.decode_step(nxt, caches)
        if return_logits:
            empty = tokens.new_zeros(B, 0, self.vocab, dtype=self.head.weight.dtype)
            return out, (torch.stack(picked, dim=1) if picked else empty)
        return out

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
