"""The GPU sessions' logic (ci/sessions/gpu.py) and the per-GPU xdist pinning, without a GPU and without nox."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ci.evidence import artifacts as A
from ci.evidence import known_good as K
from ci.sessions import gpu as S
from ci.sessions import gpu_split

ROOT = Path(__file__).resolve().parents[2]
NO_GPU = {"count": 0, "torch": "2.13.0+cpu", "cuda": None, "names": []}


def no_gpu_probe(python, env=None):
    return NO_GPU


def test_parse_args():
    o = S.parse_args(["--skip-no-gpu", "--full", "-n", "2", "-k", "fa2", "--out", "x"], {})
    assert o.skip_no_gpu and o.full and o.workers == "2" and o.pytest_args == ["-k", "fa2"] and o.out == Path("x")
    assert S.parse_args([], {"NSA_SKIP_NO_GPU": "1"}).skip_no_gpu
    assert not S.parse_args([], {"NSA_SKIP_NO_GPU": "0"}).skip_no_gpu
    assert S.parse_args(["-nauto"], {}).workers == "auto"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour on a machine without a GPU")
def test_no_gpu_fails_with_a_clear_message_real_probe():
    out = S.main("gpu_parity", sys.executable, [], env={k: v for k, v in os.environ.items() if k != "NSA_SKIP_NO_GPU"})
    assert out.status == "fail" and out.run_dir is None
    assert "no CUDA GPU" in out.message and "--skip-no-gpu" in out.message and "NSA_SKIP_NO_GPU=1" in out.message


@pytest.mark.parametrize("session", S.SESSIONS)
def test_no_gpu_fails_or_skips_when_asked(session):
    out = S.main(session, sys.executable, [], env={}, probe=no_gpu_probe)
    assert out.status == "fail" and f"{session}: no CUDA GPU" in out.message
    out = S.main(session, sys.executable, ["--skip-no-gpu"], env={}, probe=no_gpu_probe)
    assert out.status == "skip" and "skipped" in out.message
    out = S.main(session, sys.executable, [], env={"NSA_SKIP_NO_GPU": "1"}, probe=no_gpu_probe)
    assert out.status == "skip"


class FakeSession:
    def __init__(self, posargs):
        self.posargs = posargs

    def error(self, msg):
        raise RuntimeError(f"error: {msg}")

    def skip(self, msg):
        raise RuntimeError(f"skip: {msg}")


def test_nox_entry_without_gpu_driver(monkeypatch):
    monkeypatch.setattr(S, "host_has_gpu_driver", lambda: False)
    monkeypatch.delenv("NSA_SKIP_NO_GPU", raising=False)
    with pytest.raises(RuntimeError, match=r"^error: bench: no CUDA GPU .*--skip-no-gpu"):
        S.nox_entry(FakeSession([]), "bench")
    with pytest.raises(RuntimeError, match=r"^skip: backward: skipped"):
        S.nox_entry(FakeSession(["--skip-no-gpu"]), "backward")


CELL = "cu130-torch2.11-py312"
SHA = "c0ffee" + "0" * 34
CLEAN = {"commit": SHA, "commit_short": SHA[:12], "commit_source": "git", "dirty": False, "changes": []}
TWO_GPUS = {"count": 2, "torch": "x", "cuda": "13.0", "names": ["NVIDIA H200", "NVIDIA H200"]}


def two_gpus(python, env=None):
    return TWO_GPUS


@pytest.fixture
def host(tmp_path, monkeypatch):
    """A GPU host at the cell's lock, seen through its interpreter: `-m nsa_env --json` and `--check-lock`
    answer for it, everything else is this interpreter. Returns (python, env) for S.main; git says CLEAN."""
    report = {"schema": "nsa-env/1", "host": "gpuhost", "cell": CELL, "gpus": [{"name": "NVIDIA H200"}] * 2,
              "torch": {"version": "2.11.0+cu130", "cuda": "13.0"}, "driver": {"version": "580.65"}}
    (tmp_path / "report.json").write_text(json.dumps(report))
    (tmp_path / "check.json").write_text(json.dumps({"missing": [], "wrong_version": [], "extra": [], "matching": 9}))
    py = tmp_path / "python"
    py.write_text(f"""#!/bin/sh
