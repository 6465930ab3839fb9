"""torch.compile(fullgraph=True) of NSA: no graph break, forward and backward, and the eager results.

The torch path (backend="torch": the chunked executor) compiles as it is; the fused pipeline runs on the CPU
as in tests/cpu/test_pipeline_interp.py (Triton's interpreter for NSA's kernels, the emulated FA-2 for the
compressed and sliding branches), its kernels traced as the custom operators of nsa.kernels.ops. fullgraph=True
makes any graph break an error; a counting backend checks that each case is one graph and compiles once;
telemetry shows what the compiled call planned (the custom-operator path, not a fallback). aot_eager runs
the traced graphs as they are, so outputs and gradients match eager mode to rounding; one small case goes
through Inductor.
"""

from __future__ import annotations

import collections

import pytest
import torch

from nsa import NSAAttention, NSAConfig, nsa_attention, telemetry
from nsa.compiling import trace_constant
from nsa.hooks import HOOKS
from nsa.kernels import ops
from nsa.model import LlamaBlockNSA, TinyNSALM

from . import backend_fakes
from .helpers import make_inputs, rel_err, slow
from .interp import kernel_modules

# torch._dynamo is imported inside the tests, never at collection: once it is imported, Triton kernels that
# load afterwards fail in Triton's interpreter ("Cannot call @triton.jit'd outside of the scope of a
# kernel"), and the *_interp test modules load theirs when collected. The kernels this file runs load now.
try:
    kernel_modules("combine", "topn", "selection", "window", probe="topn._topn_kernel")
    NO_INTERP = None
except pytest.skip.Exception as e:  # the torch-path tests run anyway; the custom-operator ones say why not
    NO_INTERP = str(e)

clean_env = backend_fakes.clean_env
CFG = NSAConfig(block_cmp=8, stride_cmp=4, block_sel=8, n_sel=4, n_init=1, n_local=1, window=8)
TOL = 1e-5  # fp32; aot_eager runs the same operations as eager mode


@pytest.fixture(autouse=True)
def fresh_dynamo():
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compiled(fn):
    """fn compiled whole (any graph break raises) by aot_eager, and the counter of the graphs it compiled."""
    from torch._dynamo.testing import CompileCounterWithBackend

    graphs = CompileCounterWithBackend("aot_eager")
    return torch.compile(fn, fullgraph=True, backend=graphs), graphs


def _explain(fn, *args):
    import torch._dynamo

    return torch._dynamo.explain(fn)(*args)


def _same(fn, compiled, args, tol=TOL):
    """Outputs and the gradients of every input that requires one agree between eager and compiled calls."""
    want, got = fn(*args), compiled(*args)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert rel_err(got, want) <= tol
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    go = torch.randn(want.shape, generator=torch.Generator().manual_seed(1))
    for name, a, b in zip(range(len(leaves)), torch.autograd.grad(got, leaves, go),
                          torch.autograd.grad(want, leaves, go)):
        assert rel_err(a, b) <= tol, name


def _inputs(gen, B, T, Hq=4, Hkv=2, D=16):
    return make_inputs(gen, B, T, Hq, Hkv, D, D, torch.float32, requires_grad=True)


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


# --- the torch path --------------------------------------------------------------------------------------------


@pytest.mark.sample
def test_torch_path_no_graph_break(gen):
    q, k, v, g = _inputs(gen, 2, 40)
    explained = _explain(lambda *a: nsa_attention(*a, CFG, backend="torch"), q, k, v, g)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_torch_path_matches_eager(gen, packed):
    cu = _cu([13, 0, 27]) if packed else None
    q, k, v, g = _inputs(gen, 1 if packed else 2, 40)

    def fn(q, k, v, g, cu):
        return nsa_attention(q, k, v, g, CFG, backend="torch", cu_seqlens=cu)

    compiled, graphs = _compiled(fn)
    _same(fn, compiled, (q, k, v, g, cu))
    assert graphs.frame_count == 1


def test_torch_path_dynamic_length(gen):
    """T symbolic: lengths that agree modulo the compression stride share one graph (the compression reads
    whole strides, so T mod stride_cmp is guarded); the packed offsets are a graph input, never specialized."""
    from torch._dynamo import mark_dynamic

    def fn(q, k, v, g, cu):
        return nsa_attention(q, k, v, g, CFG, backend="torch", cu_seqlens=cu)

    compiled, graphs = _compiled(fn)
    for T, cu in ((40, _cu([13, 27])), (56, _cu([20, 1, 35]))):
        args = (*_inputs(gen, 1, T), cu)
        for x in args[:4]:
            mark_dynamic(x, 1)  # fails the compile if the length gets specialized
        mark_dynamic(cu, 0)
        _same(fn, compiled, args)
    assert graphs.frame_count == 1


