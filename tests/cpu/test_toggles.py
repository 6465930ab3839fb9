"""Environment toggles: defaults, parsing, errors on malformed values, read at call time."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

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
                                     ("NSA_FA2_MIN_LEN_CMP", "-1"), ("NSA_SDPA_CHUNK", "0")])
def test_malformed_values_raise_naming_the_variable(clean_env, var, raw):
    clean_env.setenv(var, raw)
    with pytest.raises(NSAInputError, match=var):
        toggles.read()


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