case "$*" in
  *"nsa_env --json"*) cat '{tmp_path}/report.json' ;;
  *"--check-lock"*) cat '{tmp_path}/check.json' ;;
  *) exec '{sys.executable}' "$@" ;;
esac
""")
    py.chmod(0o755)
    monkeypatch.setattr(A, "git_commit", lambda **kw: dict(CLEAN))
    for name in S.RUNNERS:
        monkeypatch.setitem(S.RUNNERS, name, passing(name))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GITHUB_", "NSA_"))}
    return str(py), {**env, "NSA_CELL": CELL, "NSA_RUN_ID": "run-1"}


def passing(name):
    def runner(ctx):
        ctx.run.record_suite(name, status=A.PASS, counts={"passed": 3})
        return True
    return runner


def invoke(host, tmp_path, sessions=A.PLANNED_SUITES, log=None, **env):
    python, base_env = host
    outs = [S.main(s, python, ["--out", str(tmp_path / "art")], env={**base_env, **env}, probe=two_gpus,
                   log=log or (lambda *a: None)) for s in sessions]
    run = outs[-1].run_dir
    return outs, json.loads((run / "known_good.json").read_text()), json.loads((run / "state.json").read_text())


def test_one_invocation_of_every_suite_is_known_good(host, tmp_path):
    outs, kg, state = invoke(host, tmp_path)
    assert [o.status for o in outs] == ["pass"] * 3
    assert kg["status"] == "known-good", kg["reason"]
    assert kg["run_id"] == "run-1" and kg["commit"] == SHA and kg["github"] is None and kg["gpu_count"] == 2
    assert outs[-1].run_dir == tmp_path / "art" / SHA[:12] / CELL / "2x-nvidia-h200"
    summary = (outs[-1].run_dir / "summary.md").read_text()
    assert "Verdict: known-good" in summary and "Run: run-1, " in summary and "(wall time " in summary
    assert all(state["suites"][n]["timeout_s"] == S.SUITE_TIMEOUT_S[n] for n in A.PLANNED_SUITES)


def test_oneshot_runs_every_suite_as_one_run(host, tmp_path, monkeypatch):
    monkeypatch.setitem(S.RUNNERS, "backward", lambda ctx: ctx.run.record_suite("backward", status=A.FAIL) or False)
    outs, kg, state = invoke(host, tmp_path, sessions=("oneshot",))
    assert outs[0].status == "fail" and set(state["suites"]) == set(A.PLANNED_SUITES)  # bench ran after the failure
    assert kg["status"] == "failing" and "backward (FAIL)" in kg["reason"]
    assert [s["name"] for s in state["steps"]] == ["environment", "template", "report"]
    # the test plan's reporting template, line by line (bench/runbook_report.py; no GPU here: its benches fail)
    summary = next((tmp_path / "art").rglob("summary.md")).read_text()
    block = summary.split("## Report template\n\n```\n", 1)[1].split("```", 1)[0].splitlines()
    assert block[0] == "Tests:" and block[1].startswith("- Triton FWD parity: ")
    assert block[-1].startswith("- Training showcase: FAIL (exit ")  # no GPU here


def test_a_crashed_suite_stays_running_and_fails_the_run(host, tmp_path, monkeypatch):
    def crash(ctx):
        raise RuntimeError("the bench session died")

    monkeypatch.setitem(S.RUNNERS, "bench", crash)
    with pytest.raises(RuntimeError, match="died"):
        invoke(host, tmp_path)
    kg = json.loads(next((tmp_path / "art").rglob("known_good.json")).read_text())
    assert kg["status"] == "failing" and "bench did not finish" in kg["reason"]


def test_a_timed_out_suite_fails_the_run(host, tmp_path, monkeypatch):
    """The runner claims PASS, but its command ran past the suite's limit (NSA_SUITE_TIMEOUT_BENCH=1)."""
    def hang(ctx):
        res = ctx.sh([sys.executable, "-c", "import time; time.sleep(8)"], "hang.log")
        ctx.run.record_suite("bench", status=A.PASS, notes=[f"exit {res.returncode}"])
        return True

    monkeypatch.setitem(S.RUNNERS, "bench", hang)
    t0 = time.monotonic()
    outs, kg, state = invoke(host, tmp_path, NSA_SUITE_TIMEOUT_BENCH="1")
    assert time.monotonic() - t0 < 8 and outs[-1].status == "fail"
    assert kg["status"] == "failing" and "bench (FAIL)" in kg["reason"]
    assert state["suites"]["bench"]["notes"] == ["exit 124", "timed out: the suite's limit of 1 s was reached "
                                                 "(--suite-timeout or NSA_SUITE_TIMEOUT_BENCH)"]


