"""torch.compile support: what the library does differently while Dynamo traces it (docs/compile.md).

Host-side work (planning, toggles, telemetry, capability and TMA probes) is plain Python over values that are
fixed for a traced graph: shapes, dtypes, the device, the environment. Under torch.compile it runs once, when
the caller is traced, and its results are constants of the graph; Dynamo guards on the shapes and dtypes it
read, and the environment (NSA_* toggles, test hooks) is read at trace time: changing it later needs
torch.compiler.reset() to take effect. Every kernel the graph calls is a registered operator
(nsa.kernels.ops), so tracing never enters a Triton launcher.
"""

from __future__ import annotations

import torch


def compiling() -> bool:
    """Whether Dynamo is tracing the caller (torch.compile, torch.export); False in eager mode."""
    return torch.compiler.is_compiling()


def trace_constant(fn):
    """Mark a host helper whose result depends only on its arguments (constants at trace time) and on process
    state that is fixed for a compiled graph (the environment, the GPU, caches): under torch.compile it runs
    once, when the caller is traced, and its result is a constant of the graph (torch.compiler's
    assume_constant_result); in eager mode it is the plain function.

    The mark is the attribute torch.compiler.assume_constant_result sets, set here directly: calling it
    imports torch._dynamo (and with it triton) at import time of every module that uses this decorator,
    about a second of `import nsa`, and before tests that must load the Triton kernels for Triton's
    interpreter (tests/cpu/test_compile.py checks that both set the same mark)."""
    fn._dynamo_marked_constant = True
    return fn


@trace_constant
def inductor_compat() -> int:
    """Work around a torch 2.11 Inductor defect that fails the compile of NSA's graph on CUDA; run by planning
    while Dynamo traces (a trace-time constant), before Inductor generates code. Returns how many were applied.

    - In torch 2.11 one tiling check of Inductor's SIMD scheduler raises `CantSplit` without the two arguments
      its constructor requires: a TypeError ("CantSplit.__init__() missing 2 required positional arguments")
      escapes where the CantSplit the caller catches ("this tiling does not fit, try another") was meant,
      for any pointwise node that meets a three-dimensional tiling it does not divide. The arguments get
      defaults, so the check answers as intended; a torch whose constructor already works is left alone."""
    import inspect

    try:
        from torch._inductor.codegen.simd import CantSplit
    except ImportError:  # no Inductor in this build
        return 0
    required = [p for p in inspect.signature(CantSplit.__init__).parameters.values()
                if p.default is inspect.Parameter.empty and p.name != "self"]
    if not required:
        return 0
    original = CantSplit.__init__

    def __init__(self, expr=None, remaining=None):
        original(self, expr, remaining)

    CantSplit.__init__ = __init__
    return 1


__all__ = ["compiling", "inductor_compat", "trace_constant"]
