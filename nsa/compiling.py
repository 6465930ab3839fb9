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


__all__ = ["compiling", "trace_constant"]
