"""k tokens appended to every row of a non-empty cache (nsa_prefill; speculative decoding's verify step) on
the GPU: backend "auto" runs them as k decode steps on the Triton decode kernels (telemetry asserted).

The paper config, B = 4 rows of ragged cached lengths, k = 4, both caches, fp32 and bf16:
- the kernel append equals k nsa_decode steps on the kernels bit for bit (the same launches on the same
  values) and the torch append (backend="torch"): fp32 to 1e-5; bf16 to 3e-2 where the kernels
  selected the blocks the torch prefill selects;
- it equals one prefill of the whole sequences (fp32: identical blocks, 1e-5; bf16: as above);
- a decode step after the append still equals the prefill.
"""

from __future__ import annotations

import pytest
import torch
from decode_cases import decode_all, decode_rows, expected, make_case, prefill_cache, prefill_paged_cache, rel_err

from nsa import NSAConfig, nsa_decode, nsa_prefill, telemetry

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available())")]
K = 4
NAMES = ("q", "k", "v", "g")


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv("NSA_USE_TRITON_DECODE", raising=False)
    telemetry.reset()


def _cache(case, paged):
    # pages of 64; the contiguous cache has the paged one's capacity (the same split plan)
    if paged:
        return prefill_paged_cache(case, 64, seed=1)
    return prefill_cache(case, max_len=-(-(max(case.lengths) + case.steps) // 64) * 64)


def _append(case, cache, backend):
    rows = torch.stack(decode_rows(case)[:K], dim=1)  # [B, K] packed rows of the whole sequences
    return nsa_prefill(*(case.full[n][0, rows] for n in NAMES), cache, backend=backend)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_append_equals_torch_append_and_prefill(gen, dtype, paged):
    cfg = NSAConfig()
    # the 4 appended tokens: 29.. completes the first compressed block (31); 1150.. starts a page and a
    # selection block (1152); 2047.. completes a compressed block and starts a page (2048)
    case = make_case(gen, cfg, [29, 500, 1150, 2047], K + 1, 16, 2, 64, 64, dtype=dtype, device="cuda")
    want, want_idx = expected(case)
    cache = _cache(case, paged)
    telemetry.reset()
    got = _append(case, cache, "auto")
    events = {e["event"] for e in telemetry.snapshot()["events"] if e["backend"] == "append"}
    assert events == {"decode_steps"} and telemetry.served("sel") == {"triton_decode": 1}, telemetry.snapshot()
    assert cache.cache_seqlens.tolist() == cache.host_seqlens() == [L + K for L in case.lengths]
    steps_out, steps_idx = decode_all(case, _cache(case, paged), "triton")
    assert torch.equal(got, steps_out[:, :K])  # the append is those decode steps
    torch_out = _append(case, _cache(case, paged), "torch")
    last = nsa_decode(*(case.full[n][0, decode_rows(case)[K]][:, None] for n in NAMES), cache, backend="auto")
    if dtype == torch.float32:
        assert torch.equal(steps_idx, want_idx)
        assert rel_err(got, want[:, :K]) <= 1e-5 and rel_err(got, torch_out) <= 1e-5
        assert rel_err(last, want[:, K:]) <= 1e-5
    else:
        same = (steps_idx == want_idx).all(dim=-1).all(dim=-1)  # [B, K + 1]: the prefill's blocks
        assert same.float().mean() >= 0.85
        s = same[:, :K]
        assert rel_err(got[s], want[:, :K][s]) <= 3e-2 and rel_err(got[s], torch_out[s]) <= 3e-2
        assert rel_err(last[same[:, K:]], want[:, K:][same[:, K:]]) <= 3e-2
