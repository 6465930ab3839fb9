"""ci/evidence/artifacts.py: the run directory, JUnit parsing, suite status, summary rendering, known_good.json."""

from __future__ import annotations

import json
import sys

from ci.evidence import artifacts as A

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="gpu_parity" tests="4">
<testcase classname="t.a" name="ok1" time="0.1"/><testcase classname="t.a" name="ok2" time="0.1"/>
<testcase classname="t.a" name="skip"><skipped message="needs flash_attn"/></testcase>
<testcase classname="t.b" name="bad"><failure message="boom">trace</failure></testcase>
</testsuite></testsuites>"""

ENV = {"host": "gpuhost", "gpus": [{"name": "NVIDIA H200", "sm": "9.0"}], "driver": {"version": "580.65"},
       "python": {"version": "3.12.3"}, "torch": {"version": "2.11.0+cu130", "cuda": "13.0"},
       "triton": {"version": "3.6.0"}, "flash_attn": {"version": None}, "cell": "cu130-torch2.11-py312"}


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
    # every test skipped, no tests at all, or an expected file missing: never a PASS
    assert A.suite_status(0, dict(ok, passed=0))[0] == A.FAIL
    assert A.suite_status(5, {"tests": 0})[0] == A.FAIL
    status, notes = A.suite_status(0, ok, missing=["tests/gpu/test_fa2_parity.py"])
    assert status == A.FAIL and "test_fa2_parity.py" in notes[0]
    assert A.parse_junit(tmp_path / "absent.xml")["missing"]


def test_collect_env_records_failure(tmp_path):
    # An interpreter whose `-m nsa.env` fails: env.json holds the failure instead of the report.
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


def _run(tmp_path, suites):
    run = A.RunDir.create(tmp_path / "artifacts", "abc1234", "cu130-torch2.11-py312", ENV["gpus"], dirty=False)
    run.set_env(ENV)
    run.set_lock("cu130-torch2.11-py312", {"missing": [], "extra": [{"name": "x"}], "wrong_version": [],
                                           "matching": 40, "drift": True})
    (run.path / "junit-gpu_parity.xml").write_text(JUNIT)
    (run.path / "logs" / "gpu_parity.log").write_text("log\n")
    for name, status in suites.items():
        run.record_suite(name, status=status, runtime_s=12.5,
                         counts={"passed": 9, "failed": 0 if status == A.PASS else 1, "skipped": 2,
                                 "skip_reasons": ["needs flash_attn"]}, notes=[])
    run.record_bench("decode", status=A.PASS, runtime_s=30.0, summary=["S=4096 step 0.21 ms"])
    run.state["gate"] = {"status": "PASS", "class": "h200", "allowance": 0.15, "lines": ["prefill_fwd_ms: ok"],
                         "rows": [{"figure": "prefill_fwd_ms", "value": 1.23456}]}
    run.finalize()
    return run


def test_run_dir_layout_and_summary(tmp_path, monkeypatch):
    monkeypatch.setenv("NSA_IMAGE_DIGEST", "sha256:feed")
    run = _run(tmp_path, {"gpu_parity": A.PASS, "backward": A.PASS, "bench": A.PASS})
    assert run.path == tmp_path / "artifacts" / "abc1234" / "cu130-torch2.11-py312" / "nvidia-h200"
    for f in ("summary.md", "known_good.json", "README.md", "state.json"):
        assert (run.path / f).exists()
    s = (run.path / "summary.md").read_text()
    # The seeds' reporting template, filled in.
    assert "GPU Host: gpuhost / NVIDIA H200 / Driver 580.65" in s
    assert "Commit: abc1234" in s
    assert "Torch/Triton/CUDA: torch 2.11.0+cu130, triton 3.6.0, cuda 13.0" in s
    assert "GPU parity" in s and ": PASS (12.5 s; 9 passed, 0 failed, 2 skipped)" in s
    assert "skipped: needs flash_attn" in s
    assert "- decode bench: PASS" in s and "S=4096 step 0.21 ms" in s
    assert "Bench gate (h200, allowance 15%): PASS" in s
    assert "## Artifacts" in s and "- junit-gpu_parity.xml" in s and "- logs/gpu_parity.log" in s
    assert "Verdict: known-good" in s
    idx = (run.path / "README.md").read_text()
    assert "| junit-gpu_parity.xml | JUnit XML of the gpu_parity suite |" in idx and "summary.md" in idx
    kg = json.loads((run.path / "known_good.json").read_text())
    assert kg["status"] == "known-good" and kg["cell"] == "cu130-torch2.11-py312" and kg["gpu"] == "NVIDIA H200"
    assert kg["driver"] == "580.65" and kg["commit"] == "abc1234" and kg["image_digest"] == "sha256:feed"
    assert kg["lock"]["path"] == "requirements/locks/cu130-torch2.11-py312.txt" and len(kg["lock"]["sha256"]) == 64
    assert kg["lock_check"]["extra"] == 1 and kg["headline"] == {"prefill_fwd_ms": 1.2346}
    assert kg["suites"]["gpu_parity"]["status"] == "PASS" and kg["versions"]["torch"] == "2.11.0+cu130"
    assert kg["date"] and kg["artifacts"].endswith("abc1234/cu130-torch2.11-py312/nvidia-h200")


def test_state_accumulates_across_sessions(tmp_path):
    _run(tmp_path, {"gpu_parity": A.PASS})
    run = A.RunDir.create(tmp_path / "artifacts", "abc1234", "cu130-torch2.11-py312", ENV["gpus"])
    assert "gpu_parity" in run.state["suites"]  # a later session (backward) keeps the earlier one's record
    run.finalize()
    kg = json.loads((run.path / "known_good.json").read_text())
    assert kg["status"] == "incomplete" and "backward" in kg["reason"]


def test_failing_suite_is_not_known_good(tmp_path):
    run = _run(tmp_path, {"gpu_parity": A.PASS, "backward": A.FAIL})
    kg = json.loads((run.path / "known_good.json").read_text())
    assert kg["status"] == "failing" and "backward" in kg["reason"]
    assert "Verdict: failing" in (run.path / "summary.md").read_text()
