"""Context parallelism's fused per-rank path (nsa.run.offset_core) on the GPU at real shapes: queries at stream
offsets (multiples of the block sizes and not, a segment starting mid-window, the last rank's ragged end,
zigzag's two segments) through the fused kernels with a query offset, bf16, T = 8k, paper blocks.

Outputs against the fp64 one-process call with the per-rank path's own blocks (top-n is discontinuous in
bf16: the whole stream's blocks elsewhere), gradients of q, k, v and gates against the fp64 torch backend on
the same blocks; telemetry says the fused path served. One process (the per-rank function itself); the
multi-rank runs are bench/bench_cp.py's --check.
"""

from __future__ import annotations

import pytest
import torch
from triton_sel_helpers import MARKS

from nsa import NSAConfig, nsa_attention, telemetry
from nsa.distributed.local import compress_prefix, nsa_local, plan_local

pytestmark = MARKS

PAPER = NSAConfig()
T = 8192
TOL, GRAD_TOL = 3e-2, 5e-2


@pytest.fixture(autouse=True)
def core_env(sel_env):
    sel_env.setenv("NSA_FA2_MIN_LEN_WIN", "1")
    sel_env.setenv("NSA_FA2_MIN_LEN_CMP", "1")
    for var in ("NSA_DENSE_CORE", "NSA_FA2_FORCE_VARLEN", "NSA_FA2_PREF_FP16", "NSA_TRITON_WINDOW"):
        sel_env.delenv(var, raising=False)
    yield sel_env


def err(got, want):
    got, want = got.detach().double(), want.detach().double()
    return ((got - want).abs().max() / want.abs().max().clamp(min=1.0)).item() if want.numel() else 0.0


SEGMENTS = {
    "first_rank": [(0, 2048)],
    "block_multiple": [(4096, 2048)],
    "mid_row_mid_window": [(3001, 2500)],  # not a multiple of d, l', 64 or the window
    "last_rank_ragged": [(6151, 2041)],
    "zigzag": [(1024, 1024), (6144, 1024)],
}


@pytest.mark.parametrize("window", ["triton", "fa2"])
@pytest.mark.parametrize("Dk,Dv", [(128, 128), (192, 128)])
@pytest.mark.parametrize("name", sorted(SEGMENTS))
def test_per_rank_fused_vs_one_process(gen, sel_env, name, Dk, Dv, window):
    if window == "fa2":
        sel_env.setenv("NSA_TRITON_WINDOW", "0")
    segs = SEGMENTS[name]
    Hq, Hkv = 16, 1
    xs = [torch.randn(1, T, h, d, generator=gen, dtype=torch.float64).to("cuda", torch.bfloat16).requires_grad_()
          for h, d in ((Hq, Dk), (Hkv, Dk), (Hkv, Dv))]
    xs.append(torch.rand(1, T, Hq, 3, generator=gen, dtype=torch.float64).to("cuda", torch.bfloat16).requires_grad_())
    q, k, v, g = xs
    end = max(s + n for s, n in segs)
    local = [torch.cat([x[:, s:s + n] for s, n in segs], 1).detach() for x in (q, k, v)]
    telemetry.reset()
    plan, path, reason = plan_local("auto", *local, PAPER, None, None, None, False)
    assert (path, reason) == ("fused", "ok"), telemetry.snapshot()["counts"]
    compressed = compress_prefix(k, v, PAPER, end, 1)
    outs = [nsa_local(q[:, s:s + n], g[:, s:s + n], k, v, PAPER, s, compressed=compressed, prefix_end=end,
                      need_indices=True, plan=plan) for s, n in segs]
    events = {e["event"]: e["calls"] for e in telemetry.snapshot()["events"]}
    assert events.get("dense_core_offset") == len(segs)
    if window == "triton" and telemetry.served("win") == {"triton_window": 1}:
        assert events.get("window_forward_offset") == len(segs)
    if telemetry.served("cmp") == {"torch_cudnn": 1}:  # rows after m0 >= 2 blocks: cuDNN's two merged calls
        from nsa.run.offset_core import cmp_parts

        split = sum(1 for s, n in segs if cmp_parts(s, n, PAPER)[0] >= 2 and cmp_parts(s, n, PAPER)[2] >= 2)
        assert events.get("offset_rows_split", 0) == split
    # The blocks: the per-rank path's in its segments, the plain call's elsewhere.
    with torch.no_grad():
        _, idx = nsa_attention(q, k, v, g, PAPER, return_indices=True)
    for (s, n), (_, i) in zip(segs, outs):
        idx[:, s:s + n] = i
    hi = [x.detach().double().requires_grad_() for x in xs]
    want = nsa_attention(*hi, PAPER, block_indices=idx, backend="torch")
    go = torch.randn(1, T, Hq, Dv, generator=gen, dtype=torch.float64).to("cuda")
    for (s, n), (o, _) in zip(segs, outs):
        assert torch.isfinite(o).all() and err(o, want[:, s:s + n]) < TOL, (s, n, err(o, want[:, s:s + n]))
    loss = sum((o.double() * go[:, s:s + n]).sum() for (s, n), (o, _) in zip(segs, outs))
    got = torch.autograd.grad(loss, xs)
    ref = torch.autograd.grad(sum((want[:, s:s + n] * go[:, s:s + n]).sum() for s, n in segs), hi)
    for label, a, b in zip("qkvg", got, ref):
        assert torch.isfinite(a).all(), label
        assert err(a, b) < GRAD_TOL, (label, err(a, b))
