"""Compile every Triton kernel of the library for a GPU target on any machine (no GPU needed), with the launch
configuration the host code picks on that GPU class, and check it fits the target.

    python bench/triton_compile_check.py --arch 80|90 [--full] [--kernels topn,sel_fwd,...]
                                         [--dtypes bf16,fp16,fp32 --G 1,16,64 --D 64,128,192/128,256]

Cases: the quick set by default (bf16 at D=128 and Dk=192/Dv=128, fp32 at D=128, 16 query heads per KV
head); --full, or any of --dtypes / --G / --D, takes every combination (--full: all of the values above).

How: the real host launchers (top-n, selection forward with and without the combine epilogue, selection
backward, window forward and backward, gate combine, the decode step) run on small CPU tensors as if they
were on the target GPU (nsa.hooks.HOOKS.pretend_gpu), and every device query they make answers as that GPU
would (compute capability, SM count, the opt-in shared memory per block through Triton's driver), so they
choose the tiles, warps, stages and TMA-or-pointer loads that GPU class gets.
Each launch is recorded instead of run (JITFunction.run is replaced), then bound and specialized by
Triton's own argument binder, compiled for the target and assembled by the ptxas Triton ships (its log
gives registers and spills). The reverse index of the selection backward is torch operations only: it runs
on the CPU tensors and has nothing to compile.

Fails (exit 1) on: a kernel that does not compile; shared memory over the target's opt-in limit per block;
registers x threads over the register file (65536 per SM on sm 8.0 and 9.0, allocated 8 per thread at a
time), which CUDA refuses to launch; spill stores above SPILL_LIMIT (2 KB) per thread in a 16-bit kernel
(fp32's are reported); a grid axis past CUDA's limits. Prints one row per distinct compile (kernel, dtype,
shape, warps, stages, registers, spill bytes, shared memory). Triton's interpreter must be off
(TRITON_INTERPRET unset).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import os
import re
import sys
import types
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Opt-in shared memory per block (bytes; cudaDevAttrMaxSharedMemoryPerBlockOptin) and SMs of each target's
# reference GPU (A100 SXM: 108, A10/RTX 30xx class: 84, L4/L40 class: 58, H100 SXM: 132).
SMEM_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}
SM_COUNT = {80: 108, 86: 84, 89: 58, 90: 132}
REGS_PER_SM = 65536
# Spill stores tolerated per thread in the 16-bit kernels (the fast paths): twice the largest spill of the
# tuned sm 9.0 tables (the window dK/dV at D=256, 32 x 32 tiles: 1124 bytes; the selection dK/dV at D=128, whose
# 64-token sub-tiles measured fastest with 220 bytes: selection_bwd.bwd_config), so the shipped sm 9.0 choices
# pass and what the limit catches is a tile that outgrew the register file: ptxas giving up at 32 registers
# with tens of KB of local memory per thread (the top-n's sm 9.0 entry compiled for sm 8.0 at one head per
# group: 28 KB), where local-memory traffic dominates the kernel. fp32 inputs take IEEE fp32 dots on CUDA
# cores, the exact path, whose tiles are sized for shared memory: several of its kernels spill kilobytes on
# sm 9.0 as on sm 8.0, a matter of speed, not of running, so its spills past the limit are reported (NOTE).
SPILL_LIMIT = 2048
GRID_LIMIT = (2**31 - 1, 65535, 65535)

KERNELS = (
    "topn",
    "sel_fwd",
    "sel_fwd_combine",
    "sel_bwd",
    "sel_bwd_accumulate",
    "window_fwd",
    "window_bwd",
    "combine_fwd",
    "combine_bwd",
    "decode",
    "decode_paged",
    "rope",
)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
QUICK = (("bf16", 16, "128"), ("bf16", 16, "192/128"), ("fp32", 16, "128"))
FULL = dict(dtypes="bf16,fp16,fp32", G="1,16,64", D="64,128,192/128,256")


@dataclasses.dataclass(frozen=True)
class Case:
    dtype: torch.dtype
    G: int
    Dk: int
    Dv: int
    B: int = 1
    T: int = 512
    Hkv: int = 2

    @property
    def label(self) -> str:
        name = {v: k for k, v in DTYPES.items()}[self.dtype]
        return f"{name} G={self.G} D={self.Dk}/{self.Dv}"


@dataclasses.dataclass
class Launch:
    family: str
    case: Case
    kernel: object
    grid: tuple
    args: tuple
    kwargs: dict


# --- a pretended GPU -----------------------------------------------------------------------------------------


class _FakeDriver:
    """What the host code asks Triton's driver (device properties, the target) answered for `arch`."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)
        props = {
            "max_shared_mem": SMEM_LIMIT[arch],
            "multiprocessor_count": SM_COUNT[arch],
            "max_num_regs": REGS_PER_SM,
            "warpSize": 32,
        }
        self.utils = types.SimpleNamespace(get_device_properties=lambda index: dict(props))

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0


