"""torch.autograd.gradcheck of nsa_attention on CUDA in float64, small shapes.

Dense and packed (cu_seqlens), with the selection's top-n step and with fixed block indices, with and
without chunking (chunked runs recompute each chunk in the backward: fast_mode checks a projection).
The forward is first checked against the fp64 oracle, so gradcheck checks the derivative of the right
function. NSA_GPU_TEST_DEVICE=cpu runs the same checks on CPU.
"""

from __future__ import annotations

import os

import pytest
import torch

from nsa import NSAConfig, nsa_attention, nsa_reference

DEVICE = os.environ.get("NSA_GPU_TEST_DEVICE", "cuda")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
CFG = NSAConfig(block_cmp=8, stride_cmp=4, block_sel=8, n_sel=4, n_init=1, n_local=2, window=16)
CFG2 = NSAConfig(block_cmp=16, stride_cmp=4, block_sel=8, n_sel=5, n_init=1, n_local=1, window=24)


def inputs(gen, T, Hq, Hkv, Dk, Dv):
    xs = [torch.randn(1, T, Hq, Dk, generator=gen, dtype=torch.float64),
          torch.randn(1, T, Hkv, Dk, generator=gen, dtype=torch.float64),
          torch.randn(1, T, Hkv, Dv, generator=gen, dtype=torch.float64),
          torch.rand(1, T, Hq, 3, generator=gen, dtype=torch.float64)]
    return [x.to(DEVICE).requires_grad_() for x in xs]


def fixed_indices(gen, T, Hkv, cfg):
    """Random distinct causal blocks per (t, h) (-1 padded), as the top-n step would give."""
    idx = torch.full((1, T, Hkv, cfg.n_sel), -1, dtype=torch.int32)
    for t in range(T):
        n_blocks = t // cfg.block_sel + 1
        for h in range(Hkv):
            pick = torch.randperm(n_blocks, generator=gen)[: cfg.n_sel]
            idx[0, t, h, : pick.numel()] = pick.sort().values.to(torch.int32)
    return idx.to(DEVICE)


# fast: gradcheck's fast_mode (a random projection of the Jacobian: few evaluations) for the larger shapes;
# the full Jacobian on the small ones (each column is one forward of many small kernels on a GPU).
@pytest.mark.parametrize("cfg,T,Hq,Hkv,cu,fixed,chunk,fast", [
    pytest.param(CFG, 24, 2, 1, None, False, None, False, id="dense-topn"),
    pytest.param(CFG, 40, 4, 2, None, True, None, True, id="dense-fixed"),
    pytest.param(CFG, 30, 2, 1, [0, 9, 10, 30], False, None, True, id="varlen-topn"),
    pytest.param(CFG, 45, 2, 1, [0, 20, 45], True, None, True, id="varlen-fixed"),
    pytest.param(CFG2, 50, 4, 1, None, False, 7, True, id="chunked"),
])
def test_gradcheck_cuda_fp64(gen, cfg, T, Hq, Hkv, cu, fixed, chunk, fast):
    q, k, v, g = inputs(gen, T, Hq, Hkv, 4, 3)
    cu_t = torch.tensor(cu, dtype=torch.int32, device=DEVICE) if cu is not None else None
    idx = fixed_indices(gen, T, Hkv, cfg) if fixed else None

    def f(q, k, v, g):
        return nsa_attention(q, k, v, g, cfg, backend="torch", cu_seqlens=cu_t, block_indices=idx, chunk_size=chunk)

    out = f(q, k, v, g)
    assert out.device.type == torch.device(DEVICE).type and out.dtype == torch.float64
    cpu_inputs = (x.detach().cpu() for x in (q, k, v, g))
    ref = nsa_reference(*cpu_inputs, cfg, cu_seqlens=cu_t.cpu() if cu_t is not None else None,
                        block_indices=idx.cpu() if idx is not None else None)
    assert float((out.detach().cpu() - ref.out).abs().max()) <= 1e-10 * float(ref.out.abs().max())
    assert torch.autograd.gradcheck(f, (q, k, v, g), eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=fast)
