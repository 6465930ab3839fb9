"""ci/evidence/known_good.py: merging runs' known_good.json into KNOWN_GOOD.md / known_good.json."""

from __future__ import annotations

import json

import pytest

from ci.evidence import artifacts as A
from ci.evidence import known_good as K

AS_LOCKED = {"matching": 55, "missing": 0, "wrong_version": 0, "extra": 3}


def entry(cell="cu130-torch2.11-py312", gpu="nvidia-h200", date="2026-11-20T10:00:00+00:00", commit="aaa",
          suites=None, headline=None, lock_check=AS_LOCKED):
    suites = suites or {"gpu_parity": "PASS", "backward": "PASS", "bench": "PASS"}
    ok = all(s == "PASS" for s in suites.values())
    return {"schema": K.SCHEMA, "cell": cell, "gpu": gpu.replace("nvidia-", "NVIDIA ").upper(), "gpu_slug": gpu,
            "gpu_count": 1, "driver": "580.65", "commit": commit, "date": date,
            "versions": {"torch": "2.11.0+cu130", "triton": "3.6.0", "cuda": "13.0", "python": "3.12.3"},
            "suites": {n: {"status": s} for n, s in suites.items()}, "bench_gate": "PASS",
            "headline": headline or {"prefill_fwd_ms": 1.5}, "status": "known-good" if ok else "failing",
            "lock_check": lock_check}


def write(tmp_path, name, doc):
    p = tmp_path / name / "known_good.json"
    p.parent.mkdir(parents=True)
    p.write_text(json.dumps(doc))
    return p


def test_merge_several_newest_wins(tmp_path):
    a = write(tmp_path, "a", entry(date="2026-11-20T10:00:00+00:00", commit="old"))
    b = write(tmp_path, "b", entry(date="2026-11-21T10:00:00+00:00", commit="new", headline={"prefill_fwd_ms": 1.4}))
    c = write(tmp_path, "c", entry(gpu="nvidia-h100-80gb-hbm3", commit="h100"))
    d = write(tmp_path, "d", entry(cell="cu128-torch2.8-py311", commit="other"))
    out = tmp_path / "out"
    out.mkdir()
    entries = K.publish([b, a, c, d], out)  # order of inputs does not matter: the date does
    by = {(e["cell"], e["gpu_slug"]): e for e in entries}
    assert len(entries) == 3
    assert by[("cu130-torch2.11-py312", "nvidia-h200")]["commit"] == "new"
    md = (out / "KNOWN_GOOD.md").read_text()
    assert "| cu130-torch2.11-py312 | NVIDIA H200 (driver 580.65) | **known-good** | 2026-11-21 | new |" in md
    assert "prefill_fwd_ms 1.4 ms" in md and "torch 2.11.0+cu130, triton 3.6.0, CUDA 13.0" in md
    saved = json.loads((out / "known_good.json").read_text())
    assert saved["schema"] == K.TABLE_SCHEMA and len(saved["entries"]) == 3


def test_failing_suite_makes_cell_not_known_good(tmp_path):
    good = write(tmp_path, "a", entry(date="2026-11-20T10:00:00+00:00", commit="good"))
    bad = write(tmp_path, "b", entry(date="2026-11-22T10:00:00+00:00", commit="bad",
                                     suites={"gpu_parity": "PASS", "backward": "FAIL"}))
    out = tmp_path / "out"
    out.mkdir()
    [e] = K.publish([good, bad], out)
    assert e["status"] == "failing" and e["commit"] == "bad"
    assert e["last_known_good"] == {"commit": "good", "date": "2026-11-20T10:00:00+00:00"}
    md = (out / "KNOWN_GOOD.md").read_text()
    assert "| **known-good** |" not in md and "| failing (last known-good: good, 2026-11-20) |" in md


def test_a_drifted_run_cannot_be_known_good(tmp_path):
    """Suites that passed on an environment other than the lock are `passes on host environment`, even when
    the run's own record claims known-good; extra packages alone do not count against the lock."""
    drifted = {**AS_LOCKED, "matching": 44, "wrong_version": 11, "extra": 149}
    out = tmp_path / "out"
    out.mkdir()
    [e] = K.publish([write(tmp_path, "a", entry(lock_check=drifted))], out)
    assert e["status"] == "passes-on-host" and "11 package(s) of the cell's lock" in e["reason"]
    md = (out / "KNOWN_GOOD.md").read_text()
    assert "| passes on host environment (11 packages differ) |" in md and "**known-good**" not in md
    assert md.index("## Passes on a host environment") < md.index("passes on host environment (11")
    for check, status in [({**AS_LOCKED, "missing": 1}, "passes-on-host"), (None, "passes-on-host"),
                          ({"error": "nsa.env failed"}, "passes-on-host"), (AS_LOCKED, "known-good")]:
        assert A.verdict(entry(lock_check=check))[0] == status, check
    # a legacy record without counts cannot stay known-good
    legacy = {k: v for k, v in entry().items() if k != "lock_check"}
    [e] = K.merge([{"schema": K.SCHEMA, **legacy, "lock_drift": True}])
    assert e["status"] == "passes-on-host" and "not checked" in e["reason"]


def test_existing_table_is_kept_and_updated(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    K.publish([write(tmp_path, "a", entry(cell="cu128-torch2.8-py311", commit="x"))], out)
    K.publish([write(tmp_path, "b", entry(commit="y"))], out)  # a second publish keeps the first cell
    cells = {e["cell"] for e in json.loads((out / "known_good.json").read_text())["entries"]}
    assert cells == {"cu128-torch2.8-py311", "cu130-torch2.11-py312"}


def test_cli_finds_inputs_in_dirs(tmp_path, capsys):
    write(tmp_path / "artifacts" / "c1" / "cell", "gpu", entry())
    out = tmp_path / "out"
    out.mkdir()
    assert K.main([str(tmp_path / "artifacts"), "--out-dir", str(out)]) == 0
    assert "known-good" in capsys.readouterr().out and (out / "KNOWN_GOOD.md").exists()
    with pytest.raises(FileNotFoundError):
        K.find_inputs([str(tmp_path / "nope")])
    with pytest.raises(ValueError, match="schema"):
        K.merge([{"schema": "other"}])
