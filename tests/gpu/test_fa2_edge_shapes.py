"""Edge shapes: T = 1, T < block_cmp, window > T, head dims 64/128/192/256, empty rows (output exactly 0,
LSE -inf), and T = 64k forward of the cmp and win branches vs the torch branch code on a subset of rows."""

from __future__ import annotations

import pytest
import torch
from fa2_gpu_helpers import PAPER, SMALL, TOL, branch_err, inputs, one_hot_gates, oracle, run_unless_refused

from nsa import plan, toggles
from nsa.branches.compressed.fa2 import compressed_fa2
from nsa.branches.compressed.naive import compressed_chunk
from nsa.branches.context import CallContext
from nsa.branches.sliding.fa2 import sliding_fa2
from nsa.branches.sliding.naive import sliding_chunk
from nsa.compress import compress_kv
from nsa.layout import dense_layout
from nsa.validation import Shapes

pytestmark = pytest.mark.usefixtures("fa2_env")


@pytest.mark.parametrize("D", [64, 128, 192, 256])
@pytest.mark.parametrize("T", [1, 17, 100])
@pytest.mark.parametrize("branch", ["cmp", "win"])
def test_head_dims_and_short_T(provider, gen, D, T, branch):
    cfg = SMALL.with_(window=512)  # window > T
    q, k, v = inputs(gen, 1, T, 4, 1, D, D, torch.bfloat16)
    g = one_hot_gates(1, T, 4, branch, torch.bfloat16)
    want, idx = oracle(q, k, v, g, cfg)
    got = run_unless_refused(q, k, v, g, cfg, provider, block_indices=idx.cuda())
    assert got is None or branch_err(got, want) < TOL[torch.bfloat16]


def _ctx(q, k, v):
    B, T, Hq, Dk = q.shape
    return CallContext(Shapes(B, T, Hq, k.shape[2], Dk, v.shape[3]), q.dtype, q.device, False, kernel_dtype=q.dtype)


def test_empty_rows_zero_and_lse_neg_inf(provider, gen):
    q, k, v = inputs(gen, 2, 80, 8, 2, 128, 128, torch.bfloat16)
    layout = dense_layout(2, 80, PAPER, q.device)
    kc, vc = compress_kv(k, v, layout, PAPER)
    o, lse = compressed_fa2(plan.PROVIDERS[provider], _ctx(q, k, v), toggles.read(), q, kc, vc, layout, PAPER,
                            128 ** -0.5)
    l = PAPER.block_cmp
    assert (o[:, : l - 1] == 0).all() and torch.isneginf(lse[:, : l - 1]).all()
    assert torch.isfinite(lse[:, l - 1:]).all()


@pytest.mark.big_gpu_memory
@pytest.mark.parametrize("branch", ["cmp", "win"])
def test_64k_forward_subset_rows(provider, gen, branch):
    T, Hq, Hkv, D = 65536, 16, 1, 128
    q, k, v = inputs(gen, 1, T, Hq, Hkv, D, D, torch.bfloat16)
    cfg, scale = PAPER, D ** -0.5
    layout = dense_layout(1, T, cfg, q.device)
    prov, tg = plan.PROVIDERS[provider], toggles.read()
    with torch.no_grad():
        if branch == "cmp":
            kc, vc = compress_kv(k, v, layout, cfg)
            o, lse = compressed_fa2(prov, _ctx(q, k, v), tg, q, kc, vc, layout, cfg, scale)
        else:
            o = sliding_fa2(prov, _ctx(q, k, v), tg, q, k, v, layout, cfg, scale)
        for c0 in (0, 31, 4096, T - 700):
            c1 = c0 + 512
            t = torch.arange(c0, c1, device="cuda")
            qc = q[:, c0:c1].float().unflatten(2, (Hkv, Hq // Hkv))
            if branch == "cmp":
                want, _ = compressed_chunk(qc, kc.float(), vc.float(), layout.cmp_start, layout.cmp_valid,
                                           t, layout.seq_start[:, c0:c1], cfg, scale)
            else:
                k0 = max(0, c0 - cfg.window + 1)
                want = sliding_chunk(qc, k[:, k0:c1].float(), v[:, k0:c1].float(),
                                     torch.arange(k0, c1, device="cuda"), t, layout.seq_start[:, c0:c1], cfg, scale)
            assert branch_err(o[:, c0:c1], want.flatten(2, 3)) < TOL[torch.bfloat16], (branch, c0)