def test_a_failed_step_beside_the_tests_fails_the_suite(host, tmp_path, monkeypatch):
    """gpu_parity's routing probe runs beside pytest; here pytest passes and the probe fails (no CUDA here)."""
    monkeypatch.setitem(S.RUNNERS, "gpu_parity", S.run_gpu_parity)
    monkeypatch.setattr(S, "pytest_suite", lambda ctx, suite, files, missing: passing(suite)(ctx))
    outs, kg, state = invoke(host, tmp_path)
    assert outs[0].status == "fail" and state["suites"]["gpu_parity"]["status"] == A.FAIL
    assert "routing+sanity failed" in state["suites"]["gpu_parity"]["notes"][0]
    assert [s["status"] for s in state["steps"] if s["name"] == "routing+sanity"] == [A.FAIL]
    assert kg["status"] == "failing"


def test_the_environment_is_probed_once_per_run(host, tmp_path):
    python, _ = host
    count = f"echo >> '{tmp_path}/n'; cat"
    script = Path(python).read_text().replace('*"nsa_env --json"*) cat', f'*"nsa_env --json"*) {count}')
    Path(python).write_text(script)
    invoke(host, tmp_path)
    assert (tmp_path / "n").read_text().count("\n") == 1  # three sessions, one report
    invoke(host, tmp_path, NSA_RUN_ID="run-2")
    assert (tmp_path / "n").read_text().count("\n") == 2


def test_an_overlay_venv_is_recorded_and_needs_a_clean_pip_check(host, tmp_path):
    """A run from an overlay venv (ci/sessions/overlay.py) records it; a failed `pip check` there is no lock."""
    python, _ = host
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    Path(python).rename(venv / "bin" / "python")
    host = (str(venv / "bin" / "python"), host[1])
    marker = {"install": [["pytest", "9.2.0", "9.1.1"]], "pip_check": {"returncode": 0, "output": []}}
    (venv / "nsa-overlay.json").write_text(json.dumps(marker))
    _, kg, _ = invoke(host, tmp_path)
    assert kg["status"] == "known-good" and kg["overlay"] == marker
    marker["pip_check"] = {"returncode": 1, "output": ["jax 0.1 requires numpy<2, which is not installed"]}
    (venv / "nsa-overlay.json").write_text(json.dumps(marker))
    _, kg, _ = invoke(host, tmp_path, NSA_RUN_ID="run-2")
    assert kg["status"] == "passes-on-host" and "pip check" in kg["reason"]


def test_a_partial_run_is_incomplete(host, tmp_path):
    _, kg, _ = invoke(host, tmp_path, sessions=("gpu_parity", "backward"))
    assert kg["status"] == "incomplete" and "bench" in kg["reason"]


