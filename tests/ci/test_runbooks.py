"""The seeds' one-shot runner and the runbook script: thin wrappers, checked without a GPU."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_runner_oneshot_runs_nox_oneshot_into_artifacts_runner(tmp_path):
    fake = tmp_path / "nox"
    log = tmp_path / "called"
    fake.write_text(f'#!/usr/bin/env bash\necho "$PWD|$NSA_ARTIFACTS|$*" > {log}\n')
    fake.chmod(0o755)
    env = {**os.environ, "NSA_NOX": str(fake), "NSA_NOX_ARGS": "--no-venv"}
    env.pop("NSA_ARTIFACTS", None)
    res = subprocess.run(["bash", str(ROOT / "scripts" / "runner_oneshot.sh"), "--skip-no-gpu"], cwd=tmp_path, env=env,
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    cwd, out, args = log.read_text().strip().split("|")
    assert Path(cwd) == ROOT and Path(out) == ROOT / "artifacts" / "runner"
    assert args == "--no-venv -s oneshot -- --skip-no-gpu"


def test_runner_oneshot_without_nox_says_how_to_get_it(tmp_path):
    bin_dir = tmp_path / "bin"  # a PATH with dirname and no nox
    bin_dir.mkdir()
    (bin_dir / "dirname").symlink_to(shutil.which("dirname"))
    env = {"PATH": str(bin_dir), "NSA_NOX": str(tmp_path / "none"), "HOME": str(tmp_path)}
    res = subprocess.run([shutil.which("bash"), str(ROOT / "scripts" / "runner_oneshot.sh")], env=env,
                         capture_output=True, text=True)
    assert res.returncode == 2 and "requirements/bootstrap.txt" in res.stderr, res.stderr


def test_runbook_script_runs_the_seed_commands_that_need_no_gpu():
    """Every step of tests/runbooks.sh is a command line of docs/migration.md (as written or its successor)."""
    script = (ROOT / "tests" / "runbooks.sh").read_text()
    page = (ROOT / "docs" / "migration.md").read_text()
    steps = [line.split('" ', 1)[1] for line in script.splitlines() if line.startswith('step "')]
    assert len(steps) >= 12
    for cmd in steps:
        cmd = cmd.strip()[1:-1].replace('\\"', '"')  # the quoted shell word, unescaped
        if cmd.startswith("export NSA_USE_FA2=1") or "NSA_SDPA_AUDIT=1 NSA_SEL" in cmd:
            continue  # the probe heredoc and the retired-toggle check: not one command line
        assert cmd.replace("NSA_DEBUG_LOG=1 NSA_LOG_LIMIT=5 ", "") in page or cmd in page, cmd


JUNIT = """<?xml version="1.0"?><testsuites><testsuite name="{suite}">{cases}</testsuite></testsuites>"""


def _case(cls, name, t, kind=None, msg=""):
    inner = f'<{kind} message="{msg}"/>' if kind else ""
    return f'<testcase classname="tests.gpu.{cls}" name="{name}" time="{t}">{inner}</testcase>'


def test_runbook_report_writes_the_template_lines_one_by_one(tmp_path):
    """bench/runbook_report.py: each line of the test plan's reporting template on its own line, from the
    run's junit files and bench outputs."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("runbook_report", ROOT / "bench" / "runbook_report.py")
    rr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rr)
    (tmp_path / "junit-gpu_parity.xml").write_text(JUNIT.format(suite="gpu_parity", cases="".join([
        _case("test_triton_sel_parity_gpu", "a", 1.5), _case("test_triton_sel_parity_gpu", "b", 2.0),
        _case("test_triton_sel_backward_gpu", "c", 3.0, "failure", "boom"),
        _case("test_fa2_gpu_varlen", "d", 0.0, "skipped", "no flash")])))
    backward = JUNIT.format(suite="backward", cases=_case("test_gradcheck_gpu", "e", 4))
    (tmp_path / "junit-backward.xml").write_text(backward)
    (tmp_path / "bench-fa2").mkdir()
    (tmp_path / "bench-fa2" / "bench_fa2.csv").write_text(
        "provider,branch,T,D,Hq,Hkv,fa2_ms,sdpa_ms,torch_ms,speedup_vs_sdpa,status\n"
        "torch_flash,cmp,1024,128,64,4,0.5,1.0,,2.0,ok\ntorch_flash,cmp,4096,128,64,4,0.6,4.5,,7.5,ok\n"
        "torch_flash,win,4096,128,64,4,0.5,2.2,,4.4,ok\n")
    dec_spec = importlib.util.spec_from_file_location("bench_decode", ROOT / "bench" / "bench_decode.py")
    dec = importlib.util.module_from_spec(dec_spec)
    dec_spec.loader.exec_module(dec)
    # the decode bench's own CSV, tiny, on CPU
    assert dec.main(["--dim", "32", "--heads", "4", "--groups", "2", "--dk", "8", "--dv", "8", "--l", "8", "--d", "4",
                     "--l_sel", "8", "--n_sel", "3", "--w", "16", "--S_list", "20", "--iters", "1", "--warmup", "0",
                     "--csv", str(tmp_path / "bench-decode.csv"), "--device", "cpu"]) == 0
    assert rr.main([str(tmp_path), "--no-bench", "--device", "cpu"]) == 0
    lines = json.loads((tmp_path / "template.json").read_text())["lines"]
    assert lines[0] == "Tests:"
    assert lines[1].startswith("- Triton FWD parity: PASS (3.5 s; 2 passed")
    assert lines[2].startswith("- Triton BWD parity: FAIL (3.0 s")
    assert lines[3] == "- FA-2 varlen: SKIPPED (no flash)"
    assert lines[4].startswith("- Grad/Train smokes: PASS (4.0 s")
    assert lines[6] == "Benches:" and lines[7].startswith("- Decode bench: S=20: step ")
    assert lines[8] == "- Triton selection bench: NOT RUN (--no-bench)"
    assert lines[9] == ("- FA-2 bench: torch_flash cmp: x7.50 over SDPA at T=4096, D=128 (0.6 ms vs 4.5 ms); "
                        "torch_flash win: x4.40 over SDPA at T=4096, D=128 (0.5 ms vs 2.2 ms)")
    assert lines[10].startswith("- Ranges sample: t=1023, l'=64: KV head 0: blocks [0, ")
    assert lines[11] == "- Training showcase: NOT RUN (--no-bench)"
    assert (tmp_path / "decode-summary.md").read_text().count("|") > 10


def test_runbook_report_showcase_line_from_the_showcase_json(tmp_path):
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("runbook_report", ROOT / "bench" / "runbook_report.py")
    rr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rr)
    run = {"loss_first": 5.5, "loss_last": 2.25}
    (tmp_path / "train_showcase.json").write_text(json.dumps({
        "corpus": {"corpus": "pydoc"}, "nsa_over_dense_tok_s": {"fa2": {"2048": 0.5}, "cudnn": {"2048": 0.25}},
        "runs": [dict(run, attention="dense", label="dense/fa2", seq_len=2048, tok_s=2000.0),
                 dict(run, attention="dense", label="dense/cudnn", seq_len=2048, tok_s=4000.0),
                 dict(run, attention="nsa", label="nsa", seq_len=2048, tok_s=1000.0)]}))
    assert rr.showcase_summary(tmp_path) == (
        "nsa S=2048: 1000 tok/s, loss 5.50 -> 2.25; dense/fa2 S=2048: 2000 tok/s, loss 5.50 -> 2.25; "
        "dense/cudnn S=2048: 4000 tok/s, loss 5.50 -> 2.25; NSA over dense S=2048 vs fa2: x0.50, "
        "S=2048 vs cudnn: x0.25 (pydoc)")
