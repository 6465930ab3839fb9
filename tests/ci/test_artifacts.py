"""ci/evidence/artifacts.py: the run directory, JUnit parsing, suite status, the verdict, summary.md, the commit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from ci.evidence import artifacts as A

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="gpu_parity" tests="4">
<testcase classname="t.a" name="ok1" time="0.1"/><testcase classname="t.a" name="ok2" time="0.1"/>
<testcase classname="t.a" name="skip"><skipped message="needs flash_attn"/></testcase>
<testcase classname="t.b" name="bad"><failure message="boom">trace</failure></testcase>
</testsuite></testsuites>"""

ENV = {"host": "gpuhost", "gpus": [{"name": "NVIDIA H200", "sm": "9.0"}], "driver": {"version": "580.65"},
       "python": {"version": "3.12.3"}, "torch": {"version": "2.11.0+cu130", "cuda": "13.0"},
       "triton": {"version": "3.6.0"}, "flash_attn": {"version": None}, "cell": "cu130-torch2.11-py312"}
SHA = "abc1234" + "0" * 33
CLEAN = {"commit": SHA, "commit_short": SHA[:12], "commit_source": "git", "dirty": False, "changes": []}
AS_LOCKED = {"missing": [], "extra": [{"name": "x"}], "wrong_version": [], "matching": 40, "drift": True}
MAIN_PUSH = {"event": "push", "ref": "refs/heads/main", "repository": "o/nsa", "run_id": "9", "run_attempt": "1",
             "sha": SHA}


def test_slugs():
    assert A.gpu_slug([{"name": "NVIDIA H100 80GB HBM3"}]) == "nvidia-h100-80gb-hbm3"
    assert A.gpu_slug([{"name": "NVIDIA H200"}] * 2) == "2x-nvidia-h200"
    assert A.gpu_slug([]) == "no-gpu"
    assert A.slug_path("cu130-torch2.11-py312") == "cu130-torch2.11-py312"
    assert A.slug_path("../x y") == "x-y"


def test_parse_junit_and_status(tmp_path):
    p = tmp_path / "j.xml"
    p.write_text(JUNIT)
    c = A.parse_junit(p)
    assert (c["tests"], c["passed"], c["failed"], c["skipped"]) == (4, 2, 1, 1)
    assert c["skip_reasons"] == ["needs flash_attn"] and c["failures"] == ["t.b::bad"]
    assert A.suite_status(1, c)[0] == A.FAIL
    ok = dict(c, failed=0, failures=[])
    assert A.suite_status(0, ok) == (A.PASS, [])
    # every test skipped, no tests at all, an expected file missing, or a timeout: never a PASS
    assert A.suite_status(0, dict(ok, passed=0))[0] == A.FAIL
    assert A.suite_status(5, {"tests": 0})[0] == A.FAIL
    status, notes = A.suite_status(0, ok, missing=["tests/gpu/test_fa2_parity.py"])
    assert status == A.FAIL and "test_fa2_parity.py" in notes[0]
    status, notes = A.suite_status(124, ok)
    assert status == A.FAIL and "timed out" in notes[-1]
    assert A.parse_junit(tmp_path / "absent.xml")["missing"]


def test_collect_env_records_failure(tmp_path):
    # An interpreter whose `-m nsa_env` fails: env.json holds the failure instead of the report.
    bad = tmp_path / "python"
    bad.write_text("#!/bin/sh\necho 'ImportError: torch broke' >&2\nexit 3\n")
    bad.chmod(0o755)
    rep = A.collect_env(str(bad), tmp_path / "env.json")
    saved = json.loads((tmp_path / "env.json").read_text())
    assert saved["returncode"] == 3 and "torch broke" in saved["stderr"] and rep == saved
    assert A.env_facts(saved)["env_error"]
    ok = A.collect_env(sys.executable, tmp_path / "env2.json")  # the real report of this interpreter
    assert ok.get("schema") == "nsa-env/1" and "host" in ok


def test_run_logged(tmp_path):
    res = A.run_logged([sys.executable, "-c", "print('hello'); import sys; sys.exit(3)"], tmp_path / "l" / "x.log",
                       echo=False)
    assert res.returncode == 3 and res.tail == ["hello"]
    text = (tmp_path / "l" / "x.log").read_text()
    assert text.startswith("$ ") and "hello" in text and "[exit 3" in text


