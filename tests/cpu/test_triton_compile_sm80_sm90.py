"""Every Triton kernel compiles for sm 8.0 (A100) and sm 9.0 (H100) within the target's shared-memory and
register limits, with the launch configuration the host code picks on that GPU class
(bench/triton_compile_check.py: the real launchers on CPU tensors posing as the target's, Triton's compiler
and the ptxas it ships). Catches what Triton's CPU interpreter cannot: typing and lowering errors, shared
memory past the target's limit (an out-of-resources error at the first launch), register spills.

Runs the check in a subprocess: the suite's TRITON_INTERPRET=1 replaces the kernels in this process. The
quick set of shapes by default; NSA_COMPILE_CHECK_FULL=1 runs the full sweep (dtypes x group sizes x head
dims, a few minutes per target)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "triton_compile_check.py"
FULL = os.environ.get("NSA_COMPILE_CHECK_FULL") == "1"
# Each kernel of the library, by the check's row name (family:kernel); the window kernels need TMA (sm 9.0).
EXPECTED = {
    "topn:topn",
    "sel_fwd:sel_fwd",
    "sel_fwd_combine:sel_fwd",
    "sel_bwd:sel_bwd_dq",
    "sel_bwd:sel_bwd_dkdv",
    "sel_bwd:sel_bwd_reduce",
    "sel_bwd_accumulate:sel_bwd_dq",
    "combine_fwd:combine_fwd",
    "combine_bwd:combine_bwd",
    "decode:append",
    "decode:cmp_win",
    "decode:score_topk",
    "decode:sel",
    "decode:combine",
    "decode_paged:append",
    "decode_paged:cmp_win",
    "decode_paged:sel",
    "rope:rope",
}
WINDOW = {"window_fwd:window_fwd", "window_bwd:window_delta", "window_bwd:window_dkdv", "window_bwd:window_dq"}


def _needs_compiler():
    spec = importlib.util.find_spec("triton")
    if spec is None:
        pytest.skip("triton is not installed (the CPU lock pins it)")
    if not (Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this triton ships no ptxas (the CPU image prunes it): nothing can be assembled for a GPU")


def _run(*args: str, code: str | None = None) -> subprocess.CompletedProcess:
    """The check in a fresh interpreter without TRITON_INTERPRET (`code`: run that instead of the script,
    with the script importable)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "bench"), env.get("PYTHONPATH")]))
    cmd = [sys.executable, str(SCRIPT), *args] if code is None else [sys.executable, "-c", code, *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3000 if FULL else 600, cwd=ROOT)


def _rows(stdout: str) -> set[str]:
    return {ln.split()[0] for ln in stdout.splitlines() if ln and ln.split()[0].count(":") == 1}


@pytest.mark.slow
@pytest.mark.parametrize("arch", [80, 90])
def test_every_kernel_compiles_within_the_targets_limits(arch):
    _needs_compiler()
    res = _run("--arch", str(arch), *(["--full"] if FULL else []))
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert res.stdout.splitlines()[-1].endswith(" 0 failure(s)"), out
    want = EXPECTED | (WINDOW if arch >= 90 else set())
    assert _rows(res.stdout) >= want, f"missing: {sorted(want - _rows(res.stdout))}\n{out}"
    if arch < 90:  # no TMA: the window branch is FA-2's there, and the check says why
        assert "window_fwd" in out and "no TMA copies here" in out, out


@pytest.mark.slow
def test_sm8x_entries_fit_the_a100():
    """The shapes whose sm 9.0 entries do not fit sm 8.0 (top-n at D=256 in 16-bit: 196864 bytes of shared
    memory at 64 heads per group, 28 KB of spills at one; the selection forward in fp32 at 64 heads: 213248
    bytes) compile within its limits with sm 8.x's own entries."""
    _needs_compiler()
    res = _run("--arch", "80", "--kernels", "topn,sel_fwd", "--dtypes", "bf16,fp32", "--G", "1,64", "--D", "256")
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.splitlines()[-1].endswith(" 0 failure(s)"), res.stdout


@pytest.mark.slow
def test_a_configuration_past_the_limit_fails():
    """Seeded: the selection forward with 256-token K/V tiles in 4 stages needs about 512 KB of shared memory;
    the check must fail on it (sm 8.0 and 9.0 alike), naming the shared memory."""
    _needs_compiler()
    code = textwrap.dedent("""
        import sys
        import triton_compile_check as check
        from nsa.kernels.triton import selection_fwd

        table = selection_fwd.launch_config
        selection_fwd.launch_config = lambda *a, **k: {**table(*a, **k), "BLOCK_N": 256, "STAGES": 4}
        sys.exit(check.main(sys.argv[1:]))
    """)
    for arch in ("80", "90"):
        res = _run("--arch", arch, "--kernels", "sel_fwd", "--dtypes", "bf16", "--G", "16", "--D", "256", code=code)
        out = res.stdout + res.stderr
        assert res.returncode == 1, out
        assert "FAIL: shared memory" in out, out
