"""Context parallelism's fused per-rank path on the CPU: queries at a stream offset through the dense core's
kernels with a query offset (nsa.run.offset_core) under Triton's interpreter, FA-2 emulated
(tests/cpu/fa2_emulation.py), against the one-process float64 call on the whole stream: outputs, the
q/k/v/gate gradients, the blocks, and telemetry (the fused path served, no fallback).

fp32 (the interpreter's bf16 tl.dot is not faithful; the GPU suite covers bf16).
"""

from __future__ import annotations

import pytest
import torch

from .interp import kernel_modules

kernel_modules("topn", "selection_fwd", probe="topn._topn_kernel")

from nsa import nsa_attention, nsa_reference, plan, telemetry  # noqa: E402
from nsa.distributed.local import compress_prefix, nsa_local, plan_local  # noqa: E402
from nsa.hooks import HOOKS  # noqa: E402
from nsa.run.offset_core import cmp_parts  # noqa: E402

from . import backend_fakes  # noqa: E402
from .helpers import SMALL, make_inputs, rel_err  # noqa: E402

CFG = SMALL["l8d4s8n4"]  # l=8, d=4, l'=8, w=16: the compressed rows start at token 7
CFG_WIDE = SMALL["l16d4s8n5i1l1"]  # w=24, l=16
T, H_Q, H_KV, D_K, D_V = 48, 4, 2, 8, 8


clean_env = backend_fakes.clean_env


@pytest.fixture
def fused(clean_env):
    """Emulated FA-2 for cmp/win, the Triton kernels allowed on CPU: "auto" plans the fused dense core."""
    return backend_fakes.allow_fused(clean_env)


def _inputs(seed, B=1, Dv=D_V):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, g = make_inputs(gen, B, T, H_Q, H_KV, D_K, Dv)
    return (q, k, v, g), gen


def _expected(tensors, cfg, segs, weight):
    """(the oracle's output, the float64 one-process gradients of sum(out * weight) over the segments)."""
    q, k, v, g = (x.clone().requires_grad_() for x in tensors)
    out = nsa_attention(q, k, v, g, cfg, backend="torch")
    loss = sum((out[:, s:s + n] * weight[:, s:s + n]).sum() for s, n in segs)
    grads = torch.autograd.grad(loss, (q, k, v, g))
    return nsa_reference(*tensors, cfg).out, grads


def _per_rank(tensors, cfg, segs, weight, dtype=torch.float32):
    """This rank's segments on the fused path (as nsa.distributed.cp runs them), in dtype: (outs, grads)."""
    q, k, v, g = (x.to(dtype).requires_grad_() for x in tensors)
    end = max(s + n for s, n in segs)
    lq = torch.cat([q[:, s:s + n] for s, n in segs], 1).detach()
    lk, lv = (torch.cat([x[:, s:s + n] for s, n in segs], 1).detach() for x in (k, v))
    pl, path, reason = plan_local("auto", lq, lk, lv, cfg, None, None, None, False)
    assert (path, reason) == ("fused", "ok")
    compressed = compress_prefix(k, v, cfg, end, q.shape[0])
    outs, loss = [], 0
    for s, n in segs:
        o, idx = nsa_local(q[:, s:s + n], g[:, s:s + n], k, v, cfg, s, compressed=compressed, prefix_end=end,
                           need_indices=True, plan=pl)
        outs.append((o, idx))
        loss = loss + (o.double() * weight[:, s:s + n]).sum()
    return outs, torch.autograd.grad(loss, (q, k, v, g))


SEGMENTS = {
    "first_rank": [(0, 20)],
    "before_first_block": [(3, 9)],  # starts before token l - 1: a head that sees nothing
    "block_multiples": [(16, 16)],  # offset a multiple of d, l' and w
    "mid_row_mid_window": [(27, 13)],  # not a multiple of anything; the window band starts at 12
    "last_rank": [(30, 18)],
    "zigzag": [(6, 6), (36, 6)],
    "tail_only": [(29, 2)],  # fewer than d tokens: no whole row
}


