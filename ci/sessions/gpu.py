"""The GPU sessions' logic: gpu_parity, backward, bench, oneshot (docs/gpu-suites.md).

The nox sessions are thin wrappers around `main()`; without nox the same runs as
    python -m ci.sessions.gpu gpu_parity backward bench [--skip-no-gpu] [--full] [-- PYTEST_ARGS]

Options (nox: after `--`): --skip-no-gpu (or NSA_SKIP_NO_GPU=1): on a machine with no GPU, skip instead
of failing; --full: the long bench sweeps; --out DIR: artifact base (default artifacts/, or NSA_ARTIFACTS);
-n N|auto: pytest-xdist workers (default: one per visible GPU when there are several); anything else goes
to pytest. Every step's output lands in artifacts/<commit>/<cell>/<gpu-slug>/ (ci/evidence/artifacts.py), and
summary.md / known_good.json are re-rendered after each session.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ci.evidence import artifacts as A
from ci.sessions.install import install_cell

ROOT = A.ROOT
SESSIONS = ("gpu_parity", "backward", "bench", "oneshot")

# Test files per suite. `expected`: a suite FAILS when one is missing (the acceptance names them);
# every other tests/gpu/test_*.py goes to gpu_parity unless it matches a backward pattern.
BACKWARD_PATTERNS = ("test_backward", "test_gradcheck", "test_train")
EXPECTED = {
    "gpu_parity": ["tests/gpu/test_fa2_parity.py", "tests/gpu/test_decode_gpu.py"],
    "backward": ["tests/gpu/test_backward_varlen.py", "tests/gpu/test_gradcheck_gpu.py"],
}
SUITE_ENV = {
    # The seeds' opt-in toggles: GPU tests that gate themselves on these run.
    "gpu_parity": {"NSA_TEST_FA2": "1", "NSA_TEST_GPU": "1", "NSA_DEBUG_LOG": "1", "NSA_LOG_LIMIT": "5"},
    "backward": {"NSA_TEST_FA2": "1", "NSA_TEST_GPU": "1", "NSA_TEST_TRAIN": "1"},
}


class NoGPU(RuntimeError):
    pass


@dataclass
class Options:
    skip_no_gpu: bool = False
    full: bool = False
    out: Path = field(default_factory=lambda: Path(os.environ.get("NSA_ARTIFACTS", str(ROOT / "artifacts"))))
    workers: str | None = None
    pytest_args: list[str] = field(default_factory=list)


def parse_args(argv: list[str], environ=os.environ) -> Options:
    """The session options; every other argument goes to pytest."""
    ap = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    ap.add_argument("--skip-no-gpu", action="store_true")
    ap.add_argument("--full", action="store_true")
    ap.add_argument("--out", type=Path)
    ap.add_argument("-n", "--numprocesses", dest="workers")
    known, rest = ap.parse_known_args([a for a in argv if a != "--"])
    skip = known.skip_no_gpu or environ.get("NSA_SKIP_NO_GPU", "") not in ("", "0")
    return Options(skip, known.full, known.out or Options().out, known.workers, rest)


# --- the GPU check -------------------------------------------------------------------------------------

GPU_PROBE = ("import json, torch; ok = torch.cuda.is_available(); print(json.dumps({'torch': torch.__version__, "
             "'cuda': torch.version.cuda, 'count': torch.cuda.device_count() if ok else 0, "
             "'names': [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if ok else []}))")


def host_has_gpu_driver() -> bool:
    """Cheap pre-check (before installing anything): an NVIDIA driver on this host."""
    return bool(shutil.which("nvidia-smi")) or Path("/dev/nvidiactl").exists() or Path("/proc/driver/nvidia").exists()


def probe_gpus(python: str, env: dict | None = None) -> dict:
    try:
        p = subprocess.run([python, "-c", GPU_PROBE], capture_output=True, text=True, env=env, timeout=300)
    except (OSError, subprocess.SubprocessError) as e:
        return {"count": 0, "error": str(e)}
    if p.returncode != 0:
        return {"count": 0, "error": (p.stderr.strip().splitlines() or ["torch failed to import"])[-1]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def no_gpu_message(session: str, why: str) -> str:
    return (f"{session}: no CUDA GPU ({why}). The GPU suites fail on a machine without a GPU; pass "
            f"--skip-no-gpu (nox -s {session} -- --skip-no-gpu) or set NSA_SKIP_NO_GPU=1 to skip them instead")


def require_gpu(session: str, python: str, opts: Options, env: dict | None = None, probe=probe_gpus) -> dict | None:
    """The probe's dict when torch sees a GPU; None when there is none and skipping was asked; else NoGPU."""
    info = probe(python, env)
    if info.get("count", 0) > 0:
        return info
    why = info.get("error") or f"torch {info.get('torch')} (CUDA {info.get('cuda')}) sees no GPU"
    if opts.skip_no_gpu:
        return None
    raise NoGPU(no_gpu_message(session, why))


