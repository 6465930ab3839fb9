"""`nsa-env doctor`: the environment and install failures users hit, each as a check code with its fix.

    nsa-env doctor [--json] [--head-dim D ...] [--log FILE|-]

Every check reads a report (nsa_env.report.collect(), or one made elsewhere: `diagnose(report)`), the
upstream facts shipped with nsa_env (nsa_env/upstream.json) and optionally the log of a failed install or run (`--log`),
and ends as passed, not applicable here (with the reason), or findings. A finding has a severity (error:
this breaks now; warning: this breaks when you do the obvious next step; info: worth knowing) and a fix
of one or two lines. docs/environments.md lists every code. Exit 1 if any finding is an error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nsa_env import upstream
from nsa_env.doctor import install, runtime
from nsa_env.doctor.core import DEFAULT_HEAD_DIMS, Context, Finding, NotApplicable, Outcome
from nsa_env.doctor.index import check_index_unreachable

__all__ = ["CHECKS", "Context", "Finding", "NotApplicable", "Outcome", "diagnose", "main", "run_checks"]

CHECKS: tuple[tuple[str, Callable[[Context], list[Finding]]], ...] = (
    ("torch_missing", runtime.check_torch),
    ("torch_triton_mismatch", runtime.check_triton_pin),
    ("flash_attn_abi", runtime.check_flash_import),
    ("fa2_sm_unsupported", runtime.check_fa2_sm),
    ("fa2_head_dim", runtime.check_head_dims),
    ("driver_too_old", runtime.check_driver),
    ("no_gpu", runtime.check_no_gpu),
    ("ada_triton_sel_off", runtime.check_ada),
    ("build_isolation", install.check_build_isolation),
    ("build_oom_risk", install.check_build_oom),
    ("no_wheel", install.check_no_wheel),
    ("cuda_home_mismatch", install.check_cuda_home),
    ("no_kernel_image", runtime.check_no_kernel_image),
    ("glibc_too_old", install.check_glibc),
    ("triton_toolchain", runtime.check_triton_toolchain),
    ("index_unreachable", check_index_unreachable),
)
# Checks that read the log alone: they run when torch does not import (a failed install is their case).
LOG_ONLY = ("index_unreachable",)


def run_checks(report: dict[str, Any], head_dims: tuple[int, ...] = DEFAULT_HEAD_DIMS, log: str = "",
               facts: dict[str, Any] | None = None) -> list[Outcome]:
    ctx = Context(report, tuple(head_dims), log or "", upstream.load() if facts is None else facts)
    outcomes = []
    for name, check in CHECKS:
        # torch does not import: nothing else can be judged, but what the log alone says
        if outcomes and outcomes[0].findings and name not in LOG_ONLY:
            outcomes.append(Outcome(name, "not applicable", "torch does not import (torch_missing)"))
            continue
        try:
            found = check(ctx)
        except NotApplicable as e:
            outcomes.append(Outcome(name, "not applicable", str(e)))
            continue
        outcomes.append(Outcome(name, "findings" if found else "passed", findings=found))
    return outcomes


def diagnose(report: dict[str, Any], head_dims: tuple[int, ...] = DEFAULT_HEAD_DIMS, log: str = "",
             facts: dict[str, Any] | None = None) -> list[Finding]:
    """The failures found in a report (and log), each with its fix in plain words."""
    return [f for o in run_checks(report, head_dims, log, facts) for f in o.findings]


def main(argv: list[str] | None = None) -> int:
    from nsa_env.doctor.cli import main as cli_main

    return cli_main(argv)
