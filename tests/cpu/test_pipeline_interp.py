"""The fused pipeline and its new kernels on the CPU: Triton's interpreter (TRITON_INTERPRET=1) runs the top-n,
selection and combine kernels, an emulation of FlashAttention-2's contract (tests/cpu/fa2_emulation.py)
serves the compressed and sliding branches, so `nsa_attention(backend="auto")` takes the same fused
executor it takes on a GPU. Checked against the chunked torch path and the fp64 reference: outputs,
gradients, block indices, telemetry (the fused path ran, no fallback).

fp32 throughout: the interpreter's bf16 tl.dot is not faithful (the GPU suite covers bf16 and fp16).
"""

from __future__ import annotations

import pytest
import torch

from .interp import kernel_modules

combine, tma, topn = kernel_modules("combine", "tma", "topn", probe="topn._topn_kernel")

from nsa import NSAConfig, nsa_attention, nsa_reference, telemetry  # noqa: E402
from nsa.branches.combine.naive import combine_torch  # noqa: E402
from nsa.branches.compressed.naive import compressed_attention  # noqa: E402
from nsa.branches.selected.naive import top_n  # noqa: E402
from nsa.compress import compress_kv  # noqa: E402
from nsa.hooks import HOOKS  # noqa: E402
from nsa.layout import dense_layout, packed_layout  # noqa: E402

from . import backend_fakes  # noqa: E402
from .helpers import SMALL, make_inputs, rel_err, slow  # noqa: E402

clean_env = backend_fakes.clean_env
emulated = backend_fakes.emulated
CFG = SMALL["l8d4s8n4"]
CFGS = [CFG, SMALL["l8d4s16n4i0"], SMALL["l16d4s8n5i1l1"], SMALL["l8d8s8n3i0l0"],
        NSAConfig(block_cmp=16, stride_cmp=8, block_sel=16, n_sel=3, n_init=1, n_local=1, window=24)]


@pytest.fixture
def fused(clean_env):
    """Emulated FA-2 for cmp/win, the Triton kernels allowed on CPU: auto takes the fused executor."""
    return backend_fakes.allow_fused(clean_env)


def served():
    return {s: sorted(telemetry.served(s)) for s in ("cmp", "topn", "sel", "win", "combine")}


def assert_fused():
    assert served() == {"cmp": ["flash_attn"], "topn": ["triton"], "sel": ["triton"], "win": ["flash_attn"],
                        "combine": ["triton"]}, telemetry.snapshot()["counts"]
    assert telemetry.snapshot()["fallbacks"] == 0


def _packed(gen, lengths, Hq, Hkv, Dk, Dv, dtype=torch.float32, requires_grad=False):
    T = sum(lengths)
    q, k, v, g = make_inputs(gen, 1, T, Hq, Hkv, Dk, Dv, dtype, requires_grad)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    return q, k, v, g, cu


# --- the fused executor end to end ------------------------------------------------------------------------


def _auto_matches_torch_path(gen, q, k, v, g, cfg, cu=None):
    """backend="auto" (telemetry reset first, for the caller to check) against the torch path: the same
    indices, outputs and gradients of q, k, v and gates within 2e-5."""
    want, want_idx = nsa_attention(q, k, v, g, cfg, cu_seqlens=cu, backend="torch", return_indices=True)
    telemetry.reset()
    got, idx = nsa_attention(q, k, v, g, cfg, cu_seqlens=cu, return_indices=True)
    assert torch.equal(idx, want_idx)
    assert rel_err(got, want) <= 2e-5
    go = torch.randn(got.shape, generator=gen)
    grads = zip("qkvg", torch.autograd.grad(got, (q, k, v, g), go), torch.autograd.grad(want, (q, k, v, g), go))
    for name, a, b in grads:
        assert rel_err(a, b) <= 2e-5, name


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("cfg", [pytest.param(CFGS[0], id="l8d4s8"), slow(CFGS[1], id="l8d4s16"),
                                 slow(CFGS[2], id="l16d4s8")])
def test_fused_matches_torch_path(fused, gen, cfg, packed):
    if packed:
        q, k, v, g, cu = _packed(gen, [0, 1, 7, 8, 0, 33, 20], 4, 2, 16, 8, requires_grad=True)
    else:
        (q, k, v, g), cu = make_inputs(gen, 2, 29, 4, 2, 16, 8, torch.float32, True), None
    _auto_matches_torch_path(gen, q, k, v, g, cfg, cu)
    assert_fused()