def test_bad_offsets_fail_inside_the_graph(gen):
    """Under compile cu_seqlens is checked on the device (no host copy): a bad one still fails the call."""
    q, k, v, g = _inputs(gen, 1, 40)
    bad = torch.tensor([0, 30, 20, 40], dtype=torch.int32)
    compiled, _ = _compiled(lambda *a: nsa_attention(*a, CFG, backend="torch", cu_seqlens=bad))
    with pytest.raises(RuntimeError, match="non-decreasing"):
        compiled(q, k, v, g)


def test_layers_match_eager(gen):
    """NSAAttention, LlamaBlockNSA (dense and packed) and TinyNSALM, each one graph, forward and backward."""
    torch.manual_seed(0)
    attn = NSAAttention(32, 4, 2, 16, 16, CFG, backend="torch")
    x = torch.randn(2, 40, 32, generator=gen, requires_grad=True)
    compiled, graphs = _compiled(attn)
    _same(attn, compiled, (x,))
    blk = LlamaBlockNSA(32, 4, 2, 16, 16, config=CFG, backend="torch")
    cu = _cu([11, 29])

    def block(x, cu):
        return blk(x, cu_seqlens=cu)

    compiled_blk, graphs_blk = _compiled(block)
    _same(block, compiled_blk, (x[:1].detach().requires_grad_(), cu))
    lm = TinyNSALM(50, 32, 1, 4, 2, 16, 16, CFG, backend="torch")
    tokens = torch.randint(0, 50, (1, 24), generator=gen)
    compiled_lm, graphs_lm = _compiled(lm)
    want, got = lm(tokens), compiled_lm(tokens)
    assert rel_err(got, want) <= TOL
    grads = [torch.autograd.grad(out.square().mean(), list(lm.parameters())) for out in (got, want)]
    assert max(rel_err(a, b) for a, b in zip(*grads)) <= TOL
    assert (graphs.frame_count, graphs_blk.frame_count, graphs_lm.frame_count) == (1, 1, 1)


def test_inductor_torch_path(gen):
    """One small case through Inductor (forward: its CPU code generation is the slow part)."""
    q, k, v, g = make_inputs(gen, 1, 24, 2, 1, 8, 8, torch.float32)

    def fn(q, k, v, g):
        return nsa_attention(q, k, v, g, CFG, backend="torch")

    got = torch.compile(fn, fullgraph=True, backend="inductor")(q, k, v, g)
    assert rel_err(got, fn(q, k, v, g)) <= 1e-5


# --- the fused pipeline: NSA's Triton kernels as custom operators (Triton's interpreter on the CPU) ------------


@pytest.fixture
def fused(clean_env):
    """Emulated FA-2 for cmp/win, the Triton kernels allowed on CPU: auto plans the fused executor."""
    if NO_INTERP:
        pytest.skip(NO_INTERP)
    return backend_fakes.allow_fused(clean_env)


def _served():
    return {s: telemetry.served(s) for s in ("cmp", "topn", "sel", "win", "combine", "core")}


def test_fused_pipeline_compiles_to_custom_ops(fused, gen):
    """The fused executor under compile, T dynamic: every kernel an nsa:: operator in the one graph, the dense
    core's steps as separate operators (its reason counted in telemetry, not a fallback) with the selection
    and the gate combine as one, outputs and gradients as in eager mode (which runs the dense core)."""
    from torch._dynamo import mark_dynamic
    from torch._dynamo.backends.debugging import aot_eager

    def fn(q, k, v, g):
        return nsa_attention(q, k, v, g, CFG)

    seen, graphs = [], []

    def backend(gm, example_inputs):
        graphs.append(gm)
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return aot_eager(gm, example_inputs)

    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    telemetry.reset()
    for T in (24, 28):
        args = _inputs(gen, 1, T, 2, 1, 16)
        for x in args:
            mark_dynamic(x, 1)
        _same(fn, compiled, args, tol=2e-5)
    assert len(graphs) == 1
    ops_seen = {t.removesuffix(".default") for t in seen}
    # the gate combine in the selection kernel's epilogue, as the dense core runs it: no separate combine pass
    assert {"nsa.sel_combine_fwd", "nsa.topn"} <= ops_seen and "nsa.combine_fwd" not in ops_seen
    counts = backend_fakes.counts()
    assert counts[("core", "separate", "compile")] == 1  # recorded when traced, once
    # the compressed branch on rows folded by view, as in the dense core: traced once, eager's two calls
    assert {e["event"]: e["calls"] for e in telemetry.snapshot()["events"] if e["branch"] == "cmp"} == {"fold_view": 3}
    assert _served() == {"cmp": {"flash_attn": 3}, "topn": {"triton": 3}, "sel": {"triton": 3},
                         "win": {"flash_attn": 3}, "combine": {"triton": 3}, "core": {"dense_core": 2, "separate": 1}}
    assert telemetry.snapshot()["fallbacks"] == 0


