"""TinyNSALM: cached prefill/decode equals the full forward (fp64), generate equals uncached greedy
decoding, training lowers the loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nsa import NSAConfig
from nsa.model import TinyNSALM

TOL = 1e-10
SMALL = dict(block_cmp=8, stride_cmp=4, block_sel=8, n_sel=3, n_init=1, n_local=1, window=12)


def _model(compress="avg", shared_kv=False, dtype=torch.float64, layers=2, seed=0):
    torch.manual_seed(seed)
    cfg = NSAConfig(**SMALL, compress=compress)
    return TinyNSALM(50, 32, layers, 4, 2, 8, 8, cfg, shared_kv=shared_kv).to(dtype).eval()


@pytest.mark.parametrize("compress,shared_kv", [(c, s) for c in ("avg", "mlp") for s in (False, True)])
def test_model_prefill_equals_prefix_plus_decode(compress, shared_kv):
    m = _model(compress, shared_kv)
    B, T, k = 2, 37, 5
    tok = torch.randint(0, 50, (B, T), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = m(tok)
        caches = m.new_caches(B, T)
        parts = [m.prefill(tok[:, : T - k], caches)]
        parts += [m.decode_step(tok[:, t : t + 1], caches)[:, None] for t in range(T - k, T)]
    inc = torch.cat(parts, dim=1)
    assert all(c.length == T for c in caches)
    assert ((inc - full).abs().max() / full.abs().max()).item() <= TOL


@pytest.mark.parametrize("compress", ["avg", "mlp"])
def test_generate_equals_uncached_greedy(compress):
    m = _model(compress)
    prompt = torch.randint(0, 50, (2, 29), generator=torch.Generator().manual_seed(4))
    out, logits = m.generate(prompt, 6, return_logits=True)
    ref, ref_logits = m.generate_uncached(prompt, 6, return_logits=True)
    assert out.shape == (2, 35) and torch.equal(out[:, :29], prompt)
    assert torch.equal(out, ref)
    assert (logits - ref_logits).abs().max().item() <= TOL * ref_logits.abs().max().item()


def test_generate_float32_and_sampling():
    m = _model(dtype=torch.float32, layers=1)
    prompt = torch.randint(0, 50, (1, 20), generator=torch.Generator().manual_seed(5))
    assert torch.equal(m.generate(prompt, 4), m.generate_uncached(prompt, 4))
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    s1 = m.generate(prompt, 4, greedy=False, generator=g1)
    s2 = m.generate(prompt, 4, greedy=False, generator=g2)
    assert torch.equal(s1, s2) and s1.shape == (1, 24)
    assert torch.equal(m.generate(prompt, 0), prompt)


def test_loss_matches_cross_entropy_and_training_lowers_it():
    m = _model(compress="mlp", dtype=torch.float32, layers=1).train()
    tok = torch.randint(0, 50, (2, 33), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = F.cross_entropy(m(tok[:, :-1]).flatten(0, 1), tok[:, 1:].flatten())
        assert torch.allclose(m.loss(tok), want)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    losses = []
    for _ in range(6):
        opt.zero_grad()
        loss = m.loss(tok)
        loss.backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], losses


def test_cache_errors():
    m = _model(layers=2)
    tok = torch.randint(0, 50, (1, 10))
    with pytest.raises(ValueError, match="one NSACache per layer"):
        m(tok, m.new_caches(1, 20)[:1])
    caches = m.new_caches(1, 20)
    m.prefill(tok, caches)
    with pytest.raises(ValueError, match="empty caches"):
        m.prefill(tok, caches)
    with pytest.raises(ValueError, match="prefilled"):
        m.decode_step(tok[:, :1], m.new_caches(1, 20))
    with pytest.raises(ValueError, match="T >= 2"):
        m.loss(tok[:, :1])