@pytest.mark.sample
def test_fused_vs_reference_with_reference_blocks(fused, gen):
    q, k, v, g = make_inputs(gen, 1, 60, 4, 1, 8, 8, torch.float32)
    ref = nsa_reference(q, k, v, g, CFG)
    telemetry.reset()
    out, idx = nsa_attention(q, k, v, g, CFG, return_indices=True)
    assert_fused()
    assert torch.equal(idx, ref.indices)
    assert rel_err(out, ref.out) <= 2e-5


def test_fused_given_blocks_and_empty_input(fused, gen):
    q, k, v, g = make_inputs(gen, 1, 30, 2, 1, 8, 8, torch.float32)
    idx = torch.full((1, 30, 1, CFG.n_sel), -1, dtype=torch.int32)
    idx[..., 0] = 0
    telemetry.reset()
    out = nsa_attention(q, k, v, g, CFG, block_indices=idx)
    assert telemetry.served("topn") == {"given": 1} and telemetry.served("sel") == {"triton": 1}
    assert rel_err(out, nsa_attention(q, k, v, g, CFG, backend="torch", block_indices=idx)) <= 2e-5
    q0, k0, v0, g0 = make_inputs(gen, 1, 0, 2, 1, 8, 8, torch.float32)
    assert nsa_attention(q0, k0, v0, g0, CFG).shape == (1, 0, 2, 8)


# --- the top-n kernel against the naive top-n: every configuration rule, dense, batched, packed ------------


def _topn_case(gen, cfg, B, T, Hq, Hkv, D, cu=None, config=None):
    q = torch.randn(B, T, Hq, D, generator=gen)
    k = torch.randn(B, T, Hkv, D, generator=gen)
    layout = packed_layout(cu, T, cfg) if cu is not None else dense_layout(B, T, cfg, "cpu")
    kc, vc = compress_kv(k, k, layout, cfg)
    scale = D ** -0.5
    _, lse = compressed_attention(q, kc, vc, layout, cfg, scale)
    want = top_n(q, kc, lse, layout, cfg, scale)
    got = topn.topn_triton(q, kc, lse, layout.seq_start, layout.cmp_slot0, cfg, scale, config=config)
    return got, want


@pytest.mark.sample
@pytest.mark.parametrize("cfg", CFGS, ids=["l8d4s8n4", "l8d4s16i0", "l16d4s8n5", "l8d8s8n3", "l16d8s16n3"])
@pytest.mark.parametrize("T", [1, 7, 8, 9, 70])
def test_topn_kernel_matches_naive(gen, cfg, T):
    got, want = _topn_case(gen, cfg, 2, T, 4, 2, 16)
    assert got.dtype == torch.int32 and torch.equal(got, want)


# D = 48 and 40: two column tiles (32 + 16, the second full or masked), as the paper's 192 runs as 128 + 64
@pytest.mark.parametrize("G,D", [(1, 8), (3, 24), (16, 16), (2, 48), (1, 40)])
def test_topn_kernel_groups_and_head_dims(gen, G, D):
    got, want = _topn_case(gen, CFG, 1, 40, G * 2, 2, D)
    assert torch.equal(got, want)


def test_topn_kernel_packed_short_and_empty_sequences(gen):
    lengths = [0, 1, 2, 3, 9, 0, 31, 1, 40]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    got, want = _topn_case(gen, CFG, 1, sum(lengths), 4, 2, 16, cu)
    assert torch.equal(got, want)


def test_topn_kernel_tiles_spanning_sequences(gen, monkeypatch):
    """Tiles of 8 tokens over many short sequences: one pass per sequence inside a tile."""
    monkeypatch.setattr(topn, "tile_config", lambda D, dtype: {"BLOCK_T": 8, "CMP_PER_CHUNK": 16, "HEAD_STAGES": 1,
                                                                  "num_warps": 4})
    lengths = [3, 4, 1, 5, 12, 2, 2, 19]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    got, want = _topn_case(gen, CFG, 1, sum(lengths), 2, 1, 8, cu)
    assert torch.equal(got, want)


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_topn_kernel_full_chunks_skip_the_mask(gen, monkeypatch, packed):
    """Chunks wholly below every row's last block run without the causal mask: a long sequence in small
    chunks has both kinds, and tokens of other sequences in a tile must still see nothing."""
    monkeypatch.setattr(topn, "tile_config", lambda D, dtype: {"BLOCK_T": 4, "CMP_PER_CHUNK": 8, "HEAD_STAGES": 1,
                                                                  "num_warps": 4})
    cfg = NSAConfig(block_cmp=16, stride_cmp=8, block_sel=32, n_sel=4, n_init=1, n_local=1, window=8)
    cu = torch.tensor([0, 7, 150, 151, 300], dtype=torch.int32) if packed else None
    got, want = _topn_case(gen, cfg, 1, 300, 4, 1, 16, cu)
    assert torch.equal(got, want)


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("block_sel,per_chunk,T", [slow(16, 32, 620, id="R2"),
                                                   pytest.param(24, 64, 900, id="R3-padded")])