def test_run_logged_enforces_its_timeout_on_the_whole_process_group(tmp_path):
    """1 s on a command that sleeps 8 s (and whose child would sleep on, holding the output open): rc 124 in
    about 1 s, the log and tail say so, and the child is killed too."""
    script = tmp_path / "hang.sh"
    script.write_text(f"#!/bin/sh\necho started\nsleep 8 &\necho $! > {tmp_path / 'child.pid'}\nsleep 8\n")
    script.chmod(0o755)
    t0 = time.monotonic()
    res = A.run_logged([str(script)], tmp_path / "hang.log", echo=False, timeout=1)
    took = time.monotonic() - t0
    assert res.returncode == 124 and took < 4, (res, took)
    assert res.tail[0] == "started" and "timed out after 1 s" in res.tail[-1]
    assert "timed out after 1 s" in (tmp_path / "hang.log").read_text()
    child = int((tmp_path / "child.pid").read_text())
    time.sleep(0.2)
    assert not _alive(child), "the command's child outlived the timeout"


def _alive(pid: int) -> bool:
    """Running (a killed child whose parent died may linger as a zombie until init reaps it: not running)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


def _run(tmp_path, suites, *, run_id="r1", commit=CLEAN, github=None, lock=AS_LOCKED, log=print):
    run = A.RunDir.create(tmp_path / "artifacts", "cu130-torch2.11-py312", ENV["gpus"], run_id=run_id,
                          commit=commit, github=github, log=log)
    run.set_env(ENV)
    run.set_lock("cu130-torch2.11-py312", lock)
    (run.path / "junit-gpu_parity.xml").write_text(JUNIT)
    (run.path / "logs" / "gpu_parity.log").write_text("log\n")
    for name, status in suites.items():
        run.begin_suite(name, 600)
        if status != A.RUNNING:  # RUNNING: the session died before recording a result
            run.record_suite(name, status=status, runtime_s=12.5,
                             counts={"passed": 9, "failed": 0 if status == A.PASS else 1, "skipped": 2,
                                     "skip_reasons": ["needs flash_attn"]}, notes=[])
    run.record_bench("decode", status=A.PASS, runtime_s=30.0, summary=["S=4096 step 0.21 ms"])
    run.state["gate"] = {"status": "PASS", "class": "h200", "allowance": 0.15, "lines": ["prefill_fwd_ms: ok"],
                         "rows": [{"figure": "prefill_fwd_ms", "value": 1.23456}]}
    run.finalize()
    return run


def kg_of(run) -> dict:
    return json.loads((run.path / "known_good.json").read_text())


ALL_PASS = {"gpu_parity": A.PASS, "backward": A.PASS, "bench": A.PASS}


def test_a_complete_clean_local_run_is_known_good(tmp_path, monkeypatch):
    monkeypatch.setenv("NSA_IMAGE_DIGEST", "sha256:feed")
    run = _run(tmp_path, ALL_PASS)
    assert run.path == tmp_path / "artifacts" / SHA[:12] / "cu130-torch2.11-py312" / "nvidia-h200"
    for f in ("summary.md", "known_good.json", "state.json"):
        assert (run.path / f).exists()
    s = (run.path / "summary.md").read_text()
    # The seeds' reporting template, filled in, with each suite's wall time and limit and the run's.
    assert "GPU Host: gpuhost / NVIDIA H200 / Driver 580.65" in s
    assert f"Commit: {SHA} (from git)" in s and "CI: none (local run)" in s
    assert "Torch/Triton/CUDA: torch 2.11.0+cu130, triton 3.6.0, cuda 13.0" in s
    assert "GPU parity" in s and ": PASS (12.5 s; limit 10.0 min; 9 passed, 0 failed, 2 skipped)" in s
    assert "Run: r1, " in s and "(wall time " in s
    assert "skipped: needs flash_attn" in s
    assert "- decode bench: PASS" in s and "S=4096 step 0.21 ms" in s
    assert "Bench gate (h200, allowance 15%): PASS" in s
    assert "## Artifacts" in s and "- junit-gpu_parity.xml" in s and "- logs/gpu_parity.log" in s
    assert "Verdict: known-good" in s
    kg = kg_of(run)
    assert kg["status"] == "known-good" and kg["cell"] == "cu130-torch2.11-py312" and kg["gpu"] == "NVIDIA H200"
    assert kg["commit"] == SHA and kg["commit_short"] == SHA[:12] and kg["run_id"] == "r1" and kg["github"] is None
    assert kg["driver"] == "580.65" and kg["image_digest"] == "sha256:feed"
    assert kg["lock"]["path"] == "requirements/locks/cu130-torch2.11-py312.txt" and len(kg["lock"]["sha256"]) == 64
    assert kg["lock_check"]["extra"] == 1 and kg["headline"] == {"prefill_fwd_ms": 1.2346}
    assert kg["suites"]["gpu_parity"]["status"] == "PASS" and kg["versions"]["torch"] == "2.11.0+cu130"
    assert A.parse_date(kg["date"]) and kg["artifacts"].endswith(f"{SHA[:12]}/cu130-torch2.11-py312/nvidia-h200")
    # A push on main testing the commit that triggered it certifies too.
    assert kg_of(_run(tmp_path / "ci", ALL_PASS, github=MAIN_PUSH))["status"] == "known-good"


@pytest.mark.parametrize("suites, status, words", [
    ({"gpu_parity": A.PASS, "backward": A.FAIL, "bench": A.PASS}, "failing", "backward (FAIL)"),
    # killed, crashed or timed out after the suite started: it stays RUNNING, and that is a failure
    ({"gpu_parity": A.PASS, "backward": A.PASS, "bench": A.RUNNING}, "failing", "bench did not finish"),
    ({"gpu_parity": A.PASS, "backward": A.PASS}, "incomplete", "not run in this run: bench"),
])
def test_a_failed_killed_or_partial_run_is_not_known_good(tmp_path, suites, status, words):
    run = _run(tmp_path, suites)
    kg = kg_of(run)
    assert kg["status"] == status and words in kg["reason"]
    assert f"Verdict: {status}" in (run.path / "summary.md").read_text()


def test_a_suite_is_running_on_disk_before_it_starts(tmp_path):
    run = _run(tmp_path, {"gpu_parity": A.PASS, "backward": A.PASS})
    run.begin_suite("bench", 600)  # what a kill right after this leaves behind
    on_disk = json.loads((run.path / "state.json").read_text())
    assert on_disk["suites"]["bench"]["status"] == A.RUNNING and kg_of(run)["status"] == "failing"
    assert "RUNNING since" in (run.path / "summary.md").read_text()


DIRTY = {**CLEAN, "dirty": True, "changes": [" M nsa/api.py"]}
UNKNOWN = {"commit": "unknown", "commit_short": "unknown", "commit_source": None, "dirty": None, "changes": []}
NSA_COMMIT = {**CLEAN, "commit_source": "NSA_COMMIT", "dirty": None}


@pytest.mark.parametrize("commit, github, words", [
    (DIRTY, None, "uncommitted changes"),
    (UNKNOWN, None, "commit unknown"),
    (NSA_COMMIT, None, "not checked for changes"),
    ({**CLEAN, "commit_source": "GITHUB_SHA", "dirty": None}, None, "not checked for changes"),
    (CLEAN, {**MAIN_PUSH, "event": "pull_request", "ref": "refs/pull/7/merge"}, "a pull_request run"),
    (CLEAN, {**MAIN_PUSH, "event": "push", "ref": "refs/heads/feature"}, "on refs/heads/feature"),
    (CLEAN, {**MAIN_PUSH, "event": "workflow_dispatch"}, "a workflow_dispatch run"),
    (CLEAN, {**MAIN_PUSH, "sha": "f" * 40}, "not the commit ffffffffffff"),
])
def test_a_run_that_cannot_certify_its_commit_is_evidence_only(tmp_path, commit, github, words):
    kg = kg_of(_run(tmp_path, ALL_PASS, commit=commit, github=github))
    assert kg["status"] == A.EVIDENCE and words in kg["reason"], kg["reason"]


def test_ci_without_git_in_the_container_uses_the_checked_out_github_sha(tmp_path):
    # actions/checkout wrote exactly GITHUB_SHA's tree; git could not inspect it: a main push still certifies.
    kg = kg_of(_run(tmp_path, ALL_PASS, commit={**CLEAN, "commit_source": "GITHUB_SHA", "dirty": None},
                    github=MAIN_PUSH))
    assert kg["status"] == "known-good", kg["reason"]


def test_sessions_of_one_run_accumulate(tmp_path):
    _run(tmp_path, {"gpu_parity": A.PASS})
    run = A.RunDir.create(tmp_path / "artifacts", "cu130-torch2.11-py312", ENV["gpus"], run_id="r1", commit=CLEAN)
    assert "gpu_parity" in run.state["suites"]  # a later session (backward) of the same run keeps it
    # a session that sees a dirty tree makes the whole run dirty
    A.RunDir.create(tmp_path / "artifacts", "cu130-torch2.11-py312", ENV["gpus"], run_id="r1", commit=DIRTY).save()
    run = A.RunDir.create(tmp_path / "artifacts", "cu130-torch2.11-py312", ENV["gpus"], run_id="r1", commit=CLEAN)
    assert run.state["dirty"] is True


def test_state_left_by_another_run_is_not_merged(tmp_path):
    _run(tmp_path, ALL_PASS, run_id="old")
    said = []
    run = _run(tmp_path, {"bench": A.PASS}, run_id="new", log=said.append)
    kg = kg_of(run)
    assert kg["status"] == "incomplete" and "gpu_parity, backward" in kg["reason"] and kg["run_id"] == "new"
    assert set(run.state["suites"]) == {"bench"}
    aside = run.path.with_name("nvidia-h200.previous")
    assert json.loads((aside / "state.json").read_text())["run_id"] == "old"
    assert "held run 'old', not this run 'new'" in said[0] and "nvidia-h200.previous" in said[0]


def _git(repo, *args, env=None):
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, env=env)


@pytest.fixture
def repo(tmp_path, monkeypatch):
    # No user or system git config here: a safe.directory of the machine must not hide the refusal.
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(tmp_path / "no-gitconfig"))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    r = tmp_path / "repo"
    r.mkdir()
    _git(r, "init", "-q")
    (r / "a.txt").write_text("a\n")
    _git(r, "add", "a.txt")
    assert _git(r, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x").returncode == 0
    return r


@pytest.mark.skipif(os.geteuid() != 0, reason="simulates a checkout owned by another user: needs root to chown")
def test_commit_is_recorded_when_git_refuses_the_directory(repo):
    """Root in a container, the checkout owned by the runner's user: plain git refuses ("dubious ownership")."""
    sha = _git(repo, "rev-parse", "HEAD").stdout.strip()
    subprocess.run(["chown", "-R", "12345:12345", str(repo)], check=True)
    refused = _git(repo, "rev-parse", "HEAD")
    assert refused.returncode != 0 and "dubious ownership" in refused.stderr
    got = A.git_commit(repo, environ={})
    assert got["commit"] == sha and got["commit_short"] == sha[:12] and got["commit_source"] == "git"
    assert got["dirty"] is False


