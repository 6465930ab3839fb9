"""Environment toggles: defaults, parsing, errors on malformed values, read at call time."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch

from nsa import NSAInputError, toggles

from . import backend_fakes

clean_env = backend_fakes.clean_env


def test_defaults(clean_env):
    t = toggles.read()
    assert t.use_fa2 and t.use_fa2_win and t.use_fa2_cmp and t.fa2_enabled("cmp") and t.fa2_enabled("win")
    assert t.use_cudnn
    assert t.min_len_win is None and t.min_len_cmp is None and t.pref_fp16 is None
    assert not (t.force or t.force_varlen or t.force_dense or t.debug_timing)
    assert not t.fa2_enabled("sel")


@pytest.mark.parametrize("raw,want", [("1", True), ("true", True), ("ON", True), ("0", False), ("no", False),
                                      ("", True)])
def test_bool_parsing(clean_env, raw, want):
    clean_env.setenv("NSA_USE_FA2", raw)
    assert toggles.read().use_fa2 is want


def test_read_at_call_time(clean_env):
    assert toggles.read().fa2_enabled("win")
    clean_env.setenv("NSA_USE_FA2_WIN", "0")
    assert not toggles.read().fa2_enabled("win") and toggles.read().fa2_enabled("cmp")
    clean_env.setenv("NSA_FA2_MIN_LEN_CMP", "4096")
    assert toggles.read().min_len("cmp") == 4096


@pytest.mark.parametrize("var,raw", [("NSA_USE_FA2", "maybe"), ("NSA_USE_CUDNN", "2"), ("NSA_FA2_MIN_LEN_WIN", "1k"),
                                     ("NSA_FA2_MIN_LEN_CMP", "-1"), ("NSA_SDPA_CHUNK", "0"),
                                     ("NSA_TORCH_CHUNK_BUDGET", "64M")])
def test_malformed_values_raise_naming_the_variable(clean_env, var, raw):
    clean_env.setenv(var, raw)
    with pytest.raises(NSAInputError, match=var):
        toggles.read()


def test_chunk_budget_is_read_at_call_time_and_passed_to_the_chunked_paths(clean_env, gen, monkeypatch):
    """NSA_TORCH_CHUNK_BUDGET reaches the plan (else the device's entry of rules.CHUNK_BUDGET), and both
    chunked paths size their chunks from it: the chunked executor and context parallelism's local path."""
    import nsa.distributed.local as local
    import nsa.run.chunked as chunked
    from nsa import nsa_attention, plan
    from nsa.plan import rules

    from .helpers import SMALL, make_inputs

    cfg = SMALL["l8d4s8n4"]
    q, k, v, g = make_inputs(gen, 1, 40, 2, 1, 8, 8, dtype=torch.float32)
    assert plan.make_plan("torch", q, k, v, cfg).chunk_budget == rules.CHUNK_BUDGET["cpu"] == plan.chunk_budget("cpu")
    assert plan.chunk_budget("cuda") == rules.CHUNK_BUDGET["cuda"]
    calls = []
    for mod in (chunked, local):
        monkeypatch.setattr(mod, "_chunk", lambda *a, _f=mod._chunk, _m=mod.__name__: calls.append(_m) or _f(*a))
    whole = nsa_attention(q, k, v, g, cfg, backend="torch")
    whole_local = local.nsa_local(q, g, k, v, cfg, 0)[0]
    assert calls == ["nsa.run.chunked", "nsa.distributed.local"]  # one chunk each: T=40 fits the budget
    clean_env.setenv("NSA_TORCH_CHUNK_BUDGET", "1")  # the smallest chunk, 16 queries
    assert plan.make_plan("torch", q, k, v, cfg).chunk_budget == 1 == plan.chunk_budget("cuda")
    calls.clear()
    torch.testing.assert_close(nsa_attention(q, k, v, g, cfg, backend="torch"), whole, rtol=0, atol=1e-6)
    torch.testing.assert_close(local.nsa_local(q, g, k, v, cfg, 0)[0], whole_local, rtol=0, atol=1e-6)
    assert calls == ["nsa.run.chunked"] * 3 + ["nsa.distributed.local"] * 3


def test_telemetry_log_switches_are_toggles(clean_env, caplog):
    """NSA_DEBUG_LOG / NSA_LOG_LIMIT are read through nsa.toggles at each record: the limit holds per key, and a
    malformed value raises naming the variable (before anything is counted)."""
    from nsa import telemetry

    clean_env.setenv("NSA_DEBUG_LOG", "1")
    clean_env.setenv("NSA_LOG_LIMIT", "2")
    with caplog.at_level("WARNING", logger="nsa"):
        for _ in range(3):
            telemetry.record("cmp", "torch", "ok")
    assert sum("nsa.route branch=cmp" in r.getMessage() for r in caplog.records) == 2
    for var, raw in (("NSA_LOG_LIMIT", "many"), ("NSA_DEBUG_LOG", "maybe")):
        clean_env.setenv(var, raw)
        with pytest.raises(NSAInputError, match=var):
            telemetry.record("cmp", "torch", "ok")
    assert telemetry.served("cmp") == {"torch": 3}


def test_force_varlen_and_dense_contradict(clean_env):
    clean_env.setenv("NSA_FA2_FORCE_VARLEN", "1")
    clean_env.setenv("NSA_FA2_FORCE_DENSE", "1")
    with pytest.raises(NSAInputError, match="contradict"):
        toggles.read()


@pytest.mark.parametrize("raw,want", [(None, None), ("1", True), ("0", False)])
def test_pref_fp16_tristate(clean_env, raw, want):
    if raw is not None:
        clean_env.setenv("NSA_FA2_PREF_FP16", raw)
    assert toggles.read().pref_fp16 is want


def test_every_toggle_is_in_the_docs_table():
    """Each NSA_* variable toggles.read() parses has its row in docs/backends.md (name, default, meaning)."""
    src = Path(toggles.__file__).read_text()
    names = set(re.findall(r'env_\w+\("(NSA_\w+)"', src)) | set(re.findall(r'environ.get\("(NSA_\w+)"\)', src))
    doc = (Path(__file__).resolve().parents[2] / "docs" / "backends.md").read_text()
    assert "NSA_USE_CUDNN" in names and len(names) >= 15
    assert {n for n in names if f"| `{n}` |" not in doc} == set()



@pytest.mark.parametrize("name", sorted(toggles.RETIRED))
def test_retired_toggles_warn_once_naming_the_replacement(clean_env, name):
    """A toggle of the earlier code base is refused loudly (once per process), never silently ignored."""
    toggles.reset_retired_warnings()
    clean_env.setenv(name, "1")
    with pytest.warns(toggles.RetiredToggleWarning, match=f"{name} is set but has no effect") as rec:
        toggles.read()
    assert toggles.RETIRED[name].split(":")[0] in str(rec[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        toggles.read()  # the second read is quiet
    toggles.reset_retired_warnings()


def test_retired_toggles_warn_on_the_torch_backend_too(clean_env, gen):
    """The torch backend reads no routing toggles; the warning still comes from the attention call."""
    from nsa import nsa_attention

    from .helpers import SMALL, make_inputs

    toggles.reset_retired_warnings()
    clean_env.setenv("NSA_SDPA_AUDIT", "1")
    with pytest.warns(toggles.RetiredToggleWarning, match="NSA_SDPA_AUDIT"):
        nsa_attention(*make_inputs(gen, 1, 9, 2, 1, 8, 4), SMALL["l8d4s8n4"], backend="torch")
    toggles.reset_retired_warnings()


def test_debug_timing_logs_path_shapes_dtypes_and_branch_times_on_cpu(clean_env, gen, caplog):
    from nsa import nsa_attention, telemetry

    from .helpers import SMALL, make_inputs

    clean_env.setenv("NSA_DEBUG_TIMING", "1")
    telemetry.reset()
    with caplog.at_level("WARNING", logger="nsa"):
        nsa_attention(*make_inputs(gen, 1, 20, 2, 1, 8, 4, dtype=torch.float32), SMALL["l8d4s8n4"],
                      backend="torch")
    lines = [r.getMessage() for r in caplog.records if "nsa.timing" in r.getMessage()]
    assert len(lines) == 1, lines
    line = lines[0]
    assert "executor=chunked" in line and "cmp:torch/forced" in line and "device=cpu" in line
    assert "q=(1, 20, 2, 8):float32" in line and "v=(1, 20, 1, 4):float32" in line
    for bucket in ("cmp.torch", "sel.torch", "win.torch", "topn.torch"):
        assert f"'{bucket}'" in line and telemetry.snapshot()["timings"][bucket]["calls"] >= 1
    clean_env.delenv("NSA_DEBUG_TIMING")
    caplog.clear()
    nsa_attention(*make_inputs(gen, 1, 20, 2, 1, 8, 4), SMALL["l8d4s8n4"], backend="torch")
    assert not [r for r in caplog.records if "nsa.timing" in r.getMessage()]