def test_topn_kernel_tail_shift_matches_tail_dot(gen, monkeypatch, packed, block_sel, per_chunk, T):
    """Both forms of the tail sums (moved from the group tile, or a dot of their own) give the naive top-n,
    over several chunks (the shift carries the last column of one chunk into the next) and passes; R = 3
    pads each group to 4 columns."""
    cfg = NSAConfig(block_cmp=16, stride_cmp=8, block_sel=block_sel, n_sel=3, n_init=1, n_local=1, window=8)
    assert topn.shifts_tail(cfg)  # C = 1 <= R
    assert topn.chunk_shape(cfg, per_chunk)[0] == 16  # 16 selection blocks per chunk: 3 chunks at T
    cu = torch.tensor([0, 5, T // 2, T // 2 + 1, T], dtype=torch.int32) if packed else None
    for shift in (True, False):
        monkeypatch.setattr(topn, "tile_config", lambda D, dtype, s=shift: {
            "BLOCK_T": 16, "CMP_PER_CHUNK": per_chunk, "HEAD_STAGES": 1, "num_warps": 4, "SHIFT_TAIL": s})
        got, want = _topn_case(gen, cfg, 1, T, 2, 1, 16, cu)
        assert torch.equal(got, want), shift


# Keys past a token's last block are read and their probabilities zeroed by the mask: they may overflow first.
@pytest.mark.filterwarnings("ignore:overflow encountered in exp2:RuntimeWarning")
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("cfg,copy_kc", [(CFG, True), (NSAConfig(block_cmp=16, stride_cmp=8, block_sel=24, n_sel=3,
                                                                 n_init=1, n_local=1, window=8), False)],
                         ids=["q-and-keys", "q-only-R3"])
def test_topn_kernel_tma_copies_match_naive(gen, monkeypatch, packed, cfg, copy_kc):
    """The q tiles and the chunk's compressed keys by tensor-memory copies (the Hopper form): a copied key
    chunk runs past the sequence's last block into the next sequence's (or past the end), which the causal
    mask must zero. With R = 3 padded to 4 the keys keep their pointer loads."""
    monkeypatch.setattr(HOOKS, "tma_force", True)
    tma.USED.clear()
    T = 300
    cu = torch.tensor([0, 7, 150, 151, T], dtype=torch.int32) if packed else None
    conf = {"BLOCK_T": 16, "CMP_PER_CHUNK": 16, "HEAD_STAGES": 2, "num_warps": 4, "TMA_Q": True,
            "TMA_KC": copy_kc}
    got, want = _topn_case(gen, cfg, 1, T, 4, 2, 16, cu, config=conf)
    assert torch.equal(got, want)
    assert tma.USED["topn"] == 1 + copy_kc


@pytest.mark.filterwarnings("ignore:overflow encountered in exp2:RuntimeWarning")
def test_topn_kernel_tma_copies_of_two_column_tiles(gen, monkeypatch):
    """D = 48 as 32 + 16 columns, each tile of q and of the keys by its own tensor-memory copy."""
    monkeypatch.setattr(HOOKS, "tma_force", True)
    tma.USED.clear()
    conf = {"BLOCK_T": 16, "CMP_PER_CHUNK": 16, "HEAD_STAGES": 2, "num_warps": 4, "TMA_Q": True, "TMA_KC": True}
    got, want = _topn_case(gen, CFG, 1, 200, 4, 2, 48, config=conf)
    assert torch.equal(got, want)
    assert tma.USED["topn"] == 2 and tma.USED["topn_tail"] == 2


def test_topn_shift_parts_are_exact(gen):
    """The tails' shift on GPUs runs as three bf16 dots, one per part of _bf16_parts: the parts add back to
    every fp32 sum >= 2**-110 bit for bit (full 24-bit mantissas, values just below powers of two, zeros).
    Dropping the third part fails it. (The dots themselves only move values: exact on the GPU, where the
    GPU suite's top-n tests run them; the interpreter's bf16 dots are not faithful.)"""
    import triton
    import triton.language as tl

    @triton.jit
    def parts_kernel(X, P1, P2, P3, N: tl.constexpr):
        r = tl.arange(0, N)
        x = tl.load(X + r)
        x1, x2, x3 = topn._bf16_parts(x)
        tl.store(P1 + r, x1)
        tl.store(P2 + r, x2)
        tl.store(P3 + r, x3)

    n = 64
    x = torch.rand(n, generator=gen) * 16
    x[:16] = torch.exp(torch.empty(16).uniform_(-76, 3, generator=gen))  # down to 2**-110
    x[16:32] = torch.nextafter(2.0 ** torch.arange(-8, 8).float(), torch.tensor(0.0))
    x[32] = 0.0
    parts = [torch.empty(n, dtype=torch.bfloat16) for _ in range(3)]
    parts_kernel[(1,)](x, *parts, N=n)
    p1, p2, p3 = (t.float() for t in parts)
    assert torch.equal(p1 + (p2 + p3), x)
    assert not torch.equal(p1 + p2, x)


def test_topn_kernel_rejects_unsupported_config():
    cfg = NSAConfig(block_cmp=8, stride_cmp=4, block_sel=8, n_sel=65, n_init=1, n_local=1)
    assert "n_sel=65" in topn.unsupported(cfg)
    assert topn.unsupported(NSAConfig(block_cmp=256, stride_cmp=4, block_sel=8, n_sel=4)) is None
    long_cmp = NSAConfig(block_cmp=260, stride_cmp=4, block_sel=8, n_sel=4)
    assert "65 strides" in topn.unsupported(long_cmp)


# --- exact ties: every path picks the lower block, whatever its chunking or reduction order ---------------

def _tie_inputs(gen, T=96, Hq=2, D=4):
    """Keys repeating every 2 selection blocks and a run of q = 0, all small multiples of 1/4 so that every
    product and sum is exact in any order (the interpreter's numpy matmul is not position-independent)."""
    cfg = NSAConfig(block_cmp=8, stride_cmp=8, block_sel=8, n_sel=2, n_init=1, n_local=0, window=4)
    q = torch.randint(-4, 5, (1, T, Hq, D), generator=gen).double() / 4
    k = torch.randint(-4, 5, (1, T, 1, D), generator=gen).double() / 4
    k[:, 16:] = k[:, :16].repeat(1, T // 16 - 1, 1, 1)
    q[:, 60:70] = 0
    v = torch.randn(1, T, 1, 3, generator=gen, dtype=torch.float64)
    g = torch.rand(1, T, Hq, 3, generator=gen, dtype=torch.float64)
    return cfg, q, k, v, g


def test_ties_reference_torch_chunks_and_kernel_agree(gen):
    cfg, q, k, v, g = _tie_inputs(gen)
    ref = nsa_reference(q, k, v, g, cfg)
    # Rule check on a row with a known tie: t=43 sees blocks 0..5; 2 and 4 repeat 0's keys, 1, 3, 5 repeat.
    assert ref.indices[0, 43, 0, 0] == 0
    for chunk in (None, 1, 5, 96):
        _, idx = nsa_attention(q, k, v, g, cfg, backend="torch", chunk_size=chunk, return_indices=True)
        assert torch.equal(idx, ref.indices), chunk
    layout = dense_layout(1, 96, cfg, "cpu")
    kc, vc = compress_kv(k, k, layout, cfg)
    _, lse = compressed_attention(q, kc, vc, layout, cfg, 0.5)
    got = topn.topn_triton(q.float(), kc.float(), lse.float(), layout.seq_start, layout.cmp_slot0, cfg, 0.5)
    assert torch.equal(got, ref.indices)


def test_issue_reproducer_ties_in_fp64(gen):
    """Equal blocks at 8 and 16/32: prefill (any chunking), the reference and decode pick [0, 1] at t=43."""
    cfg = NSAConfig(block_cmp=8, stride_cmp=8, block_sel=8, n_sel=2, n_init=1, n_local=0, window=4)
    g5 = torch.Generator().manual_seed(5)
    q = torch.randn(1, 48, 2, 4, generator=g5, dtype=torch.float64)
    k = torch.randn(1, 48, 1, 4, generator=g5, dtype=torch.float64)
    v = torch.randn(1, 48, 1, 3, generator=g5, dtype=torch.float64)
    gates = torch.rand(1, 48, 2, 3, generator=g5, dtype=torch.float64)
    k[:, 16:24] = k[:, 8:16]
    k[:, 32:40] = k[:, 8:16]
    ref = nsa_reference(q, k, v, gates, cfg)
    assert ref.indices[0, 43, 0].tolist() == [0, 1]
    for chunk in (None, 1):
        out, idx = nsa_attention(q, k, v, gates, cfg, backend="torch", chunk_size=chunk, return_indices=True)
        assert idx[0, 43, 0].tolist() == [0, 1] and rel_err(out, ref.out) <= 1e-10


# --- the gate combine kernel ---------------------------------------------------------------------------------


def test_combine_kernel_forward_backward(gen):
    shape = (2, 5, 3, 12)
    o = [torch.randn(*shape, generator=gen).requires_grad_() for _ in range(3)]
    g = torch.rand(*shape[:3], 3, generator=gen).requires_grad_()
    got = combine.gate_combine(g, *o)
    want = combine_torch(g, *o)
    assert rel_err(got, want) <= 1e-6
    go = torch.randn(shape, generator=gen)
    for a, b in zip(torch.autograd.grad(got, [g, *o], go), torch.autograd.grad(want, [g, *o], go)):
        assert rel_err(a, b) <= 1e-6
    with pytest.raises(ValueError, match="do not match"):
        combine.gate_combine(g, o[0], o[1][:, :4], o[2])


def test_combine_kernel_segments_take_one_dtype(gen):
    """o_cmp in two segments, a short fp32 tail beside fp16 rows (as the dense core makes them): the kernels
    see one element type, match the torch combine, and the tail's gradient comes back in the rows' dtype."""
    B, T, H, D = 1, 9, 2, 16
    full = torch.randn(B, T, H, D, generator=gen)
    full[:, 0] = 0  # token 0 is before the main segment: no block
    seg = combine.Segments(full[:, 1:7].half(), 1, full[:, 7:].float())
    assert seg.tail.dtype == torch.float16 and (seg.lo, seg.hi) == (1, 7)
    s, w, dout = (torch.randn(B, T, H, D, generator=gen).half() for _ in range(3))
    g = torch.rand(B, T, H, 3, generator=gen).half()
    out = combine.combine_forward(g, seg, s, w)
    assert rel_err(out.float(), combine_torch(g.float(), full.half().float(), s.float(), w.float())) <= 2e-3
    dg, da, ds, dw = combine.combine_backward(dout, g, seg, s, w)
    d_cmp = (g[..., 0:1].float() * dout.float()).half()
    assert da.main.dtype == da.tail.dtype == torch.float16
    assert torch.equal(da.main, d_cmp[:, 1:7]) and torch.equal(da.tail, d_cmp[:, 7:])
    assert rel_err(dg[..., 0].float(), (dout.float() * full.half().float()).sum(-1)) <= 2e-3


def test_selection_kernel_combines_in_its_epilogue(gen):
    """sel_forward(combine=...) gives the combine kernel's output bitwise (o_cmp in two segments with
    tokens before, between and after them, strided gates, G = 3 over a 16-row tile), and the same o and
    LSE as the plain forward."""
    from nsa.kernels.triton.selection import sel_forward

    B, T, Hkv, G, D, n, ls = 2, 21, 2, 3, 16, 3, 4
    H = Hkv * G
    q = torch.randn(B, T, H, D, generator=gen)
    k, v = (torch.randn(B, T, Hkv, D, generator=gen) for _ in range(2))
    idx = torch.randint(-1, T // ls, (B, T, Hkv, n), generator=gen, dtype=torch.int32)
    ss = torch.zeros(B, T, dtype=torch.int32)
    seg = combine.Segments(torch.randn(B, 12, H, D, generator=gen), 3, torch.randn(B, 4, H, D, generator=gen))
    gates = torch.rand(B, T, H, 5, generator=gen)[..., 1:4]
    o_win = torch.randn(B, T, H, D, generator=gen)
    o, lse = sel_forward(q, k, v, idx, ss, ls, 0.25)
    out, o2, lse2 = sel_forward(q, k, v, idx, ss, ls, 0.25, combine=(gates, seg, o_win))
    assert torch.equal(out, combine.combine_forward(gates, seg, o, o_win))
    assert torch.equal(o2, o) and torch.equal(lse2, lse)


def test_dense_core_output_without_autograd(fused, gen):
    """Under torch.no_grad the dense core gives the output it gives with autograd on."""
    q, k, v, g = make_inputs(gen, 1, 29, 4, 2, 16, 16, torch.float32, True)
    with_grad = nsa_attention(q, k, v, g, CFG)
    with torch.no_grad():
        without = nsa_attention(q, k, v, g, CFG)
    assert torch.equal(with_grad.detach(), without)


# --- the dense core: the fused pipeline as one autograd node (compressed branch folded by view) ------------


def _core_events():
    return sum(e["calls"] for e in telemetry.snapshot()["events"] if e["event"] == "dense_core")


# Small T with the remainders that matter to the core: tail tokens after the folded rows ((T - l + 1) % d,
# none at T = 27 for l8d4) and a partial last selection block; one case with two batch rows.
CORE_CASES = [pytest.param("flash_attn", CFGS[0], 2, 29, id="l8d4-B2"),
              slow("flash_attn", CFGS[0], 1, 27, id="l8d4-notail"),
              slow("flash_attn", CFGS[2], 1, 45, id="l16d4"),
              pytest.param("flash_attn", CFGS[3], 1, 24, id="l8d8"),
              slow("flash_attn", CFGS[4], 1, 38, id="l16d8"),
              pytest.param("torch_cudnn", CFGS[0], 1, 29, id="cudnn-l8d4"),
              slow("torch_cudnn", CFGS[2], 1, 44, id="cudnn-l16d4")]


@pytest.mark.parametrize("provider,cfg,B,T", CORE_CASES)
def test_dense_core_matches_torch_path(fused, gen, provider, cfg, B, T):
    """Outputs, indices and every gradient equal the torch path's, and the core ran (its event)."""
    if provider == "torch_cudnn":
        fused.setattr(HOOKS, "cudnn", backend_fakes.emulated_cudnn())
    q, k, v, g = make_inputs(gen, B, T, 4, 2, 16, 16, torch.float32, True)
    _auto_matches_torch_path(gen, q, k, v, g, cfg)
    assert telemetry.served("cmp") == {provider: 1} and telemetry.snapshot()["fallbacks"] == 0
    assert _core_events() == 1


@pytest.mark.parametrize("wide", [False, True], ids=["cudnn-9.1", "cudnn-9.19"])
def test_dense_core_cudnn_takes_v_narrower_than_k(fused, gen, wide):
    """Dk = 1.5 Dv on cuDNN: the folded rows' V is zero-padded to Dk for a cuDNN before the release with the
    wide heads, and passed as it is from that release on; either way the torch path's results."""
    from nsa.kernels.fa2.torch_cudnn import WIDE_HEADS_CUDNN

    prov = backend_fakes.emulated_cudnn()
    if wide:
        prov.cudnn_version = WIDE_HEADS_CUDNN
    seen = []
    kernel = prov.kernel
    prov.kernel = lambda q, k, v, *a, **kw: seen.append(v.shape[-1]) or kernel(q, k, v, *a, **kw)
    fused.setattr(HOOKS, "cudnn", prov)
    q, k, v, g = make_inputs(gen, 1, 29, 4, 2, 24, 16, torch.float32, True)
    _auto_matches_torch_path(gen, q, k, v, g, CFG)
    assert telemetry.served("cmp") == {"torch_cudnn": 1} and _core_events() == 1
    assert seen and set(seen) == {16 if wide else 24}


def test_dense_core_launches_the_window_first(fused, gen):
    """The sliding branch is started before the compression (the GPU's first large kernel), and the core
    uses that result: the same output as the torch path."""
    import nsa.run.fused as fused_run

    order = []
    start, compress = fused_run.dense_core.start_window, fused_run.compress_kv
    fused.setattr(fused_run.dense_core, "start_window", lambda *a: order.append("window") or start(*a))
    fused.setattr(fused_run, "compress_kv", lambda *a: order.append("compress") or compress(*a))
    q, k, v, g = make_inputs(gen, 1, 29, 4, 2, 16, 16, torch.float32)
    telemetry.reset()
    got = nsa_attention(q, k, v, g, CFG)
    assert order == ["window", "compress"] and _core_events() == 1
    assert rel_err(got, nsa_attention(q, k, v, g, CFG, backend="torch")) <= 2e-5


def test_dense_core_retained_graph_and_toggle(fused, gen):
    """A second backward through a kept graph gives the same gradients; NSA_DENSE_CORE=0 runs the separate
    operations (no event) with the same result."""
    q, k, v, g = make_inputs(gen, 1, 29, 4, 2, 16, 16, torch.float32, True)
    go = torch.randn(1, 29, 4, 16, generator=gen)
    telemetry.reset()
    got = nsa_attention(q, k, v, g, CFG)
    first = torch.autograd.grad(got, (q, k, v, g), go, retain_graph=True)
    for a, b in zip(first, torch.autograd.grad(got, (q, k, v, g), go)):
        assert torch.equal(a, b)
    assert _core_events() == 1
    fused.setenv("NSA_DENSE_CORE", "0")
    telemetry.reset()
    off = nsa_attention(q, k, v, g, CFG)
    assert _core_events() == 0 and rel_err(off, got) <= 2e-5
    assert backend_fakes.counts()[("core", "separate", "disabled")] == 1
    for name, a, b in zip("qkvg", torch.autograd.grad(off, (q, k, v, g), go), first):
        assert rel_err(a, b) <= 2e-5, name


def test_dense_core_given_blocks_and_separate_window_kv(fused, gen):
    q, k, v, g = make_inputs(gen, 1, 34, 4, 2, 16, 16, torch.float32, True)
    kw, vw = (torch.randn(1, 34, 2, 16, generator=gen, requires_grad=True) for _ in range(2))
    idx = torch.randint(-1, 5, (1, 34, 2, CFG.n_sel), generator=gen, dtype=torch.int32)
    want = nsa_attention(q, k, v, g, CFG, backend="torch", block_indices=idx, kv_win=(kw, vw))
    telemetry.reset()
    got = nsa_attention(q, k, v, g, CFG, block_indices=idx, kv_win=(kw, vw))
    assert _core_events() == 1
    assert rel_err(got, want) <= 2e-5
    go = torch.randn(want.shape, generator=gen)
    ins = (q, k, v, g, kw, vw)
    for name, a, b in zip(["q", "k", "v", "g", "kw", "vw"], torch.autograd.grad(got, ins, go),
                          torch.autograd.grad(want, ins, go)):
        assert rel_err(a, b) <= 2e-5, name


def _fold_events():
    """{"fold_view" | "fold_copy": calls}: which form the core's compressed branch took."""
    return {e["event"]: e["calls"] for e in telemetry.snapshot()["events"] if e["branch"] == "cmp"
            and e["event"].startswith("fold_")}


@pytest.mark.parametrize("why,fold", [("short", "fold_copy"), ("packed", "fold_copy"), ("v_narrower", "fold_view"),
                                      slow("v_wider", "fold_copy"),
                                      slow("transposed_q", "fold_copy")])
def test_dense_core_serves_every_fused_call(fused, gen, why, fold):
    """Where q cannot be viewed as rows (one row only, packed input, Dk < Dv, a transposed q) the core runs
    the provider's own compressed call; Dk > Dv folds by view with V padded. Same result as the torch path."""
    T = 12 if why == "short" else 40  # l8d4: rows start at token 7, two rows need T >= 15
    Dk, Dv = {"v_narrower": (16, 8), "v_wider": (8, 16)}.get(why, (16, 16))
    q, k, v, g = make_inputs(gen, 2 if why == "v_wider" else 1, T, 4, 2, Dk, Dv, torch.float32, True)
    cu = torch.tensor([0, 17, 40], dtype=torch.int32) if why == "packed" else None
    if why == "transposed_q":
        q = q.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
    _auto_matches_torch_path(gen, q, k, v, g, CFG, cu)
    assert_fused()
    assert _core_events() == 1 and _fold_events() == {fold: 1}
    assert backend_fakes.counts()[("core", "dense_core", "ok")] == 1


def _core_against_fp64(gen, cfg, lengths, Hq, Hkv, Dk, Dv, dtype, tol, fold, B=1):
    """The core (its event, the fold form `fold`, no fallback) against float64 on the same rounded inputs:
    outputs against nsa_reference with the core's blocks, gradients of q, k, v, gates against the fp64 torch
    path with those blocks, the blocks against the reference's own (fp32: equal). `lengths`: packed sequence
    lengths, or an int T (dense)."""
    packed = not isinstance(lengths, int)
    T = sum(lengths) if packed else lengths
    x = make_inputs(gen, B, T, Hq, Hkv, Dk, Dv, dtype, True)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32) if packed else None
    telemetry.reset()
    out, idx = nsa_attention(*x, cfg, cu_seqlens=cu, return_indices=True)
    assert_fused()
    assert _core_events() == 1 and _fold_events() == {fold: 1}
    hi = [t.detach().double().requires_grad_() for t in x]
    ref = nsa_reference(*hi, cfg, cu_seqlens=cu)
    if dtype == torch.float32:
        assert torch.equal(idx, ref.indices)
    else:  # rounding may flip near-ties: most blocks agree
        assert (idx == ref.indices).float().mean() > 0.9
    assert rel_err(out, nsa_reference(*hi, cfg, cu_seqlens=cu, block_indices=idx).out) <= tol
    want = nsa_attention(*hi, cfg, cu_seqlens=cu, block_indices=idx, backend="torch")
    go = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    for name, a, b in zip("qkvg", torch.autograd.grad(out, x, go.to(dtype)), torch.autograd.grad(want, hi, go)):
        assert rel_err(a, b) <= tol, name


# Packed: empty and length-1 sequences, lengths that are not multiples of d, sequences shorter than l, and
# one long enough for selection blocks of its own beyond the first.
PACKED_LENGTHS = [0, 1, 13, 0, 30, 6]


@pytest.mark.parametrize("Dk,Dv", [slow(16, 16, id="D16"), pytest.param(24, 16, id="Dk24-Dv16")])
def test_dense_core_packed_against_fp64(fused, gen, Dk, Dv):
    _core_against_fp64(gen, CFG, PACKED_LENGTHS, 4, 2, Dk, Dv, torch.float32, 2e-5, "fold_copy")


def test_dense_core_packed_without_blocks(fused, gen):
    """Every sequence shorter than l: no compressed block anywhere (the compressed branch is a constant 0)."""
    _core_against_fp64(gen, CFG, [0, 3, 7, 1], 2, 1, 8, 8, torch.float32, 2e-5, "fold_copy")


@pytest.mark.parametrize("T", [pytest.param(29, id="tail"), slow(31, id="no-tail")])
def test_dense_core_dk_wider_than_dv_against_fp64(fused, gen, T):
    """Dk = 1.5 Dv (the paper's 192 / 128): rows by view with V zero-padded to Dk, the tail likewise; Dk = 48
    runs the selection kernels on two column tiles (32 + 16), as 192 runs on 128 + 64."""
    _core_against_fp64(gen, CFG, T, 4, 2, 48, 32, torch.float32, 2e-5, "fold_view", B=2)


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_dense_core_fp16_against_fp64(fused, gen, packed):
    _core_against_fp64(gen, CFG, PACKED_LENGTHS if packed else 29, 4, 2, 16, 16, torch.float16, 2e-2,
                       "fold_copy" if packed else "fold_view")


@pytest.mark.parametrize("lengths", [slow([29], id="one"),
                                     pytest.param([0, 17, 0, 17, 17], id="three-among-empty")])
def test_packed_sequences_of_one_length_are_the_dense_batch(fused, gen, lengths):
    """cu_seqlens whose non-empty sequences share one length L runs exactly the dense call on [n, L]: the
    same bits, outputs, indices and gradients, the same plan (the compressed branch folded by view)."""
    T, n = sum(lengths), sum(1 for x in lengths if x)
    x = make_inputs(gen, 1, T, 4, 2, 16, 16, torch.float32, True)
    go = torch.randn(1, T, 4, 16, generator=gen)
    dense, dense_idx = nsa_attention(*(t.view(n, T // n, *t.shape[2:]) for t in x), CFG, return_indices=True)
    want = torch.autograd.grad(dense, x, go.view(dense.shape))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    telemetry.reset()
    got, idx = nsa_attention(*x, CFG, cu_seqlens=cu, return_indices=True)
    assert _fold_events() == {"fold_view": 1} and _core_events() == 1
    assert {(e["backend"], e["event"]) for e in telemetry.snapshot()["events"]} >= {("packed", "as_batch")}
    assert torch.equal(got, dense.view(got.shape)) and torch.equal(idx, dense_idx.view(idx.shape))
    for name, a, b in zip("qkvg", torch.autograd.grad(got, x, go), want):
        assert torch.equal(a, b), name
    assert rel_err(got, nsa_reference(*x, CFG, cu_seqlens=cu).out) <= 2e-5
