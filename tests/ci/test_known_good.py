"""ci/evidence/known_good.py: merging runs' known_good.json into KNOWN_GOOD.md / known_good.json."""

from __future__ import annotations

import datetime as dt
import json

import pytest

from ci.evidence import artifacts as A
from ci.evidence import known_good as K

AS_LOCKED = {"matching": 55, "missing": 0, "wrong_version": 0, "extra": 3}
NOW = dt.datetime(2026, 11, 25, 12, 0, tzinfo=dt.timezone.utc)
MAIN_PUSH = {"event": "push", "ref": "refs/heads/main", "repository": "o/nsa", "run_id": "9", "sha": None}


def entry(cell="cu130-torch2.11-py312", gpu="nvidia-h200", date="2026-11-20T10:00:00+00:00", commit="aaa",
          suites=None, headline=None, lock_check=AS_LOCKED, **extra):
    """A run's known_good.json; it claims known-good whatever it holds: publish must decide for itself."""
    suites = suites or {"gpu_parity": "PASS", "backward": "PASS", "bench": "PASS"}
    return {"schema": K.SCHEMA, "cell": cell, "gpu": gpu.replace("nvidia-", "NVIDIA ").upper(), "gpu_slug": gpu,
            "gpu_count": 1, "driver": "580.65", "run_id": "r1", "commit": commit, "commit_short": commit[:12],
            "commit_source": "git", "dirty": False, "github": None, "date": date,
            "versions": {"torch": "2.11.0+cu130", "triton": "3.6.0", "cuda": "13.0", "python": "3.12.3"},
            "suites": {n: {"status": s} for n, s in suites.items()}, "bench_gate": "PASS",
            "headline": headline or {"prefill_fwd_ms": 1.5}, "status": "known-good", "lock_check": lock_check,
            **extra}


def write(tmp_path, name, doc):
    p = tmp_path / name / "known_good.json"
    p.parent.mkdir(parents=True)
    p.write_text(json.dumps(doc))
    return p


def publish(tmp_path, *docs):
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    refused = []
    entries = K.publish([write(tmp_path, f"in{i}", d) for i, d in enumerate(docs)], out, now=NOW, refused=refused)
    return entries, refused, (out / "KNOWN_GOOD.md").read_text()


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


def test_headline_units_follow_the_names():
    names = {"decode_step_ms": "ms", "seed_block_fwd_s128_ms": "ms", "speedup_fwd_bwd_vs_fa2_64k": "x",
             "seed_fa2_over_sdpa_cmp": "x", "seed_prefill_decode_tok_per_s_2k": "tok/s"}
    assert {n: K.headline_unit(n) for n in names} == names


def test_dates_are_compared_as_times_not_text():
    # 10:00+05:00 is 05:00 UTC: older than 06:00 UTC although its text sorts later.
    [e] = K.merge([entry(date="2026-11-20T06:00:00+00:00", commit="later"),
                   entry(date="2026-11-20T10:00:00+05:00", commit="earlier")], now=NOW)
    assert e["commit"] == "later"


def test_failing_suite_makes_cell_not_known_good(tmp_path):
    [e], _, md = publish(tmp_path, entry(date="2026-11-20T10:00:00+00:00", commit="good"),
                         entry(date="2026-11-22T10:00:00+00:00", commit="bad",
                               suites={"gpu_parity": "PASS", "backward": "FAIL", "bench": "PASS"}))
    assert e["status"] == "failing" and e["commit"] == "bad"
    assert e["last_known_good"] == {"commit": "good", "date": "2026-11-20T10:00:00+00:00"}
    assert "| **known-good** |" not in md and "| failing (last known-good: good, 2026-11-20) |" in md


@pytest.mark.parametrize("change, status, words", [
    ({"suites": {"gpu_parity": "PASS", "backward": "PASS", "bench": "RUNNING"}}, "failing", "bench did not finish"),
    ({"suites": {"gpu_parity": "PASS", "backward": "PASS"}}, "incomplete", "not run in this run: bench"),
    ({"dirty": True}, "evidence", "uncommitted changes"),
    ({"commit": "unknown", "commit_source": None, "dirty": None}, "evidence", "commit unknown"),
    ({"run_id": None}, "evidence", "no run id"),
    ({"github": MAIN_PUSH}, "evidence", "not the commit"),  # GITHUB_SHA missing: cannot show it was main's commit
])
def test_a_record_claiming_known_good_is_judged_again(tmp_path, change, status, words):
    [e], refused, md = publish(tmp_path, entry(**change))
    assert not refused and e["status"] == status and words in e["reason"], e["reason"]
    assert "**known-good**" not in md


