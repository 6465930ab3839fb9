"""FA-2 providers on packed (varlen) input with empty and short sequences, and dense input forced through
the varlen kernels (NSA_FA2_FORCE_VARLEN=1), vs the fp64 reference."""

from __future__ import annotations

import pytest
import torch
from fa2_gpu_helpers import SMALL, TOL, assert_fa2_served, branch_err, cu_tensor, inputs, one_hot_gates, oracle, run

from nsa import telemetry

pytestmark = pytest.mark.usefixtures("fa2_env")
LENGTHS = [[0, 1, 31, 32, 33, 0, 200, 47], [300], [5, 0, 0]]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lengths", LENGTHS)
@pytest.mark.parametrize("branch", ["cmp", "win"])
def test_varlen_branch_parity(provider, gen, dtype, lengths, branch):
    T, Hq, Hkv = sum(lengths), 8, 2
    q, k, v = inputs(gen, 1, T, Hq, Hkv, 128, 128, dtype)
    g = one_hot_gates(1, T, Hq, branch, dtype)
    cu = cu_tensor(lengths)
    want, idx = oracle(q, k, v, g, SMALL, cu=cu)
    got = run(q, k, v, g, SMALL, "auto", cu_seqlens=cu, block_indices=idx.cuda())
    assert branch_err(got, want) < TOL[dtype]
    if len({n for n in lengths if n}) == 1:  # sequences of one length: the dense batch they are (nsa_attention)
        assert ("packed", "as_batch") in {(e["backend"], e["event"]) for e in telemetry.snapshot()["events"]}
    elif provider == "torch_flash":
        assert_fa2_served(provider)


@pytest.mark.parametrize("branch", ["cmp", "win"])
def test_dense_forced_varlen(provider, gen, fa2_env, branch):
    fa2_env.setenv("NSA_FA2_FORCE_VARLEN", "1")
    q, k, v = inputs(gen, 3, 150, 4, 1, 64, 64, torch.bfloat16)
    g = one_hot_gates(3, 150, 4, branch, torch.bfloat16)
    want, idx = oracle(q, k, v, g, SMALL)
    got = run(q, k, v, g, SMALL, provider, block_indices=idx.cuda())
    assert branch_err(got, want) < TOL[torch.bfloat16]


def test_all_sequences_empty_or_short(provider, gen):
    lengths = [0, 3, 0, 10]  # no compressed block anywhere; windows tiny
    q, k, v = inputs(gen, 1, 13, 4, 2, 64, 64, torch.float16)
    g = torch.rand(1, 13, 4, 3, generator=gen).to("cuda", torch.float16)
    cu = cu_tensor(lengths)
    want, idx = oracle(q, k, v, g, SMALL, cu=cu)
    got = run(q, k, v, g, SMALL, provider, cu_seqlens=cu, block_indices=idx.cuda())
    assert branch_err(got, want) < TOL[torch.float16]
