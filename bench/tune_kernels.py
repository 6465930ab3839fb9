"""Launch-configuration sweep of NSA's Triton kernels on one GPU: the data behind their launch tables.

    PYTHONPATH=. python bench/tune_kernels.py --out DIR [--T 16384,65536] [--kernels topn,sel_fwd,sel_dq,sel_bwd,window]

For the paper's heads (Hq=64, Hkv=4, D=128, bf16, paper blocks) and each T:
- the fused top-n kernel (nsa.kernels.triton.topn) over tokens per program x blocks per chunk x stages x
  warps, with TMA copies of q and of the key chunks (the launch's choice on Hopper), and the default tiles
  with pointer loads;
- the selected-attention forward with the gate combine in its epilogue, as the dense core runs it
  (nsa.kernels.triton.selection_fwd), over key-tile length x pipeline stages x warps (TMA copies, one
  token per program, the launch table's choice against the pointer-load one);
- the sliding-window forward (nsa.kernels.triton.window) over query tile x key tile x warps x stages
  beside FA-2's window forward (`fa2_window` rows);
- the selection backward's dq kernel over warps x key-tile length x stages (`sel_dq`), and the whole
  selection backward as it is (`sel_bwd`).
Each against dense causal FA-2 forward in the same process. Medians of triton.testing.do_bench with
min/max; CSV + JSON in --out; the fastest configuration per kernel is printed last. Every configuration's
output is compared with the default configuration's (indices equal, outputs within 1e-2) so a fast but
wrong configuration cannot win.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from nsa import NSAConfig  # noqa: E402
from nsa.benchutil import env_metadata, write_csv, write_json  # noqa: E402


def bench(fn, rep=200):
    import triton

    ms = triton.testing.do_bench(fn, rep=rep, return_mode="all")
    ms = sorted(ms)
    return ms[len(ms) // 2], ms[0], ms[-1]


def sweep(T, args, kernels):
    """Rows of every configuration of the selected kernels at one T."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from nsa import plan as planning
    from nsa.compress import compress_kv
    from nsa.kernels.triton import tma
    from nsa.kernels.triton.combine import Segments
    from nsa.kernels.triton.selection import sel_backward
    from nsa.kernels.triton.selection_fwd import launch_config, sel_forward
    from nsa.kernels.triton.topn import tile_config, topn_triton
    from nsa.kernels.triton.window import launch_config as window_config
    from nsa.kernels.triton.window import window_forward
    from nsa.layout import dense_layout

    dev, cfg = torch.device("cuda"), NSAConfig()
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(1, T, args.Hq, args.D, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, T, args.Hkv, args.D, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, T, args.Hkv, args.D, device=dev, dtype=torch.bfloat16, generator=g)
    layout = dense_layout(1, T, cfg, dev)
    scale = cfg.softmax_scale(args.D)
    kc, vc = compress_kv(k, v, layout, cfg)
    o_cmp, lse = planning.make_plan("auto", q, k, v, cfg).cmp.fn(q, kc, vc, layout, cfg, scale)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        dense = bench(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True), args.rep)[0]
    G = args.Hq // args.Hkv
    ss = layout.seq_start_i32

    def topn(conf=None):
        return topn_triton(q, kc, lse, layout.seq_start, layout.cmp_slot0, cfg, scale, config=conf)

    # The selection forward as the dense core runs it: the gate combine in its epilogue.
    gates = torch.rand(1, T, args.Hq, 3, device=dev, dtype=torch.bfloat16, generator=g)
    combine = (gates, Segments.whole(o_cmp), torch.randn_like(o_cmp))

    def sel(conf=None):
        return sel_forward(q, k, v, base_idx, ss, cfg.block_sel, scale, config=conf, combine=combine)[1:]

    def window(conf=None):
        return window_forward(q, k, v, cfg.window, scale, config=conf)

    base_idx = topn()
    o_ref, lse_ref = sel()
    grids = []
    if "window" in kernels:
        fa2 = planning.PROVIDERS["torch_flash"]
        win_ref, _ = fa2.attn(q, k, v, causal=False, left=cfg.window - 1, scale=scale, varlen=None, need_lse=False)
        med, lo, hi = bench(lambda: fa2.attn(q, k, v, causal=False, left=cfg.window - 1, scale=scale, varlen=None,
                                             need_lse=False), args.rep)
        rows_fa2 = [{"kernel": "fa2_window", "T": T, "config": {}, "default": False, "median_ms": med, "min_ms": lo,
                     "max_ms": hi, "dense_fa2_fwd_ms": dense, "status": "ok"}]
        print(f"fa2_window T={T:6} {med} ms", flush=True)
        grids.append(("window", window_config(args.D), window,
                      lambda out: bool(((out[0].float() - win_ref.float()).abs().max() < 1e-2).item()),
                      [{"BM": bm, "BN": bn, "STAGES": st, "num_warps": nw}
                       for bm, bn, st, nw in itertools.product((64, 128), (32, 64, 128), (2, 3, 4), (4, 8))
                       if bm % bn == 0]))
    else:
        rows_fa2 = []
    if "topn" in kernels:
        # The launch picks TMA copies of q and of the key chunks where the GPU has them (Hopper).
        default = {**tile_config(args.D), "TMA_Q": tma.supported(q)}
        grid = [{"BLOCK_T": bt, "CMP_PER_CHUNK": cpc, "HEAD_STAGES": hs, "num_warps": nw, "SHIFT_TAIL": True,
                 "TMA_Q": True} for bt, cpc, hs, nw in itertools.product((64, 128), (64, 128, 256), (2, 3, 4), (4, 8))]
        grid.append({**tile_config(args.D), "TMA_Q": False})  # pointer loads
        grids.append(("topn", default, topn, lambda out: bool(torch.equal(out, base_idx)), grid))
    if "sel_fwd" in kernels:
        default = launch_config(G, args.D, args.D, cfg.block_sel, q.dtype, tma=tma.supported(k, v), combine=True)
        grid = [{"TMA": True, "TOKENS": 1, "BLOCK_N": bn, "STAGES": st, "num_warps": nw}
                for bn, st, nw in itertools.product((16, 32, 64), (2, 3, 4), (1, 2))]
        grid.append({"TMA": False, "TOKENS": 2, "BLOCK_N": 64, "STAGES": 3, "num_warps": 4})
        grids.append(("sel_fwd", default, sel, lambda out: bool(((out[0].float() - o_ref.float()).abs().max()
                                                                 < 1e-2).item()), grid))
    if "sel_dq" in kernels:  # the selection backward's dq kernel alone (its first launch), over warps x tile x stages
        import copy

        import triton

        from nsa.kernels.triton.selection_bwd import backward_launches, bwd_config

        do = torch.randn_like(o_ref)
        base = bwd_config(G, args.D, args.D, cfg.block_sel, q.dtype, dev, tma=tma.supported(k, v))
        dq_default = {k_: base["dq"][k_] for k_ in ("num_warps", "BLOCK_N", "NUM_STAGES")}
        launched = {}

        def sel_dq(conf):
            key = tuple(sorted(conf.items()))
            if key not in launched:  # outputs and launch arguments made once: the timing is the kernel's
                c = copy.deepcopy(base)
                c["dq"].update(conf, N_SUB=triton.cdiv(cfg.block_sel, conf["BLOCK_N"]), num_stages=conf["NUM_STAGES"])
                (dq, _, _), launches = backward_launches(do, q, k, v, o_ref, lse_ref, base_idx, ss, cfg.block_sel,
                                                         scale, cfg=c)
                launched[key] = dq, next(launches)
            dq, (kern, grid_, a, kw) = launched[key]
            kern[grid_](*a, **kw)
            return dq

        dq_ref = sel_dq(dq_default).clone()
        grids.append(("sel_dq", dq_default, sel_dq,
                      lambda out: bool(((out.float() - dq_ref.float()).abs().max() < 1e-2).item()),
                      [{"num_warps": nw, "BLOCK_N": bn, "NUM_STAGES": st}
                       for nw, bn, st in itertools.product((1, 2, 4), (16, 32, 64), (2, 3, 4))]))
    rows = rows_fa2
    for name, default, fn, check, confs in grids:
        for conf in confs:
            try:
                status = "ok" if check(fn(conf)) else "WRONG"
                med, lo, hi = bench(lambda c=conf, f=fn: f(c), args.rep)
            except Exception as e:  # noqa: BLE001 - a configuration that fails to compile is reported, not fatal
                med = lo = hi = None
                status = f"error: {type(e).__name__}: {str(e).splitlines()[0][:100]}"
            is_default = conf == {k_: default.get(k_) for k_ in conf}
            rows.append({"kernel": name, "T": T, "config": conf, "default": is_default,
                         "median_ms": med, "min_ms": lo, "max_ms": hi, "dense_fa2_fwd_ms": dense, "status": status})
            print(f"{name:8} T={T:6} {conf} {med} ms {status}", flush=True)
    if "sel_bwd" in kernels:
        do = torch.randn_like(o_ref)
        med, lo, hi = bench(lambda: sel_backward(do, q, k, v, o_ref, lse_ref, base_idx, ss, cfg.block_sel, scale),
                            args.rep)
        rows.append({"kernel": "sel_bwd", "T": T, "config": {}, "default": True, "median_ms": med, "min_ms": lo,
                     "max_ms": hi, "dense_fa2_fwd_ms": dense, "status": "ok"})
        print(f"sel_bwd  T={T:6} {med} ms", flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--T", default="16384,65536")
    ap.add_argument("--kernels", default="topn,sel_fwd,sel_dq,sel_bwd")
    ap.add_argument("--Hq", type=int, default=64)
    ap.add_argument("--Hkv", type=int, default=4)
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--rep", type=int, default=200, help="do_bench repetition time (ms)")
    args = ap.parse_args(argv)
    kernels = args.kernels.split(",")
    rows = []
    for T in (int(x) for x in args.T.split(",")):
        rows += sweep(T, args, kernels)
        torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for r in rows:
        r["config"] = " ".join(f"{k_}={v_}" for k_, v_ in r["config"].items())
    write_csv(out / "tune_kernels.csv", rows)
    write_json(out / "tune_kernels.json", {"env": env_metadata(torch.device("cuda")), "args": vars(args), "rows": rows})
    print("\nfastest correct configuration per kernel and T:")
    for key in sorted({(r["kernel"], r["T"]) for r in rows}):
        ok = [r for r in rows if (r["kernel"], r["T"]) == key and r["status"] == "ok" and r["median_ms"]]
        if ok:
            best = min(ok, key=lambda r: r["median_ms"])
            dflt = next((r for r in ok if r["default"]), None)
            print(f"  {key[0]:8} T={key[1]:6} best {best['median_ms']:.3f} ms [{best['config']}]"
                  f"  default {dflt['median_ms'] if dflt else '-'} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