@pytest.mark.parametrize("B,T,Dk,Dv,traced", [(1, 27, 16, 16, "fold_view"), slow(1, 30, 48, 32, "fold_view"),
                                               slow(2, 30, 16, 16, "fold_view"), (1, 10, 16, 16, None)])
def test_compiled_compressed_branch_folds_by_view(fused, gen, B, T, Dk, Dv, traced):
    """Under compile the compressed branch of dense input runs on rows folded by view as the dense core does (no
    tail: T=27; a tail and V narrower than K; two batch rows), its output handed to the combining operator as
    two segments, with eager mode's outputs and gradients. T=10 has one row only (below MIN_VIEW_ROWS) and keeps
    the copying fold: the traced graph counts no fold event."""
    args = make_inputs(gen, B, T, 4, 2, Dk, Dv, torch.float32, requires_grad=True)

    def fn(q, k, v, g):
        return nsa_attention(q, k, v, g, CFG)

    compiled, graphs = _compiled(fn)
    fn(*args)
    telemetry.reset()
    _same(fn, compiled, args, tol=2e-5)
    folds = {e["event"]: e["calls"] for e in telemetry.snapshot()["events"] if e["branch"] == "cmp"}
    want = collections.Counter({"fold_view" if T >= 27 else "fold_copy": 1})  # eager: the dense core's
    if traced:
        want[traced] += 1
    assert folds == want, folds
    assert graphs.frame_count == 1 and telemetry.snapshot()["fallbacks"] == 0


def test_fused_explain_no_graph_break(fused, gen):
    q, k, v, g = make_inputs(gen, 1, 24, 2, 1, 16, 16, torch.float32)
    explained = _explain(lambda *a: nsa_attention(*a, CFG), q, k, v, g)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons


def test_selection_op_on_packed_input(fused, gen):
    """Packed input with the FA-2 branches off: the chunked executor with the selection kernel's operator."""
    fused.setenv("NSA_USE_FA2", "0")
    q, k, v, g = _inputs(gen, 1, 26, 2, 1, 16)
    cu = _cu([9, 17])

    def fn(q, k, v, g, cu):
        return nsa_attention(q, k, v, g, CFG, cu_seqlens=cu)

    compiled, graphs = _compiled(fn)
    telemetry.reset()
    _same(fn, compiled, (q, k, v, g, cu), tol=2e-5)
    assert telemetry.served("sel") == {"triton": 2} and graphs.frame_count == 1


def test_trace_constant_sets_dynamos_mark():
    """nsa.compiling.trace_constant sets the mark itself (no torch._dynamo import): the same as torch's."""
    import torch._dynamo

    assert torch._dynamo.assume_constant_result(lambda: 0)._dynamo_marked_constant is True
    assert trace_constant(lambda: 0)._dynamo_marked_constant is True


def _segments(gen, grad=True):
    """o_cmp of 20 tokens as two segments: rows for tokens [5, 17), a tail for [17, 20)."""
    return (torch.randn(1, 12, 2, 16, generator=gen, requires_grad=grad), 5,
            torch.randn(1, 3, 2, 16, generator=gen, requires_grad=grad))


@pytest.mark.sample
@pytest.mark.parametrize("name", ["sel_fwd", "sel_combine_fwd", "sel_combine_fwd:segments", "topn", "combine_fwd",
                                  "combine_bwd:segments", "window_fwd"])
