"""The GPU sessions' logic: gpu_parity, backward, bench, oneshot (options: docs/gpu-suites.md); nox wraps `main()`,
without nox: `python -m ci.sessions.gpu gpu_parity backward bench [-- ARGS]`. Output: artifacts/<commit>/<cell>/
<gpu-slug>/ (ci/evidence/artifacts.py); the sessions of one invocation are one run (NSA_RUN_ID, set once)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from ci.evidence import artifacts as A
from ci.sessions.install import install_cell
from ci.sessions.overlay import MARKER as OVERLAY_MARKER

ROOT = A.ROOT
SESSIONS = ("gpu_parity", "backward", "bench", "oneshot")

# Test files per suite. `expected`: a suite FAILS when one is missing (the acceptance names them);
# every other tests/gpu/test_*.py goes to gpu_parity unless it matches a backward pattern.
BACKWARD_PATTERNS = ("test_backward", "test_gradcheck", "test_train")
EXPECTED = {"gpu_parity": ["tests/gpu/test_fa2_parity.py", "tests/gpu/test_decode_gpu.py"],
    "backward": ["tests/gpu/test_backward_varlen.py", "tests/gpu/test_gradcheck_gpu.py"],
}
# Seconds per suite (a deadline for all of its commands) and per test; --full sweeps take longer.
SUITE_TIMEOUT_S = {"gpu_parity": 2400, "backward": 2400, "bench": 2400}
FULL_BENCH_TIMEOUT_S, TEST_TIMEOUT_S = 4 * 3600, 900
# Workers share a GPU: growable segments keep each worker's cache from fragmenting the shared memory.
_SHARED_GPU = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
SUITE_ENV = {
    # The seeds' opt-in toggles: GPU tests that gate themselves on these run.
    "gpu_parity": {"NSA_TEST_FA2": "1", "NSA_TEST_GPU": "1", "NSA_DEBUG_LOG": "1", "NSA_LOG_LIMIT": "5", **_SHARED_GPU},
    "backward": {"NSA_TEST_FA2": "1", "NSA_TEST_GPU": "1", "NSA_TEST_TRAIN": "1", **_SHARED_GPU},
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
    suite_timeout: float | None = None
    test_timeout: float | None = None


def parse_args(argv: list[str], environ=os.environ) -> Options:
    """The session options; every other argument goes to pytest."""
    ap = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    ap.add_argument("--skip-no-gpu", action="store_true")
    ap.add_argument("--full", action="store_true")
    ap.add_argument("--out", type=Path)
    ap.add_argument("-n", "--numprocesses", dest="workers")
    ap.add_argument("--suite-timeout", type=float)
    ap.add_argument("--test-timeout", type=float, default=float(environ.get("NSA_TEST_TIMEOUT") or TEST_TIMEOUT_S))
    known, rest = ap.parse_known_args([a for a in argv if a != "--"])
    skip = known.skip_no_gpu or environ.get("NSA_SKIP_NO_GPU", "") not in ("", "0")
    return Options(skip, known.full, known.out or Options().out, known.workers, rest, known.suite_timeout,
                   known.test_timeout)


def suite_timeout(suite: str, opts: Options, environ) -> float:
    """--suite-timeout, else NSA_SUITE_TIMEOUT_<SUITE>, else the suite's default."""
    env = environ.get(f"NSA_SUITE_TIMEOUT_{suite.upper()}")
    default = FULL_BENCH_TIMEOUT_S if suite == "bench" and opts.full else SUITE_TIMEOUT_S[suite]
    return float(opts.suite_timeout or env or default)


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
    if info.get("count", 0) > 0 or opts.skip_no_gpu:
        return info if info.get("count", 0) > 0 else None
    raise NoGPU(no_gpu_message(session, info.get("error") or f"torch {info.get('torch')} sees no GPU"))


