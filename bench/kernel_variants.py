"""Time edited copies of a kernel module side by side (what a change to a kernel's body costs or saves).

    PYTHONPATH=. python bench/kernel_variants.py --kernel topn --T 65536
    PYTHONPATH=. python bench/kernel_variants.py --kernel sel_fwd --T 65536

Each variant is the module's source with one textual edit (see VARIANTS); a variant that computes a
different function is labelled "timing only" and exists to measure what a part of the kernel costs.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

VARIANTS = {
    "topn": {
        "file": "nsa/kernels/triton/topn.py",
        "variants": {
            "as is": [],
            "no insertion (timing only)": [("                while tl.max((best > thr).to(tl.int32), axis=0) > 0:",
                                            "                while tl.max((best > thr).to(tl.int32), axis=0) > 1:")],
            "no tail blocks (timing only)": [("R=r, C=c, C_PAD=c_pad", "R=r, C=0, C_PAD=c_pad")],
            "causal mask on every chunk": [("                if (j0 + BLOCK_J) * R - 1 > i_full:",
                                            "                if (j0 + BLOCK_J) * R - 1 > -2:")],
            "no exp2 (timing only)": [("p += tl.exp2(s * qk_scale - lse2p[:, None])",
                                       "p += s * qk_scale - lse2p[:, None]")],
        },
    },
    "sel_fwd": {
        "file": "nsa/kernels/triton/selection_fwd.py",
        "variants": {
            "as is": [],
            "pointer loads, no TMA": [("use_tma = tma.supported(k, v) if", "use_tma = False if")],
        },
    },
}


def load(path: Path, edits, name: str):
    src = path.read_text().replace("from ... import", "from nsa import")
    src = src.replace("from . import", "from nsa.kernels.triton import")
    src = re.sub(r"^from \.(\w)", r"from nsa.kernels.triton.\1", src, flags=re.M)  # from .common import ...
    for a, b in edits:
        if a not in src:
            raise SystemExit(f"variant {name!r}: text not found: {a[:60]!r}")
        src = src.replace(a, b)
    tmp = Path(tempfile.mkdtemp()) / f"variant_{abs(hash(name))}.py"
    tmp.write_text(src)
    spec = importlib.util.spec_from_file_location(tmp.stem, tmp)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv=None):
    import triton

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernel", default="topn", choices=sorted(VARIANTS))
    ap.add_argument("--T", type=int, default=65536)
    args = ap.parse_args(argv)
    from nsa import NSAConfig
    from nsa import plan as planning
    from nsa.compress import compress_kv
    from nsa.layout import dense_layout

    dev, cfg, T = torch.device("cuda"), NSAConfig(), args.T
    q = torch.randn(1, T, 64, 128, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, T, 4, 128, device=dev, dtype=torch.bfloat16)
    layout = dense_layout(1, T, cfg, dev)
    scale = cfg.softmax_scale(128)
    kc, vc = compress_kv(k, k, layout, cfg)
    _, lse = planning.make_plan("auto", q, k, k, cfg).cmp.fn(q, kc, vc, layout, cfg, scale)
    spec = VARIANTS[args.kernel]
    if args.kernel == "sel_fwd":
        from nsa.kernels.triton.topn import topn_triton

        v = torch.randn_like(k)
        idx = topn_triton(q, kc, lse, layout.seq_start, layout.cmp_slot0, cfg, scale)
    for name, edits in spec["variants"].items():
        mod = load(ROOT / spec["file"], edits, name)
        if args.kernel == "sel_fwd":
            fn = lambda m=mod: m.sel_forward(q, k, v, idx, layout.seq_start, cfg.block_sel, scale)  # noqa: E731
        else:
            fn = lambda m=mod: m.topn_triton(q, kc, lse, layout.seq_start, layout.cmp_slot0, cfg, scale)  # noqa: E731
        fn()
        ms = triton.testing.do_bench(fn, rep=200)
        print(f"{args.kernel} T={T} {name:32} {ms:8.3f} ms", flush=True)


if __name__ == "__main__":
    main()
