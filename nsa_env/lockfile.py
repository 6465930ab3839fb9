"""The one parser of the project's lock files (pip-tools format, as `uv pip compile` writes them).

Shared by `nsa-env --check-lock` (installed with nsa) and the lock generator and checker in ci/, so both
read a lock the same way: `name==version [; marker]` with `--hash=sha256:` options, or `name @ URL` for a
wheel (its version read from the wheel's file name). Comments and continuation lines are handled here;
what a lock may contain (strict hash-pinned lines only) is ci/'s rule, not the parser's.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import unquote

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename


class LockError(RuntimeError):
    pass


@dataclass(frozen=True)
class Pinned:
    """One requirement line of a hash-pinned lock (pip-tools format)."""

    name: str  # canonical (PEP 503)
    version: str  # for `name @ URL` wheels: the version in the wheel's file name
    url: str
    marker: str
    hashes: tuple[str, ...]


def logical_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of each requirement or option: comments dropped, continuation lines joined."""
    end = 0
    for chunk in re.split(r"(?<!\\)\n", text):
        start, end = end + 1, end + chunk.count("\n") + 1
        line = re.sub(r"\s*\\\n\s*", " ", chunk).strip()
        if line and not line.startswith("#"):
            yield start, line.split(" #", 1)[0].strip()


def iter_lock(text: str) -> Iterator[Pinned]:
    """Every requirement of a lock: `name==version [; marker]` then `--hash=sha256:...` lines, or
    `name @ URL`. A universal lock lists a name once per environment marker: each line is yielded.
    Option lines (-r, --index-url, ...) are skipped; anything else unparseable raises LockError."""
    for n, line in logical_lines(text):
        if line.startswith("-"):
            continue
        spec, *options = re.split(r"\s+(?=--)", line)
        try:
            req = Requirement(spec)
            exact = [s.version for s in req.specifier if s.operator == "=="]
            if not req.url and (len(exact) != 1 or len(req.specifier) != 1):
                raise ValueError("not pinned to exactly one version")
            # A URL's version is its wheel's (InvalidWheelFilename, a ValueError, for anything but a wheel).
            version = str(parse_wheel_filename(unquote(req.url.rsplit("/", 1)[-1]))[1]) if req.url else exact[0]
        except (InvalidRequirement, ValueError) as e:
            raise LockError(f"line {n}: unparseable lock line: {line[:100]!r} ({e})") from None
        hashes = tuple(o.split(":", 1)[1] for o in options if o.startswith("--hash=sha256:"))
        yield Pinned(canonicalize_name(req.name), version, req.url or "", str(req.marker or ""), hashes)


def parse_lock(text: str) -> dict[str, Pinned]:
    """name -> requirement (for a universal lock, the last line of a name wins)."""
    return {r.name: r for r in iter_lock(text)}