@dataclass
class Ctx:
    python: str
    opts: Options
    env: dict
    run: A.RunDir
    gpus: int
    log: callable = print
    deadline: float = float("inf")  # the running suite's, time.monotonic()
    timed_out: bool = False

    def sh(self, cmd: list[str], log: str, extra_env: dict | None = None, echo: bool = True) -> A.Result:
        """run_logged within the running suite's time limit; past it, a command is not started (rc 124)."""
        left = self.deadline - time.monotonic()
        path = self.run.path / "logs" / log
        res = (A.run_logged(cmd, path, env=self.child_env(extra_env), timeout=left, echo=echo) if left > 0 else
               A.Result(124, 0.0, ["not started: the suite's time limit was used up"], path))
        self.timed_out |= res.returncode == 124
        return res

    def child_env(self, extra: dict | None = None) -> dict:
        env = dict(self.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
        env.update(extra or {})
        return env


def make_context(python: str, opts: Options, env: dict, gpu_info: dict, log=print) -> Ctx:
    base = (opts.out if opts.out.is_absolute() else ROOT / opts.out).resolve()
    commit = A.git_commit(environ=env, exclude=str(base.relative_to(ROOT)) if base.is_relative_to(ROOT) else None)
    base.mkdir(parents=True, exist_ok=True)
    # The environment report and the lock check: once per run and interpreter (seconds each, three sessions).
    cache, tmp = base / f".env-{A.slug_path(env['NSA_RUN_ID'])}.json", base / ".env-probe.json"
    cached = json.loads(cache.read_text()) if cache.exists() else {}
    cached = cached if cached.get("python") == python else {}
    report = cached.get("report") or A.collect_env(python, tmp, env=env)
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    cell = env.get("NSA_CELL") or report.get("cell") or "unknown"
    gpus = report.get("gpus") or [{"name": n} for n in gpu_info.get("names", [])]
    run = A.RunDir.create(base, cell, gpus, run_id=env["NSA_RUN_ID"], commit=commit,
                          github=A.github_context(env), log=log)
    shutil.move(str(tmp), run.path / "env.json")
    run.set_env(report)
    if not report.get("gpus") and gpu_info.get("names"):
        run.state["env"].update(gpus=gpu_info["names"], gpu=gpu_info["names"][0], gpu_count=len(gpu_info["names"]))
    ctx = Ctx(python=python, opts=opts, env=env, run=run, gpus=max(1, int(gpu_info.get("count", 1))), log=log)
    check = cached.get("lock_check")
    try:  # a file of the set is named after the cell and given relative to its folder: nsa-env reads the build
        # variant (cu130) from the name's start, so that a +cu130 torch is not counted as drift
        expected = expected_set(cell, report, run.path)
        if check is None:
            p = subprocess.run([python, "-m", "nsa_env", "--check-lock", expected, "--json"], env=ctx.child_env(),
                               cwd=run.path if expected != cell else ROOT, capture_output=True, text=True,
                               timeout=300)
            check = json.loads(p.stdout) if p.stdout.strip().startswith("{") else {"error": p.stderr.strip()[-500:]}
    except (OSError, subprocess.SubprocessError, json.JSONDecodeError) as e:
        check = {"error": str(e)}
    if not report.get("error") and not check.get("error"):
        cache.write_text(json.dumps({"python": python, "report": report, "lock_check": check}) + "\n")
    (run.path / "lock-check.json").write_text(json.dumps(check, indent=2) + "\n")
    run.set_lock(cell, check)
    marker = Path(python).parent.parent / OVERLAY_MARKER  # the interpreter of an overlay venv (overlay.py)
    run.state["overlay"] = json.loads(marker.read_text()) if marker.exists() else None
    if shutil.which("nvidia-smi"):
        p = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=120)
        (run.path / "nvidia-smi.txt").write_text(p.stdout + p.stderr)
    run.save()
    tree = {True: "dirty", False: "clean"}.get(commit["dirty"], "not checked")
    log(f"artifacts: {run.path} (run {run.state['run_id']}, commit {commit['commit_short']} from "
        f"{commit['commit_source']}, tree {tree})")
    return ctx


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


def suite_files(suite: str) -> tuple[list[str], list[str]]:
    """(files to run, expected files that are missing)."""
    found = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests" / "gpu").glob("test_*.py"))
    files = [f for f in found if Path(f).name.startswith(BACKWARD_PATTERNS) == (suite == "backward")]
    return files, [f for f in EXPECTED.get(suite, []) if not (ROOT / f).exists()]


def has_module(python: str, name: str, env: dict) -> bool:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        return not subprocess.run([python, "-c", f"import {name}"], env=env, capture_output=True, timeout=60).returncode
    return False