def test_state_of_another_run_id_is_set_aside(host, tmp_path):
    assert invoke(host, tmp_path)[1]["status"] == "known-good"
    said = []
    _, kg, state = invoke(host, tmp_path, sessions=("bench",), log=said.append, NSA_RUN_ID="run-2")
    assert kg["status"] == "incomplete" and set(state["suites"]) == {"bench"} and kg["run_id"] == "run-2"
    assert any("held run 'run-1', not this run 'run-2'" in m for m in said), said


GH = {"GITHUB_ACTIONS": "true", "GITHUB_REPOSITORY": "o/nsa", "GITHUB_RUN_ID": "42", "GITHUB_SHA": SHA}


@pytest.mark.parametrize("env, commit, words", [
    ({**GH, "GITHUB_EVENT_NAME": "pull_request", "GITHUB_REF": "refs/pull/7/merge"}, CLEAN, "a pull_request run"),
    ({**GH, "GITHUB_EVENT_NAME": "workflow_dispatch", "GITHUB_REF": "refs/heads/main", "GITHUB_SHA": "e" * 40},
     CLEAN, "a workflow_dispatch run"),
    ({**GH, "GITHUB_EVENT_NAME": "push", "GITHUB_REF": "refs/heads/main", "GITHUB_SHA": "e" * 40}, CLEAN,
     "not the commit eeeeeeeeeeee"),
    ({}, {**CLEAN, "dirty": True, "changes": [" M nsa/api.py"]}, "uncommitted changes"),
    ({}, {**CLEAN, "commit": "unknown", "commit_short": "unknown", "commit_source": None, "dirty": None},
     "commit unknown"),
])
def test_runs_that_cannot_certify_their_commit(host, tmp_path, monkeypatch, env, commit, words):
    monkeypatch.setattr(A, "git_commit", lambda **kw: dict(commit))
    _, kg, state = invoke(host, tmp_path, **env)
    assert kg["status"] == A.EVIDENCE and words in kg["reason"], kg["reason"]
    if env:  # the GitHub context is recorded, the commit under test beside GitHub's
        assert state["github"]["event"] == env["GITHUB_EVENT_NAME"] == kg["github"]["event"]
        assert kg["github"]["sha"] == env["GITHUB_SHA"] and kg["commit"] == SHA
    out = tmp_path / "table"
    out.mkdir()
    refused = []
    entries = K.publish(list((tmp_path / "art").rglob("known_good.json")), out, refused=refused)
    assert all(e["status"] != "known-good" for e in entries) and (entries or refused)


def test_the_sessions_named_together_share_one_run_id(monkeypatch):
    seen = []
    monkeypatch.setattr(S, "main", lambda name, python, argv: seen.append(os.environ["NSA_RUN_ID"]) or
                        S.Outcome("pass", name))
    monkeypatch.delenv("NSA_RUN_ID", raising=False)
    assert S.cli(["gpu_parity", "backward", "bench"]) == 0
    assert len(seen) == 3 and len(set(seen)) == 1
    monkeypatch.setenv("NSA_RUN_ID", "ci-7")
    seen.clear()
    S.cli(["bench"])
    assert seen == ["ci-7"]


def test_timeouts_options_and_defaults():
    o = S.parse_args(["--suite-timeout", "30", "--test-timeout", "7"], {})
    assert (o.suite_timeout, o.test_timeout) == (30, 7)
    assert S.parse_args([], {"NSA_TEST_TIMEOUT": "11"}).test_timeout == 11
    plain, full = S.parse_args([], {}), S.parse_args(["--full"], {})
    assert S.suite_timeout("bench", plain, {}) == S.SUITE_TIMEOUT_S["bench"]
    assert S.suite_timeout("bench", full, {}) == S.FULL_BENCH_TIMEOUT_S
    assert S.suite_timeout("backward", plain, {"NSA_SUITE_TIMEOUT_BACKWARD": "5"}) == 5
    assert S.suite_timeout("backward", o, {"NSA_SUITE_TIMEOUT_BACKWARD": "5"}) == 30


