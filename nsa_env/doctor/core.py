"""The doctor's vocabulary: a Finding (code, severity, problem, fix), a check's Outcome, and the Context
every check reads: the report, the shipped upstream facts, the head dims and the log of a failure."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from packaging.version import InvalidVersion, Version

from nsa_env import upstream

DEFAULT_HEAD_DIMS = (128, 192)


@dataclass
class Finding:
    code: str
    severity: str  # "error" | "warning" | "info"
    problem: str
    fix: str


@dataclass
class Outcome:
    check: str
    status: str  # "passed" | "findings" | "not applicable"
    note: str = ""
    findings: list[Finding] = field(default_factory=list)


class NotApplicable(Exception):
    """The check cannot or need not run on this report (the message says why)."""


# --- what the checks share -------------------------------------------------------------------------------


def major_minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def older(a: str, b: str) -> bool:
    try:
        return Version(a) < Version(b)
    except InvalidVersion:
        return False


@dataclass
class Context:
    report: dict[str, Any]
    head_dims: tuple[int, ...] = DEFAULT_HEAD_DIMS
    log: str = ""
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def torch(self) -> dict[str, Any]:
        return self.report["torch"]

    @property
    def gpus(self) -> list[dict[str, Any]]:
        return self.report.get("gpus") or []

    @property
    def flash(self) -> dict[str, Any]:
        return self.report.get("flash_attn") or {}

    def toolchain(self) -> dict[str, Any]:
        tc = self.report.get("toolchain")
        if not tc:
            raise NotApplicable("no toolchain facts in this report (made by an older nsa)")
        return tc

    def cuda_torch(self) -> None:
        if not self.torch.get("cuda"):
            raise NotApplicable(f"torch {self.torch.get('version')} is a CPU build: nothing CUDA to build or load")

    def in_log(self, pattern: str) -> re.Match[str] | None:
        return re.search(pattern, self.log, re.I | re.M) if self.log else None

    @property
    def python_mm(self) -> str:
        return major_minor(self.report["python"]["version"])

    @property
    def torch_flash_available(self) -> bool:
        tf = self.report.get("torch_flash_op") or self.report.get("torch_flash_varlen") or {}
        return bool(tf.get("available"))

    @property
    def optional_severity(self) -> str:
        """For problems met only when building or installing flash-attn: a warning where NSA needs it for
        its FA-2 paths, info where torch's built-in FA-2 (torch_flash) already serves them or no GPU exists."""
        return "warning" if self.gpus and not self.torch_flash_available else "info"

    @cached_property
    def flash_version(self) -> str:
        """The flash-attn to name here: the installed one; else the newest release with an upstream wheel for
        this torch/CUDA/Python/ABI (a download); else the newest release (a source build, the version the
        matrix's source-build cells pin: 2.8.3.post2 names CUDA 13 correctly where 2.8.3 asks for cu12)."""
        if self.flash.get("version"):
            return self.flash["version"]
        listed = upstream.flash_versions(self.facts)
        every = sorted({*listed, *self.facts.get("flash_attn_unlisted", {})}, key=Version)
        t = self.torch
        if t.get("version"):
            combo = (major_minor(t["version"]), (t.get("cuda") or "12").split(".")[0], self.python_mm,
                     bool(t.get("cxx11abi")))
            with_wheel = [v for v in listed if upstream.flash_wheel(self.facts, v, *combo)[0] is not None]
            if with_wheel:
                return with_wheel[-1]
        return every[-1] if every else "<version>"

    @cached_property
    def flash_wheel(self) -> tuple[dict[str, Any] | None, str]:
        """The upstream flash-attn wheel for this torch/CUDA/Python/ABI, or None and why."""
        t = self.torch
        return upstream.flash_wheel(
            self.facts, self.flash_version, major_minor(t["version"]), (t.get("cuda") or "12").split(".")[0],
            self.python_mm, bool(t.get("cxx11abi")),
        )

    @property
    def host_glibc(self) -> str | None:
        tc = self.report.get("toolchain") or {}
        if tc.get("glibc"):
            return tc["glibc"]
        m = re.match(r"glibc ([\d.]+)", self.report.get("platform", {}).get("libc") or "")
        return m.group(1) if m else None

    @property
    def wheel_glibc_too_new(self) -> bool:
        w, _ = self.flash_wheel
        need = (self.facts.get("flash_attn", {}).get(self.flash_version) or {}).get("glibc")
        return bool(w and need and self.host_glibc and older(self.host_glibc, need))

    @property
    def build_in_log(self) -> bool:
        return bool(self.in_log(r"Building wheel for flash[-_]attn|setup\.py (bdist_wheel|install)|"
                                r"Building from source|nvcc |ninja: build stopped"))

    @cached_property
    def source_build(self) -> tuple[bool, str]:
        """Whether getting flash-attn here means compiling it, and why."""
        if self.build_in_log:
            return True, "the log shows a flash-attn source build"
        if "MAX_JOBS" in (self.report.get("toolchain") or {}).get("env", {}):
            return True, "MAX_JOBS is set (a source build is being prepared)"
        if self.flash.get("installed"):
            return False, f"flash-attn {self.flash.get('version')} is installed"
        w, why = self.flash_wheel
        if w is None:
            return True, why
        if self.wheel_glibc_too_new:
            return True, f"the upstream wheel needs a newer glibc than {self.host_glibc}"
        return False, f"upstream publishes {w['wheel']}"

    def flash_install(self, force_build: bool | None = None) -> str:
        """The pip line that builds flash-attn here. Its setup.py first downloads the upstream wheel when one
        exists; FLASH_ATTENTION_FORCE_BUILD=TRUE compiles instead (by default where that wheel needs a newer
        glibc than this system's)."""
        force_build = self.wheel_glibc_too_new if force_build is None else force_build
        force = "FLASH_ATTENTION_FORCE_BUILD=TRUE " if force_build else ""
        return f"{force}pip install flash-attn=={self.flash_version} --no-build-isolation"


GLIBC_MISSING = r"version [`']?(GLIBC(?:XX)?)_([\d.]+)'? not found(?: \(required by ([^)]+)\))?"