def test_dirty_tree_tracked_and_untracked(repo):
    assert A.git_commit(repo, environ={})["dirty"] is False
    (repo / "out").mkdir()
    (repo / "out" / "x.json").write_text("{}")  # the artifact folder, excluded
    assert A.git_commit(repo, environ={}, exclude="out")["dirty"] is False
    (repo / "conftest.py").write_text("")  # untracked: changes what pytest runs
    got = A.git_commit(repo, environ={}, exclude="out")
    assert got["dirty"] is True and got["changes"] == ["?? conftest.py"]
    (repo / "conftest.py").unlink()
    (repo / "a.txt").write_text("b\n")
    assert A.git_commit(repo, environ={}, exclude="out")["changes"] == [" M a.txt"]


def test_commit_falls_back_to_github_sha_then_nsa_commit(tmp_path, monkeypatch):
    def git_fails(cmd, **kw):
        return subprocess.CompletedProcess(cmd, 128, "", "fatal: detected dubious ownership in repository")

    monkeypatch.setattr(A.subprocess, "run", git_fails)
    got = A.git_commit(tmp_path, environ={"GITHUB_SHA": SHA, "NSA_COMMIT": "other"})
    assert (got["commit"], got["commit_short"], got["commit_source"], got["dirty"]) == (SHA, SHA[:12], "GITHUB_SHA",
                                                                                        None)
    assert "dubious ownership" in got["git_error"]
    assert A.git_commit(tmp_path, environ={"NSA_COMMIT": "beef"})["commit_source"] == "NSA_COMMIT"
    assert A.git_commit(tmp_path, environ={})["commit"] == "unknown"


