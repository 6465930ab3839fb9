"""Compile the Triton selection backward kernels for a GPU target on any machine (no GPU needed).

    python bench/triton_sel_compile_check.py [--arch 90] [--quick] [--dtypes bf16,fp32] [--G 1,16,64]
                                             [--D 64,128,192/128,256]

The launches are the backward's own (nsa.kernels.triton.selection_bwd.backward_launches, with the launch
parameters bwd_config picks for a CUDA device), specialized by Triton's own argument binder as a real
launch would be, compiled by Triton for the target and assembled by the ptxas Triton ships. Prints
registers, spilled bytes and shared memory per kernel; exits 1 when a kernel does not compile or needs more
shared memory than the target has. Triton's interpreter must be off (TRITON_INTERPRET unset). Catches what
the CPU interpreter cannot: typing and lowering errors, register spills, shared memory overflows.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SMEM_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}  # bytes per block (opt-in maximum)
QUICK = dict(dtypes="bf16", G="16", D="128,192/128")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def compile_launch(kernel, args, kwargs, target, backend):
    """Triton's JIT path without a device: bind and specialize the arguments, then compile."""
    import triton
    from triton.compiler import ASTSource
    from triton.runtime.jit import create_function_from_signature

    kwargs = dict(kwargs, debug=False)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, spec, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, spec, options)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)


def ptxas_usage(ptx: str, arch: int) -> tuple[int, int]:
    """(registers, spill store bytes) from the ptxas Triton ships, -v."""
    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        name = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        res = subprocess.run([str(ptxas), "-v", f"--gpu-name={name}", str(src), "-o", os.devnull],
                             capture_output=True, text=True, check=True)
    regs = re.search(r"Used (\d+) registers", res.stderr)
    spill = re.search(r"(\d+) bytes spill stores", res.stderr)
    return int(regs.group(1)) if regs else -1, int(spill.group(1)) if spill else 0


def case_inputs(G, Dk, Dv, dtype, T=256, Hkv=2, ls=64, n=4):
    from nsa import NSAConfig
    from nsa.branches.selected.naive import top_n_blocks

    gen = torch.Generator().manual_seed(0)
    Hq = G * Hkv
    q = torch.randn(1, T, Hq, Dk, generator=gen).to(dtype)
    k = torch.randn(1, T, Hkv, Dk, generator=gen).to(dtype)
    v = torch.randn(1, T, Hkv, Dv, generator=gen).to(dtype)
    o = torch.randn(1, T, Hq, Dv, generator=gen).to(dtype)
    lse = torch.randn(1, T, Hq, generator=gen)
    cfg = NSAConfig(block_cmp=32, stride_cmp=16, block_sel=ls, n_sel=n, n_init=1, n_local=2, window=64)
    pos = torch.arange(T)[None]
    idx = top_n_blocks(torch.rand(1, T, Hkv, cfg.n_sel_blocks(T), generator=gen), pos, cfg).int()
    return q, k, v, o, lse, idx, torch.zeros(1, T, dtype=torch.int32), ls


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability as an int (80, 90)")
    ap.add_argument("--dtypes", default="bf16,fp16,fp32")
    ap.add_argument("--G", default="1,3,16,64")
    ap.add_argument("--D", default="64,128,192/128,256")
    ap.add_argument("--quick", action="store_true", help=f"only {QUICK}")
    args = ap.parse_args(argv)
    if args.quick:  # the quick set where the option was not given
        vars(args).update({key: val for key, val in QUICK.items() if getattr(args, key) == ap.get_default(key)})
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: the interpreter replaces the kernels this script compiles")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    from nsa.kernels.triton import selection_bwd

    target = GPUTarget("cuda", args.arch, 32)
    backend = make_backend(target)
    limit = SMEM_LIMIT.get(args.arch, 101376)
    failures = 0
    for dt in args.dtypes.split(","):
        for G in (int(g) for g in args.G.split(",")):
            for dims in args.D.split(","):
                Dk, _, Dv = dims.partition("/")
                Dk, Dv = int(Dk), int(Dv or Dk)
                q, k, v, o, lse, idx, ss, ls = case_inputs(G, Dk, Dv, DTYPES[dt])
                cfg = selection_bwd.bwd_config(G, Dk, Dv, ls, q.dtype, torch.device("cuda"))
                _, launches = selection_bwd.backward_launches(torch.randn_like(o), q, k, v, o, lse, idx, ss, ls,
                                                              Dk ** -0.5, cfg=cfg, n_programs=264)
                for kernel, _, kargs, kwargs in launches:
                    name = kernel.__name__.replace("_sel_bwd_", "").replace("_kernel", "")
                    label = f"{name:6} {dt} G={G:<3} D={Dk}/{Dv:<4} warps={kwargs.get('num_warps')} " \
                            f"stages={kwargs.get('num_stages', 1)}"
                    try:
                        ck = compile_launch(kernel, kargs, kwargs, target, backend)
                        regs, spill = ptxas_usage(ck.asm["ptx"], args.arch)
                        smem = ck.metadata.shared
                        bad = smem > limit
                        failures += bad
                        print(f"{label}  regs={regs:3} spill={spill:5}B smem={smem:6}B"
                              f"{'  SHARED MEMORY OVER ' + str(limit) if bad else ''}", flush=True)
                    except Exception as e:  # noqa: BLE001 - report every failing kernel, then fail
                        failures += 1
                        print(f"{label}  FAILED: {type(e).__name__}: {str(e)[:1500]}", flush=True)
    print(f"compile check (sm_{args.arch}): {failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
