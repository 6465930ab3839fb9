"""GPU tests: marked `gpu`, run with `-m gpu` or NSA_TEST_FA2=1 on a machine with a CUDA GPU, skipped with
the reason otherwise. Fixtures give the FA-2 providers available here and a clean toggle environment."""

from __future__ import annotations

import os

import pytest
import torch
from _sharing import mark_big_tests, pytest_pyfunc_call, pytest_runtest_logreport, pytest_terminal_summary  # noqa: F401
from triton_sel_helpers import SEL_ENV  # tests/gpu is on sys.path (rootdir conftest)

from nsa import telemetry

HERE = os.path.dirname(__file__)
ENV = ("NSA_USE_FA2", "NSA_USE_FA2_WIN", "NSA_USE_FA2_CMP", "NSA_FA2_MIN_LEN_WIN", "NSA_FA2_MIN_LEN_CMP",
       "NSA_FA2_FORCE", "NSA_FA2_FORCE_VARLEN", "NSA_FA2_FORCE_DENSE", "NSA_FA2_PREF_FP16", "NSA_DEBUG_TIMING",
       "NSA_SDPA_CHUNK")


MINE = ("test_fa2_parity.py", "test_fa2_gpu_varlen.py", "test_backward_varlen.py", "test_fa2_edge_shapes.py")


def pytest_collection_modifyitems(config, items):
    """The FA-2 files: marked gpu; skipped with the reason without CUDA, or when not selected. Tests marked
    big_gpu_memory share one xdist group (tests/gpu/_sharing.py)."""
    mark_big_tests(items)
    mine = [it for it in items if os.path.basename(str(it.fspath)) in MINE]
    selected = os.environ.get("NSA_TEST_FA2") == "1" or "gpu" in (config.getoption("-m") or "")
    for it in mine:
        it.add_marker(pytest.mark.gpu)
        if not torch.cuda.is_available():
            it.add_marker(pytest.mark.skip(reason="no CUDA GPU (torch.cuda.is_available() is False)"))
        elif not selected:
            it.add_marker(pytest.mark.skip(reason="GPU tests run with -m gpu or NSA_TEST_FA2=1"))


def fa2_provider_names() -> list[str]:
    if not torch.cuda.is_available():
        return ["torch_flash"]  # collected only; skipped above
    from nsa import plan

    dev = torch.device("cuda")
    names = [n for n in ("flash_attn", "torch_flash") if plan.PROVIDERS[n].availability(dev, True)[0]]
    return names or ["torch_flash"]  # none available: the test fails loudly (availability is asserted)


@pytest.fixture(params=fa2_provider_names())
def provider(request):
    from nsa import plan

    ok, why = plan.PROVIDERS[request.param].availability(torch.device("cuda"), True)
    assert ok, f"{request.param} unavailable on this GPU machine: {why}"
    return request.param


@pytest.fixture
def fa2_env(monkeypatch):
    """Toggles cleared, min lengths 1 (tiny test shapes must still take the FA-2 path), telemetry reset."""
    for var in ENV:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NSA_FA2_MIN_LEN_WIN", "1")
    monkeypatch.setenv("NSA_FA2_MIN_LEN_CMP", "1")
    telemetry.reset()
    yield monkeypatch


@pytest.fixture
def sel_env(monkeypatch):
    """A clean selection-toggle environment; small test shapes must still take the kernel."""
    for var in SEL_ENV:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NSA_SEL_TRITON_MIN_L", "1")
    telemetry.reset()
    yield monkeypatch
