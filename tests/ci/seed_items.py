"""The user-facing items of the seed documents (the nsa-vibe runbooks, reports and test plans): commands,
environment toggles, test names, -k selectors, scripts and artifact paths, extracted by pattern.

    python -m tests.ci.seed_items DIR > tests/ci/data/seed_items.txt

tests/ci/test_migration.py checks that docs/migration.md names every item of that list, and, when
NSA_SEED_DOCS points at a directory of the seed documents, that the list is what this extraction gives.
Index URLs are written as <PyTorch index> and the seeds' checkout as nsa-vibe (the page documents
commands, not hosts).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

PROGRAMS = ("python", "pytest", "pip", "uv ", "bash ", "git ", "nvidia-smi", "export ", "PYTHONPATH=", "NSA_",
            "MAX_JOBS=", "cd ", "source ", "ninja")
_URL = re.compile(r"https?://download\.pytorch\.org/whl")
_TOGGLE = re.compile(r"\bNSA_[A-Z0-9_]*[A-Z0-9]\b")
_TEST_FILE = re.compile(r"\btest_[a-z0-9_]+\.py\b")
_PATH = re.compile(r"\b(?:bench|scripts|configs|nsa|Documentation|artifacts)/[\w./<>-]*[\w/>]")
_FILE = re.compile(r"(?<![\w/.-])[\w-]+\.(?:py|txt|csv)\b")
_K = re.compile(r"-k (\"[^\"]+\"|\w+)")


def _lines(text: str):
    """Lines with shell continuations (a trailing backslash) joined."""
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        yield pending + line
        pending = ""


def _commands(text: str) -> list[str]:
    out, in_block = [], False
    for line in _lines(text):
        if line.startswith("```"):
            in_block = not in_block
            continue
        if in_block and line.startswith(PROGRAMS) and "=False" not in line:  # not a program's printed output
            out.append(line)
        for m in re.finditer(r"`([^`]+)`", line if not in_block else ""):
            cand = m.group(1).split("  #")[0].strip()
            if cand.startswith(PROGRAMS) and " " in cand:
                out.append(cand)
    return out


def extract(text: str) -> dict[str, list[str]]:
    text = _URL.sub("<PyTorch index>", text).replace("/root/nsa-vibe", "nsa-vibe")
    found = {
        "command": _commands(text),
        "toggle": _TOGGLE.findall(text),
        "test": _TEST_FILE.findall(text),
        "selector": ["-k " + m for m in _K.findall(text)],
        "path": _PATH.findall(text) + [f for f in _FILE.findall(text) if not f.startswith("test_")],
        "snippet": [ln.strip() for ln in text.splitlines() if ln.strip().startswith(("from nsa", "from flash_attn"))],
    }
    return {kind: sorted(set(items)) for kind, items in found.items()}


def extract_dir(directory: Path) -> list[str]:
    items: set[str] = set()
    for doc in sorted(Path(directory).glob("0*.txt")):
        for kind, values in extract(doc.read_text()).items():
            items.update(f"{kind}\t{v}" for v in values)
    return sorted(items)


if __name__ == "__main__":
    print("\n".join(extract_dir(Path(sys.argv[1]))))