def test_a_git_status_that_cannot_finish_keeps_the_commit_and_leaves_the_tree_unchecked(monkeypatch, tmp_path):
    real = subprocess.run

    def slow_status(cmd, **kw):
        if "status" in cmd:
            raise subprocess.TimeoutExpired(cmd, 60)
        return real(["echo", SHA], **kw)

    monkeypatch.setattr(A.subprocess, "run", slow_status)
    got = A.git_commit(tmp_path, environ={"GITHUB_SHA": "other"})
    assert (got["commit"], got["commit_source"], got["dirty"]) == (SHA, "git", None)
    entry = {"run_id": "r", "commit": SHA, "commit_source": "git", "dirty": None, "github": None}
    assert "not checked for changes" in A.provenance_problems(entry)[0]


def test_run_id_and_github_context():
    assert A.new_run_id({"GITHUB_RUN_ID": "77", "GITHUB_RUN_ATTEMPT": "2"}) == "gh-77-2"
    assert A.new_run_id({}) != A.new_run_id({})
    assert A.github_context({}) is None
    gh = A.github_context({"GITHUB_ACTIONS": "true", "GITHUB_EVENT_NAME": "push", "GITHUB_REF": "refs/heads/main",
                           "GITHUB_SHA": SHA})
    assert gh["event"] == "push" and gh["ref"] == "refs/heads/main" and gh["sha"] == SHA