def test_operator_contracts(fused, gen, name):
    """torch.library.opcheck: schema, fake (meta) shapes/dtypes/strides against the real kernel, autograd
    registration; the combining operators with o_cmp whole and as two token segments."""
    name, _, form = name.partition(":")
    q, k, v, _ = make_inputs(gen, 1, 20, 2, 1, 16, 16, torch.float32, requires_grad=True)
    if name == "window_fwd":  # the window kernels read K/V through TMA descriptors (the interpreter runs them)
        fused.setattr(HOOKS, "tma_force", True)
        q, k, v, _ = make_inputs(gen, 1, 20, 2, 1, 64, 64, torch.float32, requires_grad=True)
        args = (q, k, v, 8, 0.125)
    elif name in ("sel_fwd", "sel_combine_fwd"):
        idx = torch.randint(-1, 3, (1, 20, 1, 3), generator=gen, dtype=torch.int32)
        args = (q, k, v, ops._dedupe(idx), torch.zeros(1, 20, dtype=torch.int32), 8, 0.25)
        if name == "sel_combine_fwd":
            gates = torch.rand(1, 20, 2, 3, generator=gen, requires_grad=True)
            o_cmp = (torch.randn(1, 20, 2, 16, generator=gen, requires_grad=True), 0,
                     torch.zeros(1, 0, 2, 16, requires_grad=True))
            o_win = torch.randn(1, 20, 2, 16, generator=gen, requires_grad=True)
            args += (gates, *(_segments(gen) if form else o_cmp), o_win)
    elif name == "topn":
        kc = torch.randn(1, 4, 1, 16, generator=gen)
        lse = torch.randn(1, 20, 2, generator=gen)
        zeros = torch.zeros(1, 20, dtype=torch.long)
        args = (q.detach(), kc, lse, zeros, zeros, 8, 4, 8, 4, 1, 1, 0.25)
    elif name == "combine_bwd":
        dout, o_sel, o_win = (torch.randn(1, 20, 2, 16, generator=gen) for _ in range(3))
        args = (dout, torch.rand(1, 20, 2, 3, generator=gen), *_segments(gen, grad=False), o_sel, o_win)
    else:
        gates = torch.rand(1, 20, 2, 3, generator=gen, requires_grad=True)
        args = (gates, *(torch.randn(1, 20, 2, 16, generator=gen, requires_grad=True) for _ in range(3)))
    torch.library.opcheck(getattr(torch.ops.nsa, name).default, args,
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_planning_on_a_pretended_gpu_traces(gen, monkeypatch):
    """Planning as on a Hopper GPU (every FA-2-family provider and cuDNN probed) traces with no break: the
    availability probes run at trace time on constants (a provider's name), never on a provider object,
    which torch 2.11's Dynamo refuses as an argument of such a call."""
    monkeypatch.setattr(HOOKS, "pretend_gpu", (9, 0))
    args = _inputs(gen, 1, 40, 4, 1, 16)
    compiled = torch.compile(lambda *a: nsa_attention(*a, CFG), fullgraph=True, backend="eager")
    assert rel_err(compiled(*args), nsa_attention(*args, CFG)) <= 1e-6


def test_fa2_thresholds_file_read_at_trace_time(monkeypatch):
    """The FA-2 minimum lengths come from fa2_thresholds.json where no NSA_FA2_MIN_LEN_* is set (as on a GPU
    host): the file is read at trace time with constant arguments, not traced (os.stat is not traceable)."""
    from nsa import toggles
    from nsa.plan import rules

    for var in ("NSA_FA2_MIN_LEN_WIN", "NSA_FA2_MIN_LEN_CMP"):
        monkeypatch.delenv(var, raising=False)
    want = rules.min_len("win", 128, (9, 0), toggles.read())[0]
    fn = torch.compile(lambda x: x * rules.min_len("win", 128, (9, 0), toggles.read())[0], fullgraph=True,
                       backend="eager")
    assert fn(torch.ones(2)).tolist() == [want, want]


def test_inductor_compat_applied_while_tracing(gen):
    """Planning under torch.compile applies nsa.compiling.inductor_compat at trace time: afterwards Inductor's
    CantSplit can be raised the way torch 2.11's tiling check raises it (no arguments), so that check answers
    "does not fit" instead of failing the compile with a TypeError; a second call changes nothing."""
    from torch._inductor.codegen.simd import CantSplit

    from nsa.compiling import inductor_compat

    args = _inputs(gen, 1, 24, 2, 1, 8)
    compiled = torch.compile(lambda *a: nsa_attention(*a, CFG, backend="torch"), fullgraph=True, backend="eager")
    compiled(*args)
    with pytest.raises(CantSplit):
        raise CantSplit
    assert inductor_compat() == 0


def test_compiled_window_on_triton_kernels(fused, gen):
    """Where the dense core would run the sliding branch on NSA's Triton window kernels (TMA copies, pretended
    here; head dim 64), the compiled graph does too, as the separate step "triton_window" (the nsa::window_fwd
    operator and its registered backward), with eager mode's outputs and gradients."""
    fused.setattr(HOOKS, "tma_force", True)
    seen = []

    def backend(gm, example_inputs):
        from torch._dynamo.backends.debugging import aot_eager

        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return aot_eager(gm, example_inputs)

    def fn(q, k, v, g):
        return nsa_attention(q, k, v, g, CFG)

    args = _inputs(gen, 1, 24, 2, 1, 64)
    fn(*args)
    assert telemetry.served("win") == {"triton_window": 1}  # eager: inside the dense core
    telemetry.reset()
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    _same(fn, compiled, args, tol=2e-5)
    assert "nsa.window_fwd.default" in seen
    assert telemetry.served("win")["triton_window"] == 2 and telemetry.served("core")["separate"] == 1
