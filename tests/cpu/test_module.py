"""NSAAttention and LlamaBlockNSA through the cache: prefill(T) == prefill(T - k) + k decode steps (fp64)."""

from __future__ import annotations

import pytest
import torch

from nsa import NSAAttention, NSAConfig
from nsa.model import LlamaBlockNSA, RMSNorm

TOL = 1e-10
# Small blocks so that T = 45 has many compressed blocks, more selection blocks than n_sel and a
# window shorter than T: every branch is partial and the decode steps cross block boundaries.
SMALL = dict(block_cmp=8, stride_cmp=4, block_sel=8, n_sel=3, n_init=1, n_local=1, window=12)
CASES = [(c, s) for c in ("avg", "mlp") for s in (False, True)]


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-300)).item()


@pytest.mark.parametrize("compress,shared_kv", CASES)
def test_module_prefill_equals_prefix_plus_decode(compress, shared_kv):
    torch.manual_seed(0)
    cfg = NSAConfig(**SMALL, compress=compress)
    m = NSAAttention(48, 4, 2, 16, 8, cfg, shared_kv=shared_kv).double().eval()
    B, T, k = 2, 45, 6
    x = torch.randn(B, T, 48, dtype=torch.float64)
    with torch.no_grad():
        full = m(x)  # training path, no cache
        c_full = m.new_cache(B, T)
        pre = m(x, c_full)  # prefill of all T
        c = m.new_cache(B, T)
        parts = [m(x[:, : T - k], c)] + [m(x[:, t : t + 1], c) for t in range(T - k, T)]
        inc = torch.cat(parts, dim=1)
        c2 = m.new_cache(B, T)
        m(x[:, : T - k], c2)
        multi = m(x[:, T - k :], c2)  # several new tokens in one call decode one at a time
    assert c.length == T and c2.length == T
    assert _rel(pre, full) <= TOL
    assert _rel(inc, full) <= TOL
    assert _rel(torch.cat([inc[:, : T - k], multi], 1), full) <= TOL


@pytest.mark.parametrize("compress,shared_kv", CASES)
def test_block_prefill_equals_prefix_plus_decode(compress, shared_kv):
    torch.manual_seed(1)
    cfg = NSAConfig(**SMALL, compress=compress)
    blk = LlamaBlockNSA(32, 4, 2, 8, 8, config=cfg, shared_kv=shared_kv).double().eval()
    B, T, k = 1, 40, 5
    x = torch.randn(B, T, 32, dtype=torch.float64)
    with torch.no_grad():
        full = blk(x)
        cache = blk.new_cache(B, T)
        parts = [blk(x[:, : T - k], cache)] + [blk(x[:, t : t + 1], cache) for t in range(T - k, T)]
    assert _rel(torch.cat(parts, dim=1), full) <= TOL


def test_seed_block_forward_shape_and_grads():
    """The seeds' tiny block: LlamaBlockNSA(dim=256, n_heads=8, n_kv_groups=2, d_k=32, d_v=32)."""
    torch.manual_seed(0)
    blk = LlamaBlockNSA(dim=256, n_heads=8, n_kv_groups=2, d_k=32, d_v=32)
    assert blk.config == NSAConfig()
    x = torch.randn(1, 40, 256, requires_grad=True)
    y = blk(x)
    assert y.shape == x.shape and torch.isfinite(y).all()
    y.square().mean().backward()
    assert torch.isfinite(x.grad).all()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in blk.parameters())


def test_block_is_causal():
    torch.manual_seed(0)
    blk = LlamaBlockNSA(32, 4, 1, 8, 8, config=NSAConfig(**SMALL)).double()
    x = torch.randn(1, 30, 32, dtype=torch.float64)
    y = blk(x)
    x2 = x.clone()
    x2[:, 20:] += 1.0
    assert torch.equal(blk(x2)[:, :20], y[:, :20])


def test_rmsnorm():
    n = RMSNorm(8)
    x = torch.randn(3, 8, dtype=torch.float64)
    n = n.double()
    want = x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
    assert torch.allclose(n(x), want, rtol=1e-12, atol=0)
    xb = x.bfloat16()
    assert n.bfloat16()(xb).dtype == torch.bfloat16


def test_bad_groups_rejected():
    with pytest.raises(ValueError, match="n_kv_groups"):
        LlamaBlockNSA(32, 6, 4, 8, 8)