@contextlib.contextmanager
def pretend_gpu(arch: int, launches: list, state: dict):
    """Inside: the launchers take CPU tensors for a sm `arch` GPU's (nsa.hooks.HOOKS.pretend_gpu), every device
    query they make answers as that GPU would, and kernel launches are appended to `launches` (with state's
    family and case) instead of running."""
    from triton.runtime import driver as triton_driver
    from triton.runtime.jit import JITFunction

    from nsa.hooks import HOOKS

    props = types.SimpleNamespace(
        multi_processor_count=SM_COUNT[arch],
        major=arch // 10,
        minor=arch % 10,
        name=f"pretended sm_{arch}",
        total_memory=80 << 30,
    )

    def capture(self, *args, grid, warmup, **kwargs):
        grid = grid if callable(grid) else tuple(grid)  # a callable grid takes the bound arguments: not checked
        launches.append(Launch(state["family"], state["case"], self, grid, args, kwargs))

    saved_driver = triton_driver._active
    triton_driver._active = _FakeDriver(arch)
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(mock.patch.object(HOOKS, "pretend_gpu", (arch // 10, arch % 10)))
            stack.enter_context(mock.patch.object(torch.cuda, "is_available", lambda: True))
            stack.enter_context(mock.patch.object(torch.cuda, "current_device", lambda: 0))
            stack.enter_context(mock.patch.object(torch.cuda, "get_device_properties", lambda device=None: props))
            stack.enter_context(mock.patch.object(JITFunction, "run", capture))
            yield
    finally:
        triton_driver._active = saved_driver


# --- the launchers, as the library calls them ------------------------------------------------------------------


def _empty(*shape, dtype):
    return torch.empty(*shape, dtype=dtype)  # values are never read: nothing runs


def _nsa_config():
    from nsa import NSAConfig

    return NSAConfig()  # the paper's blocks: l=32, d=16, l'=64, n=16, w=512


def run_family(family: str, c: Case) -> str | None:
    """Call the launcher(s) of `family` for case `c` (inside pretend_gpu); a reason when it does not apply."""
    cfg = _nsa_config()
    Hq, dt = c.G * c.Hkv, c.dtype
    q = _empty(c.B, c.T, Hq, c.Dk, dtype=dt)
    k = _empty(c.B, c.T, c.Hkv, c.Dk, dtype=dt)
    v = _empty(c.B, c.T, c.Hkv, c.Dv, dtype=dt)
    scale = c.Dk**-0.5
    n = cfg.n_sel
    idx = torch.zeros(c.B, c.T, c.Hkv, n, device="cpu", dtype=torch.int32)
    ss = torch.zeros(c.B, c.T, device="cpu", dtype=torch.int32)
    if family == "topn":
        from nsa.branches.selected import triton as sel
        from nsa.layout import dense_layout

        layout = dense_layout(c.B, c.T, cfg, torch.device("cpu"))
        k_cmp = _empty(c.B, cfg.n_cmp_blocks(c.T), c.Hkv, c.Dk, dtype=dt)
        lse = torch.empty(c.B, c.T, Hq, device="cpu", dtype=torch.float32)
        sel.top_n(q, k_cmp, lse, layout, cfg, scale)
    elif family in ("sel_fwd", "sel_fwd_combine"):
        from nsa.branches.combine import triton as comb
        from nsa.branches.selected import triton as sel

        combine = None
        if family == "sel_fwd_combine":  # as the dense core calls it: o_cmp rows by view and a short tail
            gates = _empty(c.B, c.T, Hq, 3, dtype=dt)
            seg = comb.segments(_empty(c.B, c.T - 32, Hq, c.Dv, dtype=dt), 31, _empty(c.B, 1, Hq, c.Dv, dtype=dt))
            combine = (gates, seg, _empty(c.B, c.T, Hq, c.Dv, dtype=dt))
        sel.forward(q, k, v, idx, ss, cfg.block_sel, scale, combine=combine)
    elif family in ("sel_bwd", "sel_bwd_accumulate"):
        from nsa.branches.selected import triton as sel

        o, do = _empty(c.B, c.T, Hq, c.Dv, dtype=dt), _empty(c.B, c.T, Hq, c.Dv, dtype=dt)
        lse = torch.empty(c.B, c.T, Hq, device="cpu", dtype=torch.float32)
        more = {}
        if family == "sel_bwd_accumulate":  # the dense core's: dq of the other branches added in the kernel
            more = dict(dq_into=torch.empty_like(q), dq_more=(_empty(c.B, c.T - 32, Hq, c.Dk, dtype=dt), 31))
        sel.backward(do, q, k, v, o, lse, idx, ss, cfg.block_sel, scale, **more)
    elif family in ("window_fwd", "window_bwd"):
        from nsa.branches.sliding import triton as win

        ok, why = win.supported(q, k, v)
        if not ok:
            return why
        if family == "window_fwd":
            win.forward(q, k, v, cfg, scale)
        else:
            o = _empty(c.B, c.T, Hq, c.Dv, dtype=dt)
            lse = torch.empty(c.B, Hq, c.T, device="cpu", dtype=torch.float32)
            win.backward(_empty(c.B, c.T, Hq, c.Dv, dtype=dt), q, k, v, o, lse, cfg, scale)
    elif family in ("combine_fwd", "combine_bwd"):
        from nsa.branches.combine import triton as comb

        gates = _empty(c.B, c.T, Hq, 3, dtype=dt)
        o_cmp, o_sel, o_win = (_empty(c.B, c.T, Hq, c.Dv, dtype=dt) for _ in range(3))
        if family == "combine_fwd":
            comb.gate_combine(gates, o_cmp, o_sel, o_win)
        else:
            seg = comb.segments(o_cmp[:, 31:-1], 31, o_cmp[:, -1:])
            comb.backward(_empty(c.B, c.T, Hq, c.Dv, dtype=dt), gates, seg, o_sel, o_win)
    elif family in ("decode", "decode_paged"):
        from nsa.branches.decode import triton as dec
        from nsa.cache import NSACache
        from nsa.paged_cache import PagedNSACache

        if family == "decode":
            cache = NSACache(cfg, c.B, 8192, c.Hkv, c.Dk, c.Dv, device="cpu", dtype=dt)
        else:  # the kernels' PAGED variants: K/V read through a block table of 64-token pages
            cache = PagedNSACache(cfg, c.B, 128 * c.B, 64, 128, c.Hkv, c.Dk, c.Dv, device="cpu", dtype=dt)
        tokens = tuple(_empty(c.B, 1, c.Hkv, d, dtype=dt) for d in (c.Dk, c.Dv) * 3)
        dec.decode_step(_empty(c.B, 1, Hq, c.Dk, dtype=dt), _empty(c.B, 1, Hq, 3, dtype=dt), cache, tokens)
    elif family == "rope":  # the layers' rotary embedding, forward and (inverse) backward, on q and k
        from nsa.kernels.triton.rope import rope_apply

        pos, freqs = torch.zeros(1, c.T, dtype=torch.int64), torch.empty(c.Dk // 2, dtype=torch.float32)
        rope_apply(q, pos, freqs)
        rope_apply(k, pos, freqs, inverse=True)
    else:
        raise ValueError(f"unknown kernel family {family!r}; known: {', '.join(KERNELS)}")
    return None


# --- compiling a recorded launch --------------------------------------------------------------------------------


def compile_launch(launch: Launch, target, backend):
    """Triton's JIT path without a device: bind and specialize the arguments, then compile for `target`.
    Returns (compiled kernel, options, specialization key)."""
    import triton
    from triton.compiler import ASTSource
    from triton.runtime.jit import create_function_from_signature

    kernel = launch.kernel
    kwargs = dict(launch.kwargs, debug=False)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, spec, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, spec, options)
    key = (
        kernel.fn.__qualname__,
        repr(signature),
        repr(sorted(constexprs.items(), key=repr)),
        repr(attrs),
        repr(options),
    )
    return (
        (
            lambda: triton.compile(
                ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__
            )
        ),
        options,
        key,
    )


def ptxas_usage(log: str, name: str) -> tuple[int, int]:
    """(registers, spill store bytes) of entry `name` from a ptxas -v log."""
    part = log.split(f"Compiling entry function '{name}'")[-1]
    regs = re.search(r"Used (\d+) registers", part)
    spill = re.search(r"(\d+) bytes spill stores", part)
    return int(regs.group(1)) if regs else -1, int(spill.group(1)) if spill else 0


def _stages(launch: Launch, options) -> int:
    """The pipeline depth of the kernel's main loop: its own constexpr where it has one, else Triton's option."""
    for key in ("STAGES", "NUM_STAGES", "HEAD_STAGES"):
        if key in launch.kwargs:
            return launch.kwargs[key]
    return options.num_stages


def check_limits(
    arch: int, warps: int, regs: int, spill: int, smem: int, grid: tuple, dtype: torch.dtype
) -> tuple[list[str], list[str]]:
    """(why the target cannot run this compiled launch or runs it badly, notes): empty lists when it fits."""
    bad, notes = [], []
    if smem > SMEM_LIMIT[arch]:
        bad.append(f"shared memory {smem} > {SMEM_LIMIT[arch]}")
    regs_alloc = -(-max(regs, 0) // 8) * 8  # allocated per thread in steps of 8
    if regs_alloc * warps * 32 > REGS_PER_SM:
        bad.append(f"registers {regs} x {warps * 32} threads > {REGS_PER_SM}")
    if regs < 0:
        bad.append("no register count in the ptxas log")
    if spill > SPILL_LIMIT:
        (notes if dtype == torch.float32 else bad).append(f"spill stores {spill} B > {SPILL_LIMIT} B")
    for axis, (g, lim) in enumerate(zip(grid if isinstance(grid, tuple) else (), GRID_LIMIT)):
        if g > lim:
            bad.append(f"grid axis {axis} = {g} > {lim}")
    return bad, notes


def collect(arch: int, families, cases) -> tuple[list[Launch], list[str]]:
    """Every launch the launchers make for `cases`, and the families that do not apply (with why)."""
    launches: list[Launch] = []
    state: dict = {}
    skipped = []
    for c in cases:
        for fam in families:
            state.update(family=fam, case=c)
            with pretend_gpu(arch, launches, state):
                why = run_family(fam, c)
            if why:
                skipped.append(f"{fam:18} {c.label}: not on sm_{arch} ({why})")
    return launches, skipped


def _case(dt: str, G: int, dims: str) -> Case:
    if dt not in DTYPES:
        raise SystemExit(f"--dtypes: {dt!r} is not one of {', '.join(DTYPES)}")
    dk, _, dv = dims.partition("/")
    return Case(DTYPES[dt], G, int(dk), int(dv or dk))


def parse_cases(args) -> list[Case]:
    """The quick set, or every combination of --dtypes, --G, --D (the full sweep's where not given)."""
    if not (args.full or args.dtypes or args.G or args.D):
        return [_case(*c) for c in QUICK]
    dtypes, groups, dims = (getattr(args, key) or FULL[key] for key in ("dtypes", "G", "D"))
    return [_case(dt, int(G), d) for dt in dtypes.split(",") for G in groups.split(",") for d in dims.split(",")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90, choices=sorted(SMEM_LIMIT), help="compute capability x 10")
    ap.add_argument("--kernels", default=",".join(KERNELS), help=f"of {','.join(KERNELS)}")
    ap.add_argument("--dtypes", help=f"full sweep: {FULL['dtypes']}")
    ap.add_argument("--G", help=f"query heads per KV head; full sweep: {FULL['G']}")
    ap.add_argument("--D", help=f"head dims Dk[/Dv]; full sweep: {FULL['D']}")
    ap.add_argument("--full", action="store_true", help="every combination (default: the quick set)")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: the interpreter replaces the kernels this script compiles")
    families = [f for f in args.kernels.split(",") if f]
    unknown = sorted(set(families) - set(KERNELS))
    if unknown:
        raise SystemExit(f"--kernels: unknown {', '.join(unknown)}; known: {', '.join(KERNELS)}")

    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    arch = args.arch
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    launches, skipped = collect(arch, families, parse_cases(args))
    print(
        f"{'kernel':28} {'case':22} {'grid':>16} warps stages regs spill   smem  (sm_{arch}: smem <= "
        f"{SMEM_LIMIT[arch]} B, spill <= {SPILL_LIMIT} B)"
    )
    failures, n_notes, seen = 0, 0, set()
    for ln in launches:
        name = ln.kernel.fn.__name__
        row = (
            f"{ln.family + ':' + name.strip('_').replace('_kernel', ''):28} {ln.case.label:22} "
            f"{'x'.join(map(str, ln.grid)) if isinstance(ln.grid, tuple) else 'callable':>16}"
        )
        try:
            build, options, key = compile_launch(ln, target, backend)
            if key in seen:  # the same binary as a row above
                continue
            seen.add(key)
            log = io.StringIO()
            # Triton's own ptxas run (its flags) logs registers and spills: compiled afresh, not from the cache.
            with (
                mock.patch.object(knobs.compilation, "always_compile", True),
                mock.patch.object(knobs.nvidia, "dump_ptxas_log", True),
                contextlib.redirect_stdout(log),
            ):
                ck = build()
            regs, spill = ptxas_usage(log.getvalue(), ck.metadata.name)
            smem = ck.metadata.shared
            bad, notes = check_limits(arch, options.num_warps, regs, spill, smem, ln.grid, ln.case.dtype)
            failures += bool(bad)
            n_notes += bool(notes)
            print(
                f"{row} {options.num_warps:5} {_stages(ln, options):6} {regs:4} {spill:5} {smem:6}"
                f"{'  FAIL: ' + '; '.join(bad) if bad else ''}{'  NOTE: ' + '; '.join(notes) if notes else ''}",
                flush=True,
            )
        except Exception as e:  # noqa: BLE001 - report every failing kernel, then fail
            failures += 1
            print(f"{row}  FAIL: does not compile: {type(e).__name__}: {str(e)[:1500]}", flush=True)
    for line in skipped:
        print(f"skipped {line}")
    print(f"compile check (sm_{arch}): {len(seen)} compiles, {n_notes} note(s), {failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