def pytest_suite(ctx: Ctx, suite: str, files: list[str], missing: list[str]) -> bool:
    run = ctx.run
    junit = run.path / f"junit-{suite}.xml"
    cmd = [ctx.python, "-m", "pytest", *files, f"--junitxml={junit}", "-o", f"junit_suite_name={suite}",
           "-o", "junit_logging=all", "-p", "ci.sessions.gpu_split", "-rfEs", "-q"]
    # Several workers share each GPU (tests/gpu/_pinning.py: -n auto); tests marked big_gpu_memory share one
    # xdist group, so loadgroup runs them one at a time (tests/gpu/_sharing.py).
    workers = ctx.opts.workers or "auto"
    if workers != "0":
        cmd += ["-n", workers, "--dist", "loadgroup"]
    cmd += ctx.opts.pytest_args
    if not any(a.startswith("--timeout") for a in cmd) and has_module(ctx.python, "pytest_timeout", ctx.env):
        cmd += ["--timeout", f"{ctx.opts.test_timeout:g}"]  # one hung test must not eat the whole suite's limit
    if not files:
        res = A.Result(5, 0.0, [], run.path / "logs" / f"{suite}.log")
        res.log.write_text("no test files found under tests/gpu for this suite\n")
    else:
        res = ctx.sh(cmd, f"{suite}.log", SUITE_ENV.get(suite))
    counts = A.parse_junit(junit)
    status, notes = A.suite_status(res.returncode, counts, missing)
    run.record_suite(suite, status=status, runtime_s=round(res.seconds, 2), counts=counts, notes=notes,
                     junit=run.rel(junit) if junit.exists() else None, log=run.rel(res.log), command=" ".join(cmd),
                     files=files)
    ctx.log(f"{suite}: {status} in {res.seconds:.1f} s ({counts.get('passed', 0)} passed, "
            f"{counts.get('failed', 0) + counts.get('errors', 0)} failed, {counts.get('skipped', 0)} skipped)"
            + ("; " + "; ".join(notes) if notes else ""))
    return status == A.PASS


def beside_tests(ctx: Ctx, suite: str, steps: dict[str, tuple[list[str], str, dict | None, str]]) -> bool:
    """The suite's pytest run with `steps` (name: (cmd, log, env, what it shows)) running beside it: they are
    correctness checks, not timings, and a cold GPU suite is mostly compiling on the CPU. Their output goes to
    their logs only. A failed step fails the suite. Returns whether the suite passed."""
    with ThreadPoolExecutor(len(steps)) as pool:
        running = {name: pool.submit(ctx.sh, cmd, log, env, False) for name, (cmd, log, env, _) in steps.items()}
        ok = pytest_suite(ctx, suite, *suite_files(suite))
    steps_ok = True
    for name, future in running.items():
        res, good = future.result(), future.result().returncode == 0
        steps_ok &= good
        ctx.run.record_step(name, A.PASS if good else A.FAIL, res.seconds, ctx.run.rel(res.log),
                            steps[name][3] if good else (res.tail[-1] if res.tail else f"exit {res.returncode}"))
        ctx.log(f"{name}: {'PASS' if good else 'FAIL'} in {res.seconds:.1f} s ({ctx.run.rel(res.log)})")
        if not good:
            ctx.run.state["suites"][suite]["status"] = A.FAIL
            ctx.run.state["suites"][suite].setdefault("notes", []).append(f"{name} failed ({ctx.run.rel(res.log)})")
    return ok and steps_ok


def run_gpu_parity(ctx: Ctx) -> bool:
    # The seeds' runbook: one run with NSA_DEBUG_LOG=1 NSA_LOG_LIMIT=5 (routing log, telemetry, sanity).
    probe = ([ctx.python, "tests/gpu/routing_probe.py", "--device", "cuda", "--out",
              str(ctx.run.path / "telemetry.json")], "routing.log", {"NSA_DEBUG_LOG": "1", "NSA_LOG_LIMIT": "5"},
             "routing log, telemetry counters, finite outputs and gradients")
    return beside_tests(ctx, "gpu_parity", {"routing+sanity": probe})