def test_pytest_gets_a_per_test_timeout_when_the_plugin_is_there(host, tmp_path, monkeypatch):
    python, env = host
    opts = S.parse_args(["--out", str(tmp_path / "art")], env)
    ctx = S.make_context(python, opts, env, TWO_GPUS, log=lambda *a: None)
    test = tmp_path / "test_one.py"
    test.write_text("def test_one():\n    pass\n")
    assert S.has_module(python, "json", env) and not S.has_module(python, "no_such_module_here", env)

    def command(plugin: bool, extra=()):
        monkeypatch.setattr(S, "has_module", lambda *a: plugin)
        ctx.opts.pytest_args = list(extra)
        S.pytest_suite(ctx, "gpu_parity", [str(test)], [])
        return ctx.run.state["suites"]["gpu_parity"]["command"]

    assert command(True).endswith(f"--timeout {S.TEST_TIMEOUT_S}")
    assert "--timeout" not in command(False)
    assert command(True, ["--timeout", "5"]).count("--timeout") == 1  # the caller's own limit wins


@pytest.mark.skipif(not S.has_module(sys.executable, "pytest_timeout", dict(os.environ)),
                    reason="pytest-timeout is not installed in this environment")
def test_a_hung_test_is_stopped_by_its_timeout(host, tmp_path):
    python, env = host
    opts = S.parse_args(["--out", str(tmp_path / "art"), "--test-timeout", "1"], env)
    ctx = S.make_context(python, opts, env, TWO_GPUS, log=lambda *a: None)
    test = tmp_path / "test_hang.py"
    test.write_text("import time\ndef test_hang():\n    time.sleep(30)\n")
    t0 = time.monotonic()
    assert not S.pytest_suite(ctx, "gpu_parity", [str(test)], [])
    assert time.monotonic() - t0 < 25 and ctx.run.state["suites"]["gpu_parity"]["status"] == A.FAIL


def test_session_writes_the_artifact_tree(tmp_path, monkeypatch):
    """With a (faked) GPU and this interpreter's real environment report, one session writes env.json, its
    suite record, summary.md and known_good.json (incomplete: one suite of three)."""
    def fake_parity(ctx):
        assert ctx.gpus == 2
        ctx.run.record_suite("gpu_parity", status=A.PASS, runtime_s=1.0, counts={"passed": 3})
        return True

    monkeypatch.setitem(S.RUNNERS, "gpu_parity", fake_parity)
    monkeypatch.setattr(A, "git_commit", lambda **kw: dict(CLEAN))
    monkeypatch.setenv("NSA_CELL", CELL)
    out = S.main("gpu_parity", sys.executable, ["--out", str(tmp_path)], env=dict(os.environ), probe=two_gpus,
                 log=lambda *a: None)
    assert out.status == "pass", out.message
    run = tmp_path / SHA[:12] / CELL / "2x-nvidia-h200"
    assert out.run_dir == run
    env = json.loads((run / "env.json").read_text())
    assert env["schema"] == "nsa-env/1"  # the real report of this interpreter
    assert (run / "lock-check.json").exists()
    kg = json.loads((run / "known_good.json").read_text())
    assert kg["status"] == "incomplete" and kg["suites"]["gpu_parity"]["status"] == "PASS"
    assert kg["gpu_count"] == 2 and kg["lock"]["sha256"]
    assert "GPU parity" in (run / "summary.md").read_text()


def test_suite_files_partition():
    parity, _ = S.suite_files("gpu_parity")
    backward, _ = S.suite_files("backward")
    assert "tests/gpu/test_decode_gpu.py" in parity and "tests/gpu/test_gradcheck_gpu.py" in backward
    assert not set(parity) & set(backward)