# --- context -------------------------------------------------------------------------------------------


@dataclass
class Ctx:
    python: str
    opts: Options
    env: dict
    run: A.RunDir
    gpus: int
    log: callable = print

    def child_env(self, extra: dict | None = None) -> dict:
        env = dict(self.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
        env.update(extra or {})
        return env


def make_context(python: str, opts: Options, env: dict, gpu_info: dict, log=print) -> Ctx:
    base = opts.out if opts.out.is_absolute() else ROOT / opts.out
    commit, dirty = A.git_commit()
    tmp = base / ".env-probe.json"
    base.mkdir(parents=True, exist_ok=True)
    report = A.collect_env(python, tmp, env=env)
    cell = env.get("NSA_CELL") or report.get("cell") or "unknown"
    gpus = report.get("gpus") or [{"name": n} for n in gpu_info.get("names", [])]
    run = A.RunDir.create(base, commit, cell, gpus, dirty)
    shutil.move(str(tmp), run.path / "env.json")
    run.set_env(report)
    if not report.get("gpus") and gpu_info.get("names"):
        run.state["env"].update(gpus=gpu_info["names"], gpu=gpu_info["names"][0], gpu_count=len(gpu_info["names"]))
    check = None
    try:
        expected = expected_set(cell, report, run.path)
        # A file of the set is named after the cell and given relative to its folder: nsa.env reads the build
        # variant (cu130) from the name's start, so that a +cu130 torch is not counted as drift.
        cwd = run.path if expected != cell else ROOT
        child = {**env, "PYTHONPATH": os.pathsep.join(x for x in (str(ROOT), env.get("PYTHONPATH", "")) if x)}
        p = subprocess.run([python, "-m", "nsa.env", "--check-lock", expected, "--json"], cwd=cwd, env=child,
                           capture_output=True, text=True, timeout=300)
        check = json.loads(p.stdout) if p.stdout.strip().startswith("{") else {"error": p.stderr.strip()[-500:]}
    except (OSError, subprocess.SubprocessError, json.JSONDecodeError) as e:
        check = {"error": str(e)}
    (run.path / "lock-check.json").write_text(json.dumps(check, indent=2) + "\n")
    run.set_lock(cell, check)
    if shutil.which("nvidia-smi"):
        p = subprocess.run(["nvidia-smi"], capture_output=True, text=True)
        (run.path / "nvidia-smi.txt").write_text(p.stdout + p.stderr)
    run.save()
    log(f"artifacts: {run.path}")
    return Ctx(python=python, opts=opts, env=env, run=run, gpus=max(1, int(gpu_info.get("count", 1))), log=log)


def expected_set(cell: str, report: dict, run_dir: Path) -> str:
    """What --check-lock compares the environment with: the cell's lock, plus its flash-attn pin where
    flash-attn is installed (the file run_dir/<cell>.expected.txt, returned by name); the cell id otherwise."""
    from ci.locks import flash_lock_path, lock_path
    from ci.matrix import MatrixError, load

    try:
        matrix = load()
        pin = flash_lock_path(matrix, cell)
        if not (report.get("flash_attn") or {}).get("installed") or not pin.exists():
            return cell
        out = run_dir / f"{cell}.expected.txt"
        out.write_text(lock_path(matrix, cell).read_text() + pin.read_text())
        return out.name
    except (MatrixError, OSError):  # an unknown cell or a missing lock: --check-lock reports it
        return cell


# --- suites --------------------------------------------------------------------------------------------


def suite_files(suite: str) -> tuple[list[str], list[str]]:
    """(files to run, expected files that are missing)."""
    gpu_dir = ROOT / "tests" / "gpu"
    found = sorted(str(p.relative_to(ROOT)) for p in gpu_dir.glob("test_*.py"))

    def is_backward(f):
        return Path(f).name.startswith(BACKWARD_PATTERNS)

    files = [f for f in found if is_backward(f) == (suite == "backward")]
    missing = [f for f in EXPECTED.get(suite, []) if not (ROOT / f).exists()]
    return files, missing


def pytest_suite(ctx: Ctx, suite: str, files: list[str], missing: list[str]) -> bool:
    run = ctx.run
    junit = run.path / f"junit-{suite}.xml"
    cmd = [ctx.python, "-m", "pytest", *files, f"--junitxml={junit}", "-o", f"junit_suite_name={suite}",
           "-o", "junit_logging=all", "-p", "ci.sessions.gpu_split", "-rfEs", "-q"]
    workers = ctx.opts.workers or (str(ctx.gpus) if ctx.gpus > 1 else None)
    if workers and workers != "0":
        cmd += ["-n", workers, "--dist", "loadfile"]
    cmd += ctx.opts.pytest_args
    if not files:
        res = A.Result(5, 0.0, [], run.path / "logs" / f"{suite}.log")
        res.log.write_text("no test files found under tests/gpu for this suite\n")
    else:
        res = A.run_logged(cmd, run.path / "logs" / f"{suite}.log", env=ctx.child_env(SUITE_ENV.get(suite)))
    counts = A.parse_junit(junit)
    status, notes = A.suite_status(res.returncode, counts, missing)
    run.record_suite(suite, status=status, runtime_s=round(res.seconds, 2), counts=counts, notes=notes,
                     junit=run.rel(junit) if junit.exists() else None, log=run.rel(res.log), command=" ".join(cmd),
                     files=files)
    ctx.log(f"{suite}: {status} in {res.seconds:.1f} s ({counts.get('passed', 0)} passed, "
            f"{counts.get('failed', 0) + counts.get('errors', 0)} failed, {counts.get('skipped', 0)} skipped)"
            + ("; " + "; ".join(notes) if notes else ""))
    return status == A.PASS


def routing_step(ctx: Ctx) -> bool:
    """The seeds' 'one run with NSA_DEBUG_LOG=1 NSA_LOG_LIMIT=5': routing log + telemetry counters + sanity."""
    res = A.run_logged([ctx.python, "-m", "ci.sessions.routing_probe", "--device", "cuda", "--out",
                        str(ctx.run.path / "telemetry.json")], ctx.run.path / "logs" / "routing.log",
                       env=ctx.child_env({"NSA_DEBUG_LOG": "1", "NSA_LOG_LIMIT": "5"}))
    ok = res.returncode == 0
    ctx.run.record_step("routing+sanity", A.PASS if ok else A.FAIL, res.seconds, ctx.run.rel(res.log),
                        "" if ok else (res.tail[-1] if res.tail else f"exit {res.returncode}"))
    return ok


def run_gpu_parity(ctx: Ctx) -> bool:
    routing_ok = routing_step(ctx)
    files, missing = suite_files("gpu_parity")
    ok = pytest_suite(ctx, "gpu_parity", files, missing)
    return ok and routing_ok


def run_backward(ctx: Ctx) -> bool:
    files, missing = suite_files("backward")
    t0 = time.perf_counter()
    ok = pytest_suite(ctx, "backward", files, missing)
    # Training smoke of the tiny model (nsa.smoke: loss must fall, generate == uncached, routing visible).
    smoke_ok = True
    for dtype in ("float32", "bfloat16"):
        out = ctx.run.path / f"smoke-{dtype}"
        res = A.run_logged([ctx.python, "-m", "nsa.smoke", "--device", "cuda", "--dtype", dtype, "--out", str(out)],
                           ctx.run.path / "logs" / f"train-smoke-{dtype}.log", env=ctx.child_env())
        good = res.returncode == 0
        smoke_ok &= good
        ctx.run.record_step(f"train smoke ({dtype})", A.PASS if good else A.FAIL, res.seconds, ctx.run.rel(res.log),
                            "nsa.smoke: loss falls, generate matches uncached" if good else f"exit {res.returncode}")
    s = ctx.run.state["suites"]["backward"]
    s["runtime_s"] = round(time.perf_counter() - t0, 2)
    if not smoke_ok:
        s["status"] = A.FAIL
        s.setdefault("notes", []).append("training smoke (python -m nsa.smoke --device cuda) failed")
    return ok and smoke_ok


# --- benches -------------------------------------------------------------------------------------------

BENCHES = {
    # name: (script, quick args, full args). Quick: about a minute each on an H100; full: the long sweeps.
    # Options a bench's --help does not list are dropped (with their values); --csv / --out / --device are
    # added when listed, pointing into the run directory.
    "prefill": ("bench/bench_prefill.py",
                ["--T_list", "1024,4096", "--iters", "3", "--warmup", "1", "--backend", "auto"],
                ["--T_list", "1024,2048,4096,8192,16384,32768", "--iters", "5", "--warmup", "1", "--backend", "auto"]),
    "decode": ("bench/bench_decode.py",
               ["--S_list", "1024,4096", "--iters", "32", "--warmup", "4"],
               ["--B", "1", "--dim", "256", "--heads", "8", "--groups", "2", "--dk", "32", "--dv", "32", "--l", "32",
                "--d", "16", "--l_sel", "64", "--n_sel", "16", "--w", "512",
                "--S_list", "512,1024,2048,4096,16384,65536", "--iters", "64", "--warmup", "8",
                "--branch_force_mode", "env"]),
    "fa2": ("bench/bench_fa2.py",
            ["--T", "1024,4096,16384", "--D", "128", "--iters", "3", "--max-seconds", "60"],
            ["--max-seconds", "400"]),
}


def _bench_flags(python: str, script: Path, env: dict) -> str:
    try:
        p = subprocess.run([python, str(script), "--help"], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=300)
        return p.stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def known_flags(args: list[str], help_text: str) -> list[str]:
    """args without the options (and their values) that the bench's --help does not mention."""
    out, i = [], 0
    while i < len(args):
        a = args[i]
        takes_value = i + 1 < len(args) and not args[i + 1].startswith("--")
        if a.startswith("--") and a.split("=")[0] not in help_text:
            i += 2 if takes_value else 1
            continue
        out.append(a)
        if takes_value:
            out.append(args[i + 1])
        i += 2 if takes_value else 1
    return out


TABLE_RULE_CHARS = "└┌├┏┡┗━─┃"


def _summary_lines(tail: list[str]) -> list[str]:
    """Headline lines of a bench's output: its `summary:` lines, else its last informative lines (no table
    rules, no "wrote FILE" lines), with this checkout's path removed so summaries can be committed."""
    marked = [ln.split("summary:", 1)[1].strip() for ln in tail if ln.lstrip().startswith("summary:")]
    if not marked:
        marked = [ln.strip() for ln in tail
                  if ln.strip() and not ln.startswith("[exit") and not ln.lstrip().startswith("wrote ")
                  and ln.strip()[0] not in TABLE_RULE_CHARS][-3:]
    return [ln.replace(f"{ROOT}/", "") for ln in marked[:12]]


def run_bench(ctx: Ctx) -> bool:
    run = ctx.run
    t0 = time.perf_counter()
    ok = True
    for name, (script, quick, full) in BENCHES.items():
        path = ROOT / script
        if not path.exists():
            run.record_bench(name, status="MISSING", runtime_s=0, note=f"{script} not found", summary=[])
            ctx.log(f"bench {name}: {script} not found")
            ok = False
            continue
        flags = _bench_flags(ctx.python, path, ctx.child_env())
        clean = known_flags(list(full if ctx.opts.full else quick), flags)
        csv = run.path / f"bench-{name}.csv"
        cmd = [ctx.python, script, *clean]
        if "--csv" in flags:
            cmd += ["--csv", str(csv)]
        elif "--out" in flags:
            cmd += ["--out", str(run.path / f"bench-{name}")]
        if "--device" in flags:
            cmd += ["--device", "cuda"]
        res = A.run_logged(cmd, run.path / "logs" / f"bench-{name}.log", env=ctx.child_env())
        good = res.returncode == 0
        ok &= good
        outputs = [run.rel(p) for p in sorted(run.path.glob(f"bench-{name}*")) if p.is_file()]
        outputs += [run.rel(p) for p in sorted((run.path / f"bench-{name}").rglob("*")) if p.is_file()]
        run.record_bench(name, status=A.PASS if good else A.FAIL, runtime_s=round(res.seconds, 2),
                         log=run.rel(res.log), outputs=outputs, command=" ".join(cmd),
                         summary=_summary_lines(res.tail), note="" if good else f"exit {res.returncode}")
    gate_ok = bench_gate(ctx)
    notes = [f"{n}: {b['status']}" for n, b in run.state["benches"].items() if b["status"] != A.PASS]
    gate = run.state.get("gate") or {}
    if gate.get("status") == "NO-BASELINE":
        notes.append(f"no stored baseline for {gate.get('class')}: figures recorded, not compared "
                     "(python -m ci.evidence.bench_gate promote ... to store them)")
    status = A.PASS if ok and gate_ok else A.FAIL
    run.record_suite("bench", status=status, runtime_s=round(time.perf_counter() - t0, 2), notes=notes)
    ctx.log(f"bench: {status}" + ("; " + "; ".join(notes) if notes else ""))
    return status == A.PASS


def bench_gate(ctx: Ctx) -> bool:
    run = ctx.run
    head = run.path / "bench-headline.json"
    cmd = [ctx.python, "-m", "ci.evidence.bench_headline", "--device", "cuda", "--out", str(head)]
    if ctx.opts.full:
        cmd.append("--full")
    res = A.run_logged(cmd, run.path / "logs" / "bench-headline.log", env=ctx.child_env())
    if res.returncode != 0 or not head.exists():
        run.state["gate"] = {"status": A.FAIL, "class": None,
                             "lines": [f"headline bench failed (exit {res.returncode})"]}
        return False
    from ci.evidence import bench_gate as G

    headline = json.loads(head.read_text())
    cls = G.gpu_class(headline.get("gpu"))
    if ctx.opts.full:
        cls += "-full"
    result = G.compare(headline["figures"], G.load_baselines(), cls)
    result["slowdown"] = headline.get("slowdown", 1.0)
    result["lines"] = G.describe(result)
    (run.path / "gate.json").write_text(json.dumps(result, indent=2) + "\n")
    run.state["gate"] = result
    for line in result["lines"]:
        ctx.log(f"gate: {line}")
    return result["status"] != G.FAIL


# --- oneshot -------------------------------------------------------------------------------------------


def run_oneshot(ctx: Ctx) -> bool:
    """The seeds' runbook in order: environment, routing, sanity, tests, benches, report. Every step runs;
    the result fails when any step failed (the seeds' runner ignored failures)."""
    run = ctx.run
    env_ok = not (run.state.get("env") or {}).get("env_error")
    run.record_step("environment", A.PASS if env_ok else A.FAIL, 0.0, "env.json",
                    "env.json, lock-check.json, nvidia-smi.txt")
    ok = env_ok
    ok &= run_gpu_parity(ctx)  # routing + sanity probe, then the parity tests
    ok &= run_backward(ctx)
    ok &= run_bench(ctx)
    run.record_step("report", A.PASS, 0.0, "summary.md", "summary.md, known_good.json, README.md")
    return ok


RUNNERS = {"gpu_parity": run_gpu_parity, "backward": run_backward, "bench": run_bench, "oneshot": run_oneshot}


@dataclass
class Outcome:
    status: str  # "pass" | "fail" | "skip"
    message: str
    run_dir: Path | None = None


def main(session: str, python: str, argv: list[str], env: dict | None = None, log=print, probe=probe_gpus) -> Outcome:
    """Run one GPU session's logic in `python` (the session's interpreter). Never raises for a failed suite."""
    env = dict(os.environ if env is None else env)
    opts = parse_args(argv, env)
    try:
        info = require_gpu(session, python, opts, env, probe=probe)
    except NoGPU as e:
        return Outcome("fail", str(e))
    if info is None:
        return Outcome("skip", f"{session}: skipped: no CUDA GPU on this machine (--skip-no-gpu / NSA_SKIP_NO_GPU=1)")
    ctx = make_context(python, opts, env, info, log=log)
    try:
        ok = RUNNERS[session](ctx)
    finally:
        ctx.run.finalize()
    kg = json.loads((ctx.run.path / "known_good.json").read_text())
    msg = f"{session}: {'PASS' if ok else 'FAIL'}; {ctx.run.path / 'summary.md'} (run: {kg['status']}, {kg['reason']})"
    return Outcome("pass" if ok else "fail", msg, ctx.run.path)


def nox_entry(session, name: str) -> None:
    """Called by the nox sessions: install the cell (unless --no-venv), run, pass/fail/skip."""
    import nox

    opts = parse_args(list(session.posargs))
    if not host_has_gpu_driver():
        msg = no_gpu_message(name, "no NVIDIA driver on this host: no nvidia-smi, no /dev/nvidiactl")
        if opts.skip_no_gpu:
            session.skip(f"{name}: skipped: no CUDA GPU on this machine (--skip-no-gpu / NSA_SKIP_NO_GPU=1)")
        session.error(msg)
    passthrough = isinstance(session.virtualenv, nox.virtualenv.PassthroughEnv)
    if passthrough:
        python = sys.executable
    else:
        install_cell(session, flash_attn=True)
        python = str(Path(session.virtualenv.bin) / "python")
    env = dict(os.environ)
    for key, value in (session.env or {}).items():  # nox marks variables to unset with None
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    if not passthrough:
        env["PATH"] = os.pathsep.join([session.virtualenv.bin, env.get("PATH", "")])
        env["VIRTUAL_ENV"] = session.virtualenv.location
    out = main(name, python, list(session.posargs), env=env, log=session.log)
    if out.status == "skip":
        session.skip(out.message)
    if out.status == "fail":
        session.error(out.message)
    session.log(out.message)


def cli(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    names = []
    while argv and argv[0] in SESSIONS:
        names.append(argv.pop(0))
    if not names:
        print(f"usage: python -m ci.sessions.gpu {{{','.join(SESSIONS)}}} ... [--skip-no-gpu] [--full] [-- ARGS]")
        return 2
    rc = 0
    for name in names:
        out = main(name, sys.executable, list(argv))
        print(out.message)
        rc = max(rc, 1 if out.status == "fail" else 0)
    return rc


if __name__ == "__main__":
    sys.exit(cli())
