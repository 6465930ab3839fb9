"""The GPU sessions' logic (ci/sessions/gpu.py) and the per-GPU xdist pinning, without a GPU and without nox."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ci.evidence import artifacts as A
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


def test_session_writes_the_artifact_tree(tmp_path, monkeypatch):
    """With a (faked) GPU, a session writes env.json, its suite record, summary.md and known_good.json."""
    def fake_gpu(python, env=None):
        return {"count": 2, "torch": "x", "cuda": "13.0", "names": ["NVIDIA H200", "NVIDIA H200"]}

    def fake_parity(ctx):
        assert ctx.gpus == 2
        ctx.run.record_suite("gpu_parity", status=A.PASS, runtime_s=1.0, counts={"passed": 3})
        return True

    monkeypatch.setitem(S.RUNNERS, "gpu_parity", fake_parity)
    monkeypatch.setenv("NSA_COMMIT", "deadbee")
    monkeypatch.setenv("NSA_CELL", "cu130-torch2.11-py312")
    out = S.main("gpu_parity", sys.executable, ["--out", str(tmp_path)], env=dict(os.environ), probe=fake_gpu,
                 log=lambda *a: None)
    assert out.status == "pass", out.message
    run = tmp_path / "deadbee" / "cu130-torch2.11-py312" / "2x-nvidia-h200"
    assert out.run_dir == run
    env = json.loads((run / "env.json").read_text())
    assert env["schema"] == "nsa-env/1"  # the real report of this interpreter
    assert (run / "lock-check.json").exists() and (run / "README.md").exists()
    kg = json.loads((run / "known_good.json").read_text())
    assert kg["status"] == "incomplete" and kg["suites"]["gpu_parity"]["status"] == "PASS"
    assert kg["gpu_count"] == 2 and kg["lock"]["sha256"]
    assert "GPU parity" in (run / "summary.md").read_text()


def test_suite_files_partition():
    parity, _ = S.suite_files("gpu_parity")
    backward, _ = S.suite_files("backward")
    assert "tests/gpu/test_decode_gpu.py" in parity and "tests/gpu/test_gradcheck_gpu.py" in backward
    assert not set(parity) & set(backward)


def test_known_flags():
    help_text = "usage: [--S_list S_LIST] [--iters N] [--csv CSV]"
    assert S.known_flags(["--S_list", "1,2", "--full", "--iters", "3", "--nope", "v"], help_text) == \
        ["--S_list", "1,2", "--iters", "3"]


def test_pin_worker():
    env = {"PYTEST_XDIST_WORKER": "gw3", "NSA_GPU_LIST": "0,1"}
    assert gpu_split.pin_worker(env) == "1" and env["CUDA_VISIBLE_DEVICES"] == "1"
    assert gpu_split.pin_worker(env) == "1"  # idempotent
    assert gpu_split.pin_worker({"NSA_GPU_LIST": "0,1"}) is None  # not a worker
    assert gpu_split.pin_worker({"PYTEST_XDIST_WORKER": "gw0", "NSA_GPU_LIST": ""}) is None  # no GPU


def test_xdist_one_worker_per_gpu_each_pinned(tmp_path):
    """`-n auto` with the plugin starts one worker per visible GPU, and each sees only its own GPU."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_pin.py").write_text(
        "import os, pytest\n"
        "@pytest.mark.parametrize('i', range(8))\n"
        "def test_where(i):\n"
        "    with open(os.path.join(os.path.dirname(__file__), os.environ['PYTEST_XDIST_WORKER']), 'w') as f:\n"
        "        f.write(os.environ['CUDA_VISIBLE_DEVICES'])\n")
    # A fresh controller: none of this (possibly xdist-worker) process's pinning variables.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST", "NSA_GPU_"))}
    env.update(PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="5,7")
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "ci.sessions.gpu_split", "-n", "auto", "-p",
                        "no:cacheprovider", str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    seen = {f.name: f.read_text() for f in tmp_path.glob("gw*")}
    assert seen == {"gw0": "5", "gw1": "7"}, (seen, p.stdout)


def test_the_lock_check_expects_the_flash_attn_pin_where_flash_attn_is_installed(tmp_path):
    cell = "cu130-torch2.12-py312"
    assert S.expected_set(cell, {"flash_attn": {"installed": False}}, tmp_path) == cell
    name = S.expected_set(cell, {"flash_attn": {"installed": True}}, tmp_path)
    assert name == f"{cell}.expected.txt"  # starts with the cell: nsa.env reads the build variant from it
    text = (tmp_path / name).read_text()
    assert "torch==2.12.1" in text and "flash-attn==2.8.3.post2" in text
    assert S.expected_set("cu130-torch2.14-py312", {"flash_attn": {"installed": True}}, tmp_path) == \
        "cu130-torch2.14-py312"  # no flash-attn pin for that cell
    unknown = "cu999-torch9.9-py399"
    assert S.expected_set(unknown, {"flash_attn": {"installed": True}}, tmp_path) == unknown