@pytest.mark.parametrize("github", [
    {**MAIN_PUSH, "event": "pull_request", "ref": "refs/pull/7/merge"},
    {**MAIN_PUSH, "event": "workflow_dispatch", "ref": "refs/heads/main"},  # a manual run of another commit
    {**MAIN_PUSH, "event": "push", "ref": "refs/heads/feature"},
])
def test_runs_not_on_main_never_enter_the_table(tmp_path, github):
    good = entry(date="2026-11-20T10:00:00+00:00", commit="main1", github={**MAIN_PUSH, "sha": "main1"})
    other = entry(date="2026-11-24T10:00:00+00:00", commit="pr", github={**github, "sha": "pr"})
    [e], refused, md = publish(tmp_path, good, other)
    assert e["commit"] == "main1" and e["status"] == "known-good"  # the newer PR run displaced nothing
    assert len(refused) == 1 and f"a {github['event']} run on {github['ref']}" in refused[0]
    assert "accepted: local runs, push or schedule runs on refs/heads/main" in refused[0]
    assert "| pr |" not in md


@pytest.mark.parametrize("date, words", [
    ("2026-11-26T12:00:00+00:00", "in the future"),
    (None, "not an ISO 8601 time"),
    ("2026-11-26", "not an ISO 8601 time with a UTC offset"),
    ("2026-11-26T12:00:00", "not an ISO 8601 time with a UTC offset"),
])
def test_undated_or_future_dated_entries_are_refused(tmp_path, date, words):
    honest = entry(date="2026-11-20T10:00:00+00:00", commit="honest")
    forged = entry(date=date, commit="forged", suites={"gpu_parity": "PASS", "backward": "FAIL", "bench": "PASS"})
    [e], refused, _ = publish(tmp_path, honest, forged)
    assert e["commit"] == "honest" and "last_known_good" not in e  # the forged date did not win the merge
    assert len(refused) == 1 and words in refused[0] and "forged" in refused[0]
    # within the clock-skew allowance: accepted
    skewed = entry(date=(NOW + K.CLOCK_SKEW / 2).isoformat(), commit="skewed")
    assert [x["commit"] for x in K.merge([skewed], now=NOW)] == ["skewed"]


def test_a_drifted_run_cannot_be_known_good(tmp_path):
    """Suites that passed on an environment other than the lock are `passes on host environment`, even when
    the run's own record claims known-good; extra packages alone do not count against the lock."""
    drifted = {**AS_LOCKED, "matching": 44, "wrong_version": 11, "extra": 149}
    [e], _, md = publish(tmp_path, entry(lock_check=drifted))
    assert e["status"] == "passes-on-host" and "11 package(s) of the cell's lock" in e["reason"]
    assert "| passes on host environment (11 packages differ) |" in md and "**known-good**" not in md
    assert md.index("## Passes on a host environment") < md.index("passes on host environment (11")
    for check, status in [({**AS_LOCKED, "missing": 1}, "passes-on-host"), (None, "passes-on-host"),
                          ({"error": "nsa-env failed"}, "passes-on-host"), (AS_LOCKED, "known-good")]:
        assert A.verdict(entry(lock_check=check))[0] == status, check


def test_existing_table_is_kept_and_updated(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    K.publish([write(tmp_path, "a", entry(cell="cu128-torch2.8-py311", commit="x"))], out)
    K.publish([write(tmp_path, "b", entry(commit="y"))], out)  # a second publish keeps the first cell
    cells = {e["cell"] for e in json.loads((out / "known_good.json").read_text())["entries"]}
    assert cells == {"cu128-torch2.8-py311", "cu130-torch2.11-py312"}


def test_cli_finds_inputs_in_dirs_and_says_what_it_refused(tmp_path, capsys):
    write(tmp_path / "artifacts" / "c1" / "cell", "gpu", entry())
    write(tmp_path / "artifacts" / "c2" / "cell", "gpu", entry(date="2999-01-01T00:00:00+00:00", commit="future"))
    out = tmp_path / "out"
    out.mkdir()
    assert K.main([str(tmp_path / "artifacts"), "--out-dir", str(out)]) == 0
    cap = capsys.readouterr()
    assert "known-good" in cap.out and (out / "KNOWN_GOOD.md").exists()
    assert "publish: refused" in cap.err and "future" in cap.err and "in the future" in cap.err
    with pytest.raises(FileNotFoundError):
        K.find_inputs([str(tmp_path / "nope")])
    with pytest.raises(ValueError, match="schema"):
        K.merge([{"schema": "other"}])
