"""Helpers shared by the CPU suite: random inputs, error measures, poisoned allocations, small configs.

Nothing here computes NSA: the independent computations the tests compare against (dense causal
attention, an explicit per-query loop) live in the tests themselves.
"""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch
from torch.overrides import TorchFunctionMode

from nsa import NSAConfig

PAPER = NSAConfig()
# Small block configurations: every rule of the semantics shows up within a few hundred tokens.
SMALL = {
    "l8d4s8n4": NSAConfig(block_cmp=8, stride_cmp=4, block_sel=8, n_sel=4, n_init=1, n_local=2, window=16),
    "l8d4s16n4i0": NSAConfig(block_cmp=8, stride_cmp=4, block_sel=16, n_sel=4, n_init=0, n_local=1, window=16),
    "l8d4s8n4i2l0": NSAConfig(block_cmp=8, stride_cmp=4, block_sel=8, n_sel=4, n_init=2, n_local=0, window=16),
    "l8d8s8n3i0l0": NSAConfig(block_cmp=8, stride_cmp=8, block_sel=8, n_sel=3, n_init=0, n_local=0, window=8),
    "l16d4s8n5i1l1": NSAConfig(block_cmp=16, stride_cmp=4, block_sel=8, n_sel=5, n_init=1, n_local=1, window=24),
}


def slow(*values, id: str | None = None):  # noqa: A002 - pytest.param's own keyword
    """A case of a parametrized sweep that only the full suite runs (marked `slow`): the quick tier
    (`-m "not slow"`) keeps the sweep's other cases, which reach the same code."""
    return pytest.param(*values, id=id, marks=pytest.mark.slow)


def make_inputs(gen, B, T, Hq, Hkv, Dk, Dv, dtype=torch.float64, requires_grad=False):
    """Fresh q, k, v (standard normal) and gates (uniform in [0, 1]) drawn from `gen`, cast to dtype."""
    q = torch.randn(B, T, Hq, Dk, generator=gen, dtype=torch.float64)
    k = torch.randn(B, T, Hkv, Dk, generator=gen, dtype=torch.float64)
    v = torch.randn(B, T, Hkv, Dv, generator=gen, dtype=torch.float64)
    g = torch.rand(B, T, Hq, 3, generator=gen, dtype=torch.float64)
    out = [x.to(dtype) for x in (q, k, v, g)]
    if requires_grad:
        out = [x.requires_grad_() for x in out]
    return out


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| in float64 (0 when both are all zero; inf for NaN)."""
    got, want = got.detach().double(), want.detach().double()
    assert got.shape == want.shape, (got.shape, want.shape)
    if got.numel() == 0:
        return 0.0
    diff = (got - want).abs().max()
    if torch.isnan(diff):
        return float("inf")
    scale = want.abs().max()
    if scale == 0:
        return float(diff) if diff > 0 else 0.0
    return float(diff / scale)


def index_overlap(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over (b, t, h) rows of |set(a) & set(b)| / |set(b)| (ignoring -1); 1.0 when identical."""
    assert a.shape == b.shape
    n = a.shape[-1]
    a2, b2 = a.reshape(-1, n).long(), b.reshape(-1, n).long()
    hit = ((a2[:, :, None] == b2[:, None, :]) & (b2[:, None, :] >= 0)).any(dim=1)  # b's entries found in a
    size = (b2 >= 0).sum(dim=1)
    rows = size > 0
    if not rows.any():
        return 1.0
    return float((hit.sum(dim=1)[rows] / size[rows]).mean())


_EMPTY_FUNCS = {torch.empty, torch.empty_like, torch.empty_strided, torch.Tensor.new_empty}


class _PoisonEmpty(TorchFunctionMode):
    """Every uninitialised allocation made from Python (torch.empty & co.) comes back filled with NaN."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _EMPTY_FUNCS and isinstance(out, torch.Tensor) and out.is_floating_point():
            with torch.no_grad():
                out.fill_(float("nan"))
        return out


def _dirty_heap() -> None:
    """Fill and free blocks of many sizes so that malloc hands NaN-filled memory to the next allocations."""
    blocks = [torch.full((n,), float("nan"), dtype=torch.float64) for n in (2 ** e for e in range(6, 21))
              for _ in range(2)]
    del blocks
    gc.collect()


@contextlib.contextmanager
def poisoned():
    """Run a call with output buffers poisoned: uninitialised memory reads as NaN as far as we can make it.

    The API allocates its own outputs, so poisoning means (1) recycled heap memory was filled with NaN
    just before the call and (2) torch.empty/empty_like/new_empty/empty_strided return NaN-filled
    tensors. Check the results with `assert_finite`.
    """
    _dirty_heap()
    with _PoisonEmpty():
        yield


def assert_finite(*tensors: torch.Tensor) -> None:
    for i, x in enumerate(tensors):
        bad = ~torch.isfinite(x.detach())
        assert not bad.any(), f"tensor {i}: {int(bad.sum())} non-finite elements (first at {bad.nonzero()[0].tolist()})"


def run_poisoned(fn, *args, **kwargs):
    """Call fn under `poisoned()` and assert every floating-point tensor it returns is finite."""
    with poisoned():
        res = fn(*args, **kwargs)
    flat = res if isinstance(res, (tuple, list)) else (res,)
    assert_finite(*[x for x in flat if isinstance(x, torch.Tensor) and x.is_floating_point()])
    return res


def dense_causal_attention(q, k, v, scale=None, window=None):
    """Plain softmax attention with an explicit lower-triangular mask, float64, GQA by h // G.

    q [B, T, Hq, Dk], k [B, T, Hkv, Dk], v [B, T, Hkv, Dv]. Differentiable. `window` w restricts
    query t to keys [t - w + 1, t].
    """
    q, k, v = q.double(), k.double(), v.double()
    B, T, Hq, Dk = q.shape
    G = Hq // k.shape[2]
    scale = Dk ** -0.5 if scale is None else scale
    kk = k.repeat_interleave(G, dim=2)  # head h reads KV head h // G
    vv = v.repeat_interleave(G, dim=2)
    logits = torch.einsum("bthd,bshd->bhts", q, kk) * scale
    t = torch.arange(T)
    mask = t[None, :] <= t[:, None]
    if window is not None:
        mask &= t[None, :] > t[:, None] - window
    logits = logits.masked_fill(~mask, float("-inf"))
    return torch.einsum("bhts,bshd->bthd", torch.softmax(logits, dim=-1), vv)