@pytest.mark.parametrize("name", sorted(SEGMENTS))
def test_offset_core_matches_one_process(fused, name):
    segs = SEGMENTS[name]
    tensors, gen = _inputs(sum(map(ord, name)))
    weight = torch.randn(1, T, H_Q, D_V, generator=gen, dtype=torch.float64)
    ref, want = _expected(tensors, CFG, segs, weight)
    _, want_idx = nsa_attention(*tensors, CFG, backend="torch", return_indices=True)
    telemetry.reset()
    outs, got = _per_rank(tensors, CFG, segs, weight)
    for (s, n), (o, idx) in zip(segs, outs):
        assert rel_err(o, ref[:, s:s + n]) < 2e-5, (s, n, rel_err(o, ref[:, s:s + n]))
        assert torch.equal(idx, want_idx[:, s:s + n].to(idx.dtype)), (s, n)
    for label, a, b in zip("qkvg", got, want):
        assert rel_err(a, b) < 1e-4, (label, rel_err(a, b))
    snap = telemetry.snapshot()
    assert snap["fallbacks"] == 0
    events = {(e["branch"], e["backend"], e["event"]): e["calls"] for e in snap["events"]}
    assert events[("pipeline", "fused", "dense_core_offset")] == len(segs)


def test_offset_core_dk_ne_dv_wide_window(fused):
    """Dk > Dv (V zero-padded for FA-2), a wider window and compressed block (l=16), B=2."""
    segs = [(21, 19)]
    tensors, gen = _inputs(7, B=2, Dv=6)
    weight = torch.randn(2, T, H_Q, 6, generator=gen, dtype=torch.float64)
    ref, want = _expected(tensors, CFG_WIDE, segs, weight)
    outs, got = _per_rank(tensors, CFG_WIDE, segs, weight)
    assert rel_err(outs[0][0], ref[:, 21:40]) < 2e-5
    for label, a, b in zip("qkvg", got, want):
        assert rel_err(a, b) < 1e-4, (label, rel_err(a, b))


def test_cmp_parts():
    """The head / rows / tail split of the compressed branch (l=8, d=4: rows start at tokens 7, 11, ...)."""
    assert cmp_parts(0, 20, CFG) == (0, 7, 3, 19)
    assert cmp_parts(7, 8, CFG) == (0, 0, 2, 8)
    assert cmp_parts(9, 8, CFG) == (1, 2, 1, 6)  # tokens 9, 10 see block 0; row 11..14 sees blocks 0, 1
    assert cmp_parts(9, 1, CFG) == (1, 1, 0, 1)


# --- two gloo ranks through cp_group ------------------------------------------------------------------------

GLOO_CASES = {"contiguous": [21, 27], "zigzag": [24, 24]}  # rank 1 of "contiguous" starts mid-window


def _gloo_worker(rank, world, port, outdir):
    import os

    import torch.distributed as dist

    from nsa.distributed import ContextParallel, shard

    torch.set_num_threads(1)
    # Whatever the start method: the same test hooks as the fixture's (the parent's patches are not inherited
    # by a spawned rank); this process ends after the test.
    os.environ.update({"NSA_FA2_MIN_LEN_WIN": "1", "NSA_FA2_MIN_LEN_CMP": "1", "TRITON_INTERPRET": "1"})
    emulated = backend_fakes.emulated
    HOOKS.providers = {"flash_attn": emulated("flash_attn"), "torch_flash": emulated("torch_flash"),
                       "sdpa": plan.PROVIDERS["sdpa"]}
    for prov in plan.TRITON.values():
        prov.allow_cpu = True
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        for layout, lengths in GLOO_CASES.items():
            tensors, gen = _inputs(sum(map(ord, layout)))
            weight = torch.randn(1, T, H_Q, D_V, generator=gen, dtype=torch.float64)
            spec = ContextParallel(dist.group.WORLD, layout=layout)
            if layout == "zigzag":
                local = [shard(x, spec) for x in [*tensors, weight]]
            else:
                local = [x.split(lengths, dim=1)[rank] for x in [*tensors, weight]]
            leaves = [x.float().requires_grad_() for x in local[:-1]]
            telemetry.reset()
            out = nsa_attention(*leaves, CFG, cp_group=spec)
            (out.double() * local[-1]).sum().backward()
            torch.save({"out": out.detach(), "grads": [x.grad for x in leaves], "cp": telemetry.served("cp"),
                        "fallbacks": telemetry.snapshot()["fallbacks"]}, os.path.join(outdir, f"{layout}.{rank}"))
    finally:
        dist.destroy_process_group()


