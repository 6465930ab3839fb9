"""Edge shapes of the fused GPU pipeline, forward and backward, for `compute-sanitizer --tool memcheck`; run by
tests/sanitizer/test_memcheck.py (`nox -s sanitizer`), by hand:

    compute-sanitizer --tool memcheck --error-exitcode 1 python tests/sanitizer/nsa_edge_sweep.py

Every shape the GPU tests use at its edges: T in {1, l-1, l, 65, 1000, 4097}, G in {1, 2, 4, 8, 16, 32},
(Dk, Dv) in {(64,64), (128,128), (192,128), (256,256)}, packed input with empty and length-1 sequences,
batches, bf16 and fp16, the dense core's forms (rows by view with V padded, the provider's call for packed
input and Dk < Dv, one packed sequence), the top-n and selection kernels alone on fp32, the sliding-window
and compressed-branch kernels alone (and the dense core on the latter), and context parallelism's per-rank
path at stream offsets. Small head counts keep it quick under the sanitizer. Exit status 1 when an output
or gradient is not finite or the fused path did not run as one node.
"""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: nsa
os.environ.setdefault("NSA_FA2_MIN_LEN_WIN", "1")
os.environ.setdefault("NSA_FA2_MIN_LEN_CMP", "1")

import torch  # noqa: E402

from nsa import NSAConfig, nsa_attention, telemetry  # noqa: E402

CFG = NSAConfig()


def cases():
    for T in (1, 31, 32, 65, 1000, 4097):
        yield None, 1, T, 16, 1, 128, 128, torch.bfloat16
    for G, (Dk, Dv) in itertools.product((1, 2, 4, 8, 16, 32), ((64, 64), (128, 128), (192, 128), (256, 256))):
        yield None, 1, 65, G, 1, Dk, Dv, torch.bfloat16
    yield None, 3, 300, 8, 2, 128, 64, torch.float16
    yield [0, 1, 31, 32, 0, 700, 65, 1], 1, None, 16, 2, 128, 128, torch.bfloat16
    yield [0, 0], 1, None, 4, 1, 64, 64, torch.float16
    yield [4097, 1], 1, None, 4, 1, 192, 128, torch.bfloat16
    # the dense core's other forms: packed with Dk != Dv and fp16, one packed sequence (the dense call),
    # V padded in the folded rows (fp16, with and without tail tokens), Dk < Dv
    yield [0, 1, 31, 32, 0, 700, 65, 1], 1, None, 8, 2, 192, 128, torch.float16
    yield [0, 4097, 0], 1, None, 8, 2, 128, 128, torch.bfloat16
    for T in (4097, 4111):
        yield None, 1, T, 8, 2, 128, 64, torch.float16
    yield None, 2, 1000, 8, 2, 64, 128, torch.bfloat16