def run_backward(ctx: Ctx) -> bool:
    # The tiny model's training smoke (nsa.smoke: loss must fall, generate == uncached), in fp32 and bf16.
    smokes = {f"train smoke ({dtype})": ([ctx.python, "-m", "nsa.smoke", "--device", "cuda", "--dtype", dtype, "--out",
                                          str(ctx.run.path / f"smoke-{dtype}")], f"train-smoke-{dtype}.log", None,
                                         "nsa.smoke: loss falls, generate matches uncached")
              for dtype in ("float32", "bfloat16")}
    return beside_tests(ctx, "backward", smokes)


BENCHES = {
    # name: (script, quick args, full args); each gets its output file in the run directory and --device cuda.
    # Quick: seconds each on an H100 (the suites must finish in minutes); full: the long sweeps.
    "prefill": ("bench/bench_prefill.py", "--csv",
                ["--T_list", "1024,4096", "--iters", "3", "--warmup", "1", "--backend", "auto"],
                ["--T_list", "1024,2048,4096,8192,16384,32768", "--iters", "5", "--warmup", "1", "--backend", "auto"]),
    "decode": ("bench/bench_decode.py", "--csv", ["--S_list", "1024,4096", "--iters", "32", "--warmup", "4"],
               ["--B", "1", "--dim", "256", "--heads", "8", "--groups", "2", "--dk", "32", "--dv", "32", "--l", "32",
                "--d", "16", "--l_sel", "64", "--n_sel", "16", "--w", "512",
                "--S_list", "512,1024,2048,4096,16384,65536", "--iters", "64", "--warmup", "8",
                "--branch_force_mode", "env"]),
    "fa2": ("bench/bench_fa2.py", "--out", ["--T", "1024,4096", "--D", "128", "--iters", "3", "--max-seconds", "30"],
            ["--max-seconds", "400"]),
}
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
    ok = True
    for name, (script, out_flag, quick, full) in BENCHES.items():
        if not (ROOT / script).exists():
            run.record_bench(name, status="MISSING", runtime_s=0, note=f"{script} not found", summary=[])
            ctx.log(f"bench {name}: {script} not found")
            ok = False
            continue
        out = run.path / (f"bench-{name}.csv" if out_flag == "--csv" else f"bench-{name}")
        cmd = [ctx.python, script, *(full if ctx.opts.full else quick), out_flag, str(out)]
        cmd += ["--device", "cuda"] if name != "fa2" else []  # bench_fa2 runs on CUDA only
        res = ctx.sh(cmd, f"bench-{name}.log")
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
    run.record_suite("bench", status=status, notes=notes)
    ctx.log(f"bench: {status}" + ("; " + "; ".join(notes) if notes else ""))
    return status == A.PASS


def bench_gate(ctx: Ctx) -> bool:
    run = ctx.run
    head = run.path / "bench-headline.json"
    cmd = [ctx.python, "bench/bench_headline.py", "--device", "cuda", "--out", str(head)]
    if ctx.opts.full:
        cmd.append("--full")
    res = ctx.sh(cmd, "bench-headline.log")
    if res.returncode != 0 or not head.exists():
        run.state["gate"] = {"status": A.FAIL, "class": None,
                             "lines": [f"headline bench failed (exit {res.returncode})"]}
        return False
    from ci.evidence import bench_gate as G

    headline = json.loads(head.read_text())
    cls = G.gpu_class(headline.get("gpu")) + ("-full" if ctx.opts.full else "")
    result = G.check(headline, baselines := G.load_baselines(), cls)
    failed = [r["figure"] for r in result["rows"] if r["status"] == G.FAIL]
    retry = run.path / "bench-headline-retry.json"
    again = [str(retry) if c == str(head) else c for c in cmd] + ["--only", ",".join(failed)]
    if failed and ctx.sh(again, "bench-headline-retry.log").returncode == 0 and retry.exists():
        result = G.second_opinion(result, json.loads(retry.read_text())["figures"], baselines, cls)
    (run.path / "gate.json").write_text(json.dumps(result, indent=2) + "\n")
    run.state["gate"] = result
    for line in result["lines"]:
        ctx.log(f"gate: {line}")
    return result["status"] != G.FAIL