def test_cp_group_two_ranks_fused(fused, tmp_path):
    """nsa_attention(cp_group=...) on two gloo ranks takes the fused path per rank (telemetry), and matches
    the one-process float64 call: outputs and q/k/v/gate gradients, contiguous (uneven) and zigzag."""
    from nsa.distributed.cp import pieces_of

    from .test_context_parallel import _launch

    _launch(_gloo_worker, 2, str(tmp_path))
    for layout, lengths in GLOO_CASES.items():
        tensors, gen = _inputs(sum(map(ord, layout)))
        weight = torch.randn(1, T, H_Q, D_V, generator=gen, dtype=torch.float64)
        got = [torch.load(tmp_path / f"{layout}.{r}") for r in range(2)]
        assert all(g["cp"] == {"fused": 1} and g["fallbacks"] == 0 for g in got), [g["cp"] for g in got]
        _, order = pieces_of(layout, lengths)

        def whole(parts, order=order):
            return torch.cat([parts[r][:, s:s + n] for r, s, n in order], 1)

        ref, want = _expected(tensors, CFG, [(0, T)], weight)
        assert rel_err(whole([g["out"] for g in got]), ref) < 2e-5, layout
        for i, label in enumerate("qkvg"):
            assert rel_err(whole([g["grads"][i] for g in got]), want[i]) < 1e-4, (layout, label)


@pytest.mark.parametrize("segs", [[(19, 14)], [(0, 9), (30, 9)]])
def test_offset_core_triton_window(fused, segs):
    """The sliding branch on NSA's Triton window kernels (TMA descriptors run by the interpreter; D=64): q
    zero-padded at the front to the band of keys, against the one-process float64 call."""
    fused.setattr(HOOKS, "tma_force", True)
    gen = torch.Generator().manual_seed(5)
    tensors = make_inputs(gen, 1, 40, H_Q, H_KV, 64, 64)
    weight = torch.randn(1, 40, H_Q, 64, generator=gen, dtype=torch.float64)
    ref, want = _expected(tensors, CFG, segs, weight)
    telemetry.reset()
    outs, got = _per_rank(tensors, CFG, segs, weight)
    assert telemetry.served("win") == {"triton_window": 1}
    assert sum(e["calls"] for e in telemetry.snapshot()["events"] if e["event"] == "window_forward_offset") == len(segs)
    for (s, n), (o, _) in zip(segs, outs):
        assert rel_err(o, ref[:, s:s + n]) < 2e-5, (s, n)
    for label, a, b in zip("qkvg", got, want):
        assert rel_err(a, b) < 1e-4, (label, rel_err(a, b))


@pytest.mark.parametrize("segs, split", [([(27, 13)], 1), ([(0, 20)], 0), ([(0, 14)], 0), ([(11, 12), (23, 17)], 1),
                                         ([(32, 16)], 1)])
def test_offset_core_cudnn_rows(fused, segs, split):
    """torch_cudnn serving the compressed branch (emulated, a pretended sm 9.0): its top-left causal mask
    serves square rows (m0 = 0) in one call and rows after m0 >= 2 blocks as two calls merged by log-sum-exp
    (`split` segments: offset 27 has m0 = 5; offset 11 has m0 = 1, its rows go to the core's FA-2 provider;
    offset 32 has m0 = 7, a head of 3 tokens and a tail); a single row goes to FA-2 too. Against the
    one-process float64 call: outputs and every gradient (the merged backward)."""
    fused.setattr(HOOKS, "cudnn", backend_fakes.emulated_cudnn())
    tensors, gen = _inputs(11)
    weight = torch.randn(1, T, H_Q, D_V, generator=gen, dtype=torch.float64)
    ref, want = _expected(tensors, CFG, segs, weight)
    telemetry.reset()
    outs, got = _per_rank(tensors, CFG, segs, weight)
    assert telemetry.served("cmp") == {"torch_cudnn": 1}
    assert sum(e["calls"] for e in telemetry.snapshot()["events"] if e["event"] == "offset_rows_split") == split
    for (s, n), (o, _) in zip(segs, outs):
        assert rel_err(o, ref[:, s:s + n]) < 2e-5, (s, n)
    for label, a, b in zip("qkvg", got, want):
        assert rel_err(a, b) < 1e-4, (label, rel_err(a, b))