def test_bench_arguments_are_the_scripts_own():
    """Every option the bench suite passes (quick and full, the output flag, --device) is one its script
    defines: a renamed option fails here rather than on the GPU runner."""
    import re

    for name, (script, out_flag, quick, full) in S.BENCHES.items():
        defined = set(re.findall(r'add_argument\(\s*"(--[\w-]+)"', (ROOT / script).read_text()))
        used = {a for a in [*quick, *full, out_flag] if a.startswith("--")}
        assert used <= defined, (name, sorted(used - defined))
        assert ("--device" in defined) == (name != "fa2"), name  # run_bench adds --device cuda where defined


def test_workers_per_gpu():
    assert gpu_split.workers_per_gpu(1, {}, cpus=16) == 16  # compiles overlap tests: several per GPU
    assert gpu_split.workers_per_gpu(8, {}, cpus=128) == 16 and gpu_split.workers_per_gpu(2, {}, cpus=2) == 1
    assert gpu_split.workers_per_gpu(1, {"NSA_WORKERS_PER_GPU": "3"}) == 3
    for bad in ("0", "x", "-1"):
        with pytest.raises(ValueError, match="NSA_WORKERS_PER_GPU"):
            gpu_split.workers_per_gpu(1, {"NSA_WORKERS_PER_GPU": bad})


def test_pin_worker():
    env = {"PYTEST_XDIST_WORKER": "gw3", "NSA_GPU_LIST": "0,1"}
    assert gpu_split.pin_worker(env) == "1" and env["CUDA_VISIBLE_DEVICES"] == "1"
    assert gpu_split.pin_worker(env) == "1"  # idempotent
    assert gpu_split.pin_worker({"NSA_GPU_LIST": "0,1"}) is None  # not a worker
    assert gpu_split.pin_worker({"PYTEST_XDIST_WORKER": "gw0", "NSA_GPU_LIST": ""}) is None  # no GPU


def test_xdist_workers_spread_over_the_gpus_each_pinned(tmp_path):
    """`-n auto` with the plugin starts NSA_WORKERS_PER_GPU workers per visible GPU, each seeing one GPU."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_pin.py").write_text(
        "import os, pytest\n"
        "@pytest.mark.parametrize('i', range(16))\n"
        "def test_where(i):\n"
        "    with open(os.path.join(os.path.dirname(__file__), os.environ['PYTEST_XDIST_WORKER']), 'w') as f:\n"
        "        f.write(os.environ['CUDA_VISIBLE_DEVICES'])\n")
    # A fresh controller: none of this (possibly xdist-worker) process's pinning variables.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST", "NSA_GPU_"))}
    env.update(PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="5,7", NSA_WORKERS_PER_GPU="2")
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "ci.sessions.gpu_split", "-n", "auto", "-p",
                        "no:cacheprovider", str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    seen = {f.name: f.read_text() for f in tmp_path.glob("gw*")}
    assert seen == {"gw0": "5", "gw1": "7", "gw2": "5", "gw3": "7"}, (seen, p.stdout)


def test_the_lock_check_expects_the_flash_attn_pin_where_flash_attn_is_installed(tmp_path):
    cell = "cu130-torch2.12-py312"
    assert S.expected_set(cell, {"flash_attn": {"installed": False}}, tmp_path) == cell
    name = S.expected_set(cell, {"flash_attn": {"installed": True}}, tmp_path)
    assert name == f"{cell}.expected.txt"  # starts with the cell: nsa-env reads the build variant from it
    text = (tmp_path / name).read_text()
    assert "torch==2.12.1" in text and "flash-attn==2.8.3.post2" in text
    assert S.expected_set("cu130-torch2.14-py312", {"flash_attn": {"installed": True}}, tmp_path) == \
        "cu130-torch2.14-py312"  # no flash-attn pin for that cell
    unknown = "cu999-torch9.9-py399"
    assert S.expected_set(unknown, {"flash_attn": {"installed": True}}, tmp_path) == unknown
