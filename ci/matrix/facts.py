"""Generate nsa_env/upstream.json, the upstream facts `nsa-env doctor` needs, from requirements/matrix.toml.

    python -m ci.matrix.facts --write    # regenerate after editing the matrix (commit both)
    python -m ci.matrix.facts --check    # exit 1 if the shipped file is stale (tests/tooling does this too)

The doctor runs where no checkout exists (an installed wheel), so the facts travel inside nsa_env: the
[upstream.*] tables, each flash-attn release's wheels spelled out by ci.matrix's rules (nsa_env has no copy of them),
the cells. A release whose wheel set is unknown goes under `flash_attn_unlisted`, lest it read as one without any.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any

from ci.matrix import DEFAULT_PATH, ROOT, Matrix, flash_wheel_name, flash_wheel_published, flash_wheel_url, load

OUT = ROOT / "nsa_env" / "upstream.json"
KEYS = ("torch", "cuda_major", "python", "cxx11abi")  # what tells one flash-attn wheel of a release from another


def _flash_wheels(up: dict[str, Any], version: str) -> list[dict[str, Any]]:
    rel = up["flash_attn"][version]
    combos = [*itertools.product(*(rel[k] for k in KEYS)), *(tuple(i[k] for k in KEYS) for i in rel.get("include", []))]
    wheels = [(dict(zip(KEYS, combo)), flash_wheel_name(version, combo[1], combo[0], combo[3], combo[2]))
              for combo in combos if flash_wheel_published(up, version, *combo)[0]]
    return [{**w, "wheel": name, "url": flash_wheel_url(up, version, name)} for w, name in wheels]


def build(matrix: Matrix) -> dict[str, Any]:
    """The package data for this matrix (a pure function of it: the sync test compares the two)."""
    up, releases = matrix.upstream, matrix.upstream.get("flash_attn", {})
    return {"schema": 1, "generated_from": "requirements/matrix.toml (python -m ci.matrix.facts --write)",
        "torch": up.get("torch", {}), "cuda_archs": up.get("cuda", {}), "driver": up.get("driver", {}),
        "triton": up.get("triton", {}),
        "flash_attn": {v: {**{k: x for k, x in rel.items() if k not in ("url", "include")},
                           "wheels": _flash_wheels(up, v)}
                       for v, rel in releases.items() if not rel.get("wheels_unknown")},
        "flash_attn_unlisted": {v: {k: x for k, x in rel.items() if k != "url"}
                                for v, rel in releases.items() if rel.get("wheels_unknown")},
        "flash_attn_build": up.get("flash_attn_build", {}),
        "cells": [{"id": c.id, "python": c.python, "cuda": c.cuda, "torch": c.torch, "flash_attn": c.flash_attn.source}
                  for c in matrix.cells],
    }


def render(facts: dict[str, Any]) -> str:
    return json.dumps(facts, indent=1, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ci.matrix.facts", description=__doc__.split("\n\n")[0])
    ap.add_argument("--matrix", type=Path, default=DEFAULT_PATH)
    ap.add_argument("--out", type=Path, default=OUT)
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--write", action="store_true", help="write the facts file")
    g.add_argument("--check", action="store_true", help="exit 1 if the facts file differs from the matrix")
    args = ap.parse_args(argv)
    text = render(build(load(args.matrix)))
    if args.write:
        args.out.write_text(text)
    elif not args.out.exists() or args.out.read_text() != text:
        print(f"{args.out} is stale: run `python -m ci.matrix.facts --write` and commit it", file=sys.stderr)
        return 1
    print(f"wrote {args.out}" if args.write else f"{args.out.name} matches {args.matrix.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
