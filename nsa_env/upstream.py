"""Upstream facts shipped with nsa_env (nsa_env/upstream.json) and the questions `nsa-env` asks of them.

The file is generated from requirements/matrix.toml (`python -m ci.matrix.facts --write`; a CPU test fails
when it is stale), so an installed nsa answers without a checkout: the triton each torch pins, which
flash-attn release wheels exist and the glibc they need, the oldest driver per CUDA major, what a
flash-attn source build needs. Versions and pins are compared with `packaging`: torch pins triton exactly
up to 2.13 (`triton==3.7.1`) and by a range from 2.14 (`triton~=3.8.0`).
"""

from __future__ import annotations

import json
import platform
from functools import cache
from importlib import resources
from typing import Any

from packaging.markers import default_environment
from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

FACTS_FILE = "upstream.json"


@cache
def load() -> dict[str, Any]:
    """The shipped facts (package data of nsa_env)."""
    try:
        text = resources.files("nsa_env").joinpath(FACTS_FILE).read_text()
    except FileNotFoundError:
        raise FileNotFoundError(
            f"nsa_env/{FACTS_FILE} is missing from this installation of nsa (package data); reinstall nsa"
        ) from None
    return json.loads(text)


# --- triton pins -----------------------------------------------------------------------------------------


def pin_specifier(pin: str) -> SpecifierSet:
    """A torch->triton pin as a SpecifierSet: a bare version ("3.6.0") means ==, else a PEP 440 specifier
    ("~=3.8.0", ">=3.8,<3.9")."""
    pin = pin.strip()
    try:
        return SpecifierSet(pin if pin[:1] in "<>=!~" else f"=={pin}")
    except InvalidSpecifier:
        raise ValueError(f"triton pin {pin!r} is neither a version nor a PEP 440 specifier") from None


def pin_matches(version: str, pin: str) -> bool:
    """Whether an installed triton satisfies torch's pin (local labels such as +git... are ignored)."""
    try:
        v = Version(version)
    except InvalidVersion:
        return False
    return pin_specifier(pin).contains(Version(v.public), prereleases=True)


def pip_requirement(pin: str, name: str = "triton") -> str:
    """What to give pip: triton==3.6.0 for an exact pin, "triton~=3.8.0" (quoted for the shell) for a range."""
    spec = str(pin_specifier(pin))
    return f"{name}{spec}" if spec.startswith("==") and "," not in spec else f'"{name}{spec}"'


def triton_pin_from_requires(
    requires: list[str] | None, environment: dict[str, str] | None = None
) -> tuple[bool, str | None]:
    """(torch requires triton at all, the pin that applies here) from torch's Requires-Dist lines.

    An exact pin comes back as the bare version ("3.6.0"), a range as its specifier ("~=3.8.0"). torch
    2.14 writes `triton~=3.8.0; platform_system == "Linux" and python_version < "3.15"`: on Python 3.15
    the marker is false, so (True, None): torch requires no triton there. CPU builds require none: (False, None).
    """
    env = {**default_environment(), "extra": "", **(environment or {})}
    mentioned = False
    for line in requires or []:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if req.name.lower() != "triton":
            continue
        mentioned = True
        if req.marker is None or req.marker.evaluate(env):
            spec = str(req.specifier)
            exact = [s for s in req.specifier if s.operator == "=="]
            return True, exact[0].version if exact and len(req.specifier) == 1 else (spec or None)
    return mentioned, None


def triton_pin_for_torch(facts: dict[str, Any], torch_version: str, python: str | None = None) -> str | None:
    """The matrix's record of the triton a torch release pins (None: unknown release, or no triton)."""
    entry = facts.get("torch", {}).get(torch_version.split("+")[0])
    if not entry:
        return None
    python = python or platform.python_version()
    below = entry.get("triton_python_below")
    if below and Version(python) >= Version(below):
        return None
    pin = entry.get("triton")
    return None if pin in (None, "", "none") else pin


# --- flash-attn release wheels -----------------------------------------------------------------------------


def flash_versions(facts: dict[str, Any]) -> list[str]:
    return sorted(facts.get("flash_attn", {}), key=Version)


def flash_combo(torch_mm: str, cuda_major: str, python: str, cxx11abi: bool) -> str:
    """A torch/CUDA/Python/ABI combination as upstream labels its wheels: cu12torch2.8cxx11abiTRUE-cp311."""
    cp = "cp" + python.replace(".", "")
    return f"cu{cuda_major}torch{torch_mm}cxx11abi{str(bool(cxx11abi)).upper()}-{cp}"


def flash_wheel(
    facts: dict[str, Any], version: str, torch_mm: str, cuda_major: str, python: str, cxx11abi: bool
) -> tuple[dict[str, Any] | None, str]:
    """(the upstream wheel entry {wheel, url, ...} or None, why none). Lookup only: the list is generated."""
    rel = facts.get("flash_attn", {}).get(version)
    if rel is None and version in facts.get("flash_attn_unlisted", {}):
        combo = flash_combo(torch_mm, cuda_major, python, cxx11abi)
        return None, (f"flash-attn {version} publishes no wheel for {combo} that this nsa knows of (its release "
                      "is read from PyPI, which has only its source)")
    if rel is None:
        known = ", ".join(flash_versions(facts)) or "none"
        return None, f"flash-attn {version} is not in this nsa's upstream facts (known: {known})"
    for w in rel.get("wheels", []):
        if (w["torch"], w["cuda_major"], w["python"], bool(w["cxx11abi"])) == (
            torch_mm, cuda_major, python, bool(cxx11abi)
        ):
            return w, ""
    have = f"torch {', '.join(rel.get('torch', []))}; CUDA {', '.join(rel.get('cuda_major', []))}; " \
           f"Python {', '.join(rel.get('python', []))}"
    return None, (
        f"flash-attn {version} publishes no wheel for {flash_combo(torch_mm, cuda_major, python, cxx11abi)} "
        f"(its wheels: {have})"
    )


def cells_with_flash_wheel(facts: dict[str, Any]) -> list[str]:
    return [c["id"] for c in facts.get("cells", []) if c.get("flash_attn") == "wheel"]