@pytest.mark.sample
def test_offset_core_branch_kv_and_given_blocks(fused):
    """Per-branch K/V (kv_cmp, kv_win) and given block indices on the fused per-rank path, against the
    one-process float64 call with the same blocks: output and the gradients of q, gates and every K/V."""
    gen = torch.Generator().manual_seed(3)
    q, k, v, g = make_inputs(gen, 1, T, H_Q, H_KV, D_K, D_V)
    kc, vc, kw, vw = (x for _ in range(2) for x in make_inputs(gen, 1, T, H_Q, H_KV, D_K, D_V)[1:3])
    idx = torch.randint(-1, 5, (1, T, H_KV, CFG.n_sel), generator=gen)
    s, n = 23, 17
    weight = torch.randn(1, n, H_Q, D_V, generator=gen, dtype=torch.float64)
    hi = [x.clone().requires_grad_() for x in (q, k, v, g, kc, vc, kw, vw)]
    want = nsa_attention(*hi[:4], CFG, kv_cmp=tuple(hi[4:6]), kv_win=tuple(hi[6:8]), block_indices=idx,
                         backend="torch")[:, s:s + n]
    want_grads = torch.autograd.grad((want * weight).sum(), hi)
    lo = [x.float().requires_grad_() for x in (q, k, v, g, kc, vc, kw, vw)]
    lq, lk, lv = (x[:, s:s + n].detach() for x in lo[:3])
    pl, path, reason = plan_local("auto", lq, lk, lv, CFG, tuple(x[:, s:s + n].detach() for x in lo[4:6]),
                                  tuple(x[:, s:s + n].detach() for x in lo[6:8]), None, True)
    assert (path, reason) == ("fused", "ok")
    compressed = compress_prefix(lo[4], lo[5], CFG, s + n, 1)
    out, _ = nsa_local(lo[0][:, s:s + n], lo[3][:, s:s + n], lo[1], lo[2], CFG, s, kv_win=tuple(lo[6:8]),
                       compressed=compressed, prefix_end=s + n, block_indices=idx[:, s:s + n], plan=pl)
    assert rel_err(out, want) < 2e-5
    got = torch.autograd.grad((out.double() * weight).sum(), lo)
    for label, a, b in zip(["q", "k", "v", "g", "k_cmp", "v_cmp", "k_win", "v_win"], got, want_grads):
        assert rel_err(a, b) < 1e-4, (label, rel_err(a, b))


@pytest.mark.parametrize("m0, n", [(2, 2), (3, 2), (5, 3), (7, 3), (14336, 2048), (100, 7)])
def test_offset_parts_cover_the_prefix(m0, n):
    """cuDNN's pieces for rows after m0 blocks: [0, m0) covered in order by unmasked pieces of n to 2n - 1 blocks
    (at least 2: cuDNN's backward minimum), then the square causal [m0, m0 + n)."""
    from nsa.kernels.fa2.torch_cudnn import offset_parts

    parts = offset_parts(m0, n)
    assert parts[-1] == (m0, m0 + n, True)
    prefix = parts[:-1]
    assert prefix[0][0] == 0 and prefix[-1][1] == m0 and all(not c for _, _, c in prefix)
    assert all(a[1] == b[0] for a, b in zip(prefix, prefix[1:]))
    assert all(max(n, 2) <= e - s <= max(2 * n - 1, 3) for s, e, _ in prefix) or len(prefix) == 1