def main() -> int:
    dev = torch.device("cuda")
    bad = 0
    for lengths, B, T, Hq, Hkv, Dk, Dv, dtype in cases():
        cu = None
        if lengths is not None:
            T = sum(lengths)
            cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=dev)
        xs = [torch.randn(B, T, h, d, device=dev, dtype=dtype, requires_grad=True)
              for h, d in ((Hq, Dk), (Hkv, Dk), (Hkv, Dv))]
        g = torch.rand(B, T, Hq, 3, device=dev, dtype=dtype, requires_grad=True)
        telemetry.reset()
        out = nsa_attention(*xs, g, CFG, cu_seqlens=cu)
        grads = torch.autograd.grad(out.float().sum(), [*xs, g]) if T else ()
        torch.cuda.synchronize()
        served = {s: sorted(telemetry.served(s)) for s in ("cmp", "topn", "sel", "win", "combine")}
        fused = served["sel"] == ["triton"] and served["combine"] == ["triton"] and served["topn"] == ["triton"]
        events = telemetry.snapshot()["events"]
        core = any(e["event"] == "dense_core" for e in events)
        fold = [e["event"] for e in events if e["branch"] == "cmp" and e["event"].startswith("fold_")]
        # Small head-dim-192 windows leave torch's FA-2 (its split-KV path writes past the LSE), and with the
        # window off FA-2 the steps run as separate operations: the guard's reason says so.
        splitkv = any(r["branch"] == "win" and r["reason"] == "splitkv_lse" for r in telemetry.snapshot()["counts"])
        ok = bool(torch.isfinite(out).all()) and all(bool(torch.isfinite(x).all()) for x in grads) and (
            (fused and (core or splitkv)) or T == 0)
        bad += not ok
        print(f"lengths={lengths} B={B} T={T} Hq={Hq} Hkv={Hkv} D={Dk}/{Dv} {dtype}: {'ok' if ok else 'BAD'} {served}"
              f"{' dense_core ' + ','.join(fold) if core else ''}", flush=True)
    # The kernels alone in fp32 (the fused pipeline needs fp16/bf16 for FA-2).
    from nsa.branches.selected.naive import top_n_blocks
    from nsa.kernels.triton.selection import selected_attention_triton
    from nsa.kernels.triton.topn import topn_triton
    from nsa.layout import dense_layout

    for T, G, D in ((1, 1, 64), (97, 3, 192), (4097, 4, 256)):
        q = torch.randn(1, T, 2 * G, D, device=dev, requires_grad=True)
        k = torch.randn(1, T, 2, D, device=dev, requires_grad=True)
        lay = dense_layout(1, T, CFG, dev)
        kc = torch.randn(1, max(CFG.n_cmp_blocks(T), 0), 2, D, device=dev)
        lse = torch.randn(1, T, 2 * G, device=dev) + 3
        idx = topn_triton(q, kc, lse, lay.seq_start, lay.cmp_slot0, CFG, D ** -0.5)
        scores = torch.rand(1, T, 2, CFG.n_sel_blocks(T), device=dev)
        idx2 = top_n_blocks(scores, torch.arange(T, device=dev)[None], CFG).to(torch.int32)
        o = selected_attention_triton(q, k, k, idx2, lay.seq_start, CFG)
        torch.autograd.grad(o.sum(), (q, k))
        torch.cuda.synchronize()
        ok = bool((idx >= -1).all()) and bool(torch.isfinite(o).all())
        bad += not ok
        print(f"kernels fp32 T={T} G={G} D={D}: {'ok' if ok else 'BAD'}", flush=True)
    # The sliding-window kernels alone (Hopper): windows of 1, of a tile plus 2 (a query tile of its own in the
    # dK/dV walk), wider than T; T below one tile and ragged.
    from nsa.kernels.triton.window import supported, window_backward, window_forward

    for T, w, G, D in ((1, 512, 16, 64), (97, 1, 3, 128), (4097, 66, 4, 128), (777, 1000, 2, 256)):
        q = torch.randn(1, T, 2 * G, D, device=dev, dtype=torch.bfloat16)
        k, v = (torch.randn(1, T, 2, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
        if not supported(q, k, v)[0]:
            print(f"window kernels T={T}: not run here ({supported(q, k, v)[1]})", flush=True)
            continue
        o, lse = window_forward(q, k, v, w, D ** -0.5)
        grads = window_backward(torch.randn_like(o), q, k, v, o, lse, w, D ** -0.5)
        torch.cuda.synchronize()
        ok = bool(torch.isfinite(o).all()) and all(bool(torch.isfinite(x).all()) for x in grads)
        bad += not ok
        print(f"window kernels T={T} w={w} G={G} D={D}: {'ok' if ok else 'BAD'}", flush=True)
    bad += cmp_kernel_cases(dev)
    bad += offset_cases(dev)
    print(f"nsa edge sweep: {bad} bad case(s)")
    return 1 if bad else 0


def cmp_kernel_cases(dev) -> int:
    """The compressed-branch kernels alone (Hopper): no block at all, one block, the staircase across tiles, a
    cache longer than T sees, Dk=192 / Dv=128 as two column tiles, fp16; and the dense core running them."""
    from nsa.kernels.triton.cmp_attn import cmp_backward, cmp_forward, supported

    bad = 0
    for T, G, Dk, Dv, extra, dtype in ((20, 16, 128, 128, 0, torch.bfloat16), (32, 4, 64, 64, 0, torch.float16),
                                       (4097, 16, 128, 128, 3, torch.bfloat16), (1111, 8, 192, 128, 0, torch.bfloat16),
                                       (777, 2, 256, 256, 1, torch.float16)):
        N = max(0, (T - CFG.block_cmp) // CFG.stride_cmp + 1) + extra
        q = torch.randn(1, T, 2 * G, Dk, device=dev, dtype=dtype)
        kc = torch.randn(1, N, 2, Dk, device=dev, dtype=dtype)
        vc = torch.randn(1, N, 2, Dv, device=dev, dtype=dtype)
        if not supported(q, kc, vc)[0]:
            print(f"cmp kernels T={T}: not run here ({supported(q, kc, vc)[1]})", flush=True)
            continue
        o, lse = cmp_forward(q, kc, vc, CFG.block_cmp, CFG.stride_cmp, Dk ** -0.5)
        grads = cmp_backward(torch.randn_like(o), q, kc, vc, o, lse, CFG.block_cmp, CFG.stride_cmp, Dk ** -0.5)
        torch.cuda.synchronize()
        ok = bool(torch.isfinite(o).all()) and all(bool(torch.isfinite(x).all()) for x in grads)
        bad += not ok
        print(f"cmp kernels T={T} G={G} Dk={Dk} Dv={Dv}: {'ok' if ok else 'BAD'}", flush=True)
    os.environ["NSA_TRITON_CMP_MAX_LEN"] = "65536"
    try:
        for T, Dk, Dv in ((65, 128, 128), (4097, 192, 128)):
            xs = [torch.randn(1, T, h, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
                  for h, d in ((8, Dk), (2, Dk), (2, Dv))]
            g = torch.rand(1, T, 8, 3, device=dev, dtype=torch.bfloat16, requires_grad=True)
            telemetry.reset()
            out = nsa_attention(*xs, g, CFG)
            grads = torch.autograd.grad(out, (*xs, g), torch.randn_like(out))
            torch.cuda.synchronize()
            ran = telemetry.served("cmp") == {"triton_cmp": 1}
            ok = ran and bool(torch.isfinite(out).all()) and all(bool(torch.isfinite(x).all()) for x in grads)
            bad += not ok
            print(f"dense core with the cmp kernels T={T} Dk={Dk} Dv={Dv}: {'ok' if ok else 'BAD'}"
                  f"{'' if ran else ' (they did not serve)'}", flush=True)
    finally:
        del os.environ["NSA_TRITON_CMP_MAX_LEN"]
    return bad


def offset_cases(dev) -> int:
    """Context parallelism's per-rank fused path (nsa.run.offset_core): queries at stream offsets against the
    stream before them, forward and backward; offsets at 0, mid-row and mid-window, a ragged last segment,
    two zigzag segments, a segment shorter than a row. Returns the bad cases."""
    from nsa.distributed.local import compress_prefix, nsa_local, plan_local

    bad = 0
    for T, segs, Dk, Dv in ((4111, [(0, 1000)], 128, 128), (4111, [(1037, 2000)], 128, 128),
                            (4111, [(3000, 1111)], 192, 128), (4111, [(5, 20), (4000, 111)], 128, 128),
                            (700, [(33, 40)], 64, 64), (700, [(50, 7)], 64, 64)):
        xs = [torch.randn(1, T, h, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
              for h, d in ((8, Dk), (2, Dk), (2, Dv))]
        g = torch.rand(1, T, 8, 3, device=dev, dtype=torch.bfloat16, requires_grad=True)
        q, k, v = xs
        end = max(s + n for s, n in segs)
        local = [torch.cat([x[:, s:s + n] for s, n in segs], 1).detach() for x in xs]
        telemetry.reset()
        plan, path, reason = plan_local("auto", *local, CFG, None, None, None, False)
        if path != "fused":  # the path itself is tests/gpu/test_cp_fused_gpu.py's to check
            print(f"cp offsets T={T} segments={segs}: not fused here ({reason})", flush=True)
            continue
        outs = [nsa_local(q[:, s:s + n], g[:, s:s + n], k, v, CFG, s, prefix_end=end, plan=plan,
                          compressed=compress_prefix(k, v, CFG, end, 1))[0] for s, n in segs]
        grads = torch.autograd.grad(sum(o.float().sum() for o in outs), [*xs, g])
        torch.cuda.synchronize()
        ok = all(bool(torch.isfinite(x).all()) for x in (*outs, *grads))
        bad += not ok
        print(f"cp offsets T={T} segments={segs} D={Dk}/{Dv}: {'ok' if ok else 'BAD'}", flush=True)
    return bad


if __name__ == "__main__":
    sys.exit(main())
