"""The interpreter switch of the *_interp test modules (tests/cpu/interp.py) stays off on a CUDA host."""

from __future__ import annotations

import pytest

from . import interp


def test_no_interpreter_switch_on_a_cuda_host(monkeypatch):
    """On a GPU host a plain `pytest -k ...` collects interpreter and GPU tests in one process: switching the
    interpreter on there would run the GPU tests' kernels interpreted. The module skips instead, saying why."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(interp, "_cuda_host", lambda: True)
    with pytest.raises(pytest.skip.Exception, match="CUDA GPU is present"):
        interp.kernel_modules("not_loaded_module", probe="not_loaded_module.kernel")
    import os

    assert "TRITON_INTERPRET" not in os.environ


def test_interpreter_switch_on_a_cpu_host(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(interp, "_cuda_host", lambda: False)
    with pytest.raises(pytest.skip.Exception, match="do not import"):  # the module does not exist
        interp.kernel_modules("not_loaded_module", probe="not_loaded_module.kernel")
    import os

    assert os.environ.get("TRITON_INTERPRET") == "1"