def run_oneshot(ctx: Ctx) -> bool:
    """The seeds' runbook in order: environment, routing, sanity, tests, benches, template, report; a failure fails."""
    env_ok = not (ctx.run.state.get("env") or {}).get("env_error")
    ctx.run.record_step("environment", A.PASS if env_ok else A.FAIL, 0.0, "env.json",
                        "env.json, lock-check.json, nvidia-smi.txt")
    ok = all([run_suite(ctx, name) for name in A.PLANNED_SUITES]) and env_ok  # a list: every suite runs
    res = ctx.sh([ctx.python, "bench/runbook_report.py", str(ctx.run.path)], "template.log")  # the plan's template
    out = ctx.run.path / "template.json"
    ctx.run.state["template"] = json.loads(out.read_text())["lines"] if out.exists() else [f"exit {res.returncode}"]
    ctx.run.record_step("template", A.PASS if res.returncode == 0 else A.FAIL, res.seconds, ctx.run.rel(res.log),
                        "the test plan's template lines: Triton selection bench, decode summary, ranges sample")
    ctx.run.record_step("report", A.PASS, 0.0, "summary.md", "summary.md, known_good.json")
    return ok and res.returncode == 0


RUNNERS = {"gpu_parity": run_gpu_parity, "backward": run_backward, "bench": run_bench}


def run_suite(ctx: Ctx, name: str) -> bool:
    """One suite within its time limit: recorded RUNNING (and saved) first, then its runner's record, timed whole."""
    limit = suite_timeout(name, ctx.opts, ctx.env)
    ctx.run.begin_suite(name, limit)
    ctx.deadline, ctx.timed_out, t0 = time.monotonic() + limit, False, time.perf_counter()
    ok = RUNNERS[name](ctx)
    s = ctx.run.state["suites"][name]
    s["runtime_s"], ctx.deadline = round(time.perf_counter() - t0, 2), float("inf")
    if ctx.timed_out:
        s.setdefault("notes", []).append(f"timed out: the suite's limit of {limit:g} s was reached (--suite-timeout "
                                         f"or NSA_SUITE_TIMEOUT_{name.upper()})")
    if ctx.timed_out or s["status"] == A.RUNNING:
        s["status"] = A.FAIL
    ctx.run.save()
    return ok and s["status"] == A.PASS


@dataclass
class Outcome:
    status: str  # "pass" | "fail" | "skip"
    message: str
    run_dir: Path | None = None


def main(session: str, python: str, argv: list[str], env: dict | None = None, log=print, probe=probe_gpus) -> Outcome:
    """Run one GPU session's logic in `python` (the session's interpreter). Never raises for a failed suite."""
    env = dict(os.environ if env is None else env)
    env.setdefault("NSA_RUN_ID", A.new_run_id(env))  # a caller that set none: this session is a run of its own
    opts = parse_args(argv, env)
    try:
        info = require_gpu(session, python, opts, env, probe=probe)
    except NoGPU as e:
        return Outcome("fail", str(e))
    if info is None:
        return Outcome("skip", f"{session}: skipped: no CUDA GPU on this machine (--skip-no-gpu / NSA_SKIP_NO_GPU=1)")
    ctx = make_context(python, opts, env, info, log=log)
    try:
        ok = run_oneshot(ctx) if session == "oneshot" else run_suite(ctx, session)
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
    env = {k: v for k, v in {**os.environ, **(session.env or {})}.items() if v is not None}  # None: nox's unset
    if not passthrough:
        env["PATH"] = os.pathsep.join([session.virtualenv.bin, env.get("PATH", "")])
        env["VIRTUAL_ENV"] = session.virtualenv.location
    out = main(name, python, list(session.posargs), env=env, log=session.log)
    {"skip": session.skip, "fail": session.error}.get(out.status, session.log)(out.message)


def cli(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    names = []
    while argv and argv[0] in SESSIONS:
        names.append(argv.pop(0))
    if not names:
        print(f"usage: python -m ci.sessions.gpu {{{','.join(SESSIONS)}}} ... [--skip-no-gpu] [--full] [-- ARGS]")
        return 2
    os.environ.setdefault("NSA_RUN_ID", A.new_run_id())  # the sessions named together are one run
    outs = []
    for name in names:
        outs.append(main(name, sys.executable, list(argv)))
        print(outs[-1].message)
    return int(any(o.status == "fail" for o in outs))


if __name__ == "__main__":
    sys.exit(cli())
