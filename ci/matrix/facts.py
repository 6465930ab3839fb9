"""Generate nsa/upstream.json, the upstream facts `nsa-env doctor` needs, from requirements/matrix.toml.

    python -m ci.matrix.facts --write    # regenerate after editing the matrix (commit both)
    python -m ci.matrix.facts --check    # exit 1 if the shipped file is stale (tests/cpu does this too)

The doctor runs where no checkout exists (an installed wheel), so the facts travel inside the package.
They are the matrix's [upstream.*] tables, the flash-attn release wheels spelled out one by one (with
ci.matrix's own naming and publication rules, so nsa has no second copy of them) and a summary of the
cells. A flash-attn release whose wheel set the matrix does not know (`wheels_unknown`) is listed apart,
under `flash_attn_unlisted`: in `flash_attn` the doctor would read it as a release without wheels.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any

from ci.matrix import DEFAULT_PATH, Matrix, flash_wheel_name, flash_wheel_published, flash_wheel_url, load

OUT = Path(__file__).resolve().parents[2] / "nsa" / "upstream.json"
SCHEMA = 1


def _flash_wheels(up: dict[str, Any], version: str) -> list[dict[str, Any]]:
    rel = up["flash_attn"][version]
    combos = [*itertools.product(rel["torch"], rel["cuda_major"], rel["python"], rel["cxx11abi"]),
              *((i["torch"], i["cuda_major"], i["python"], i["cxx11abi"]) for i in rel.get("include", []))]
    out = []
    for torch_mm, cuda_major, python, abi in combos:
        if flash_wheel_published(up, version, torch_mm, cuda_major, python, abi)[0]:
            wheel = flash_wheel_name(version, cuda_major, torch_mm, abi, python)
            out.append({"torch": torch_mm, "cuda_major": cuda_major, "python": python, "cxx11abi": abi,
                        "wheel": wheel, "url": flash_wheel_url(up, version, wheel)})
    return out


def build(matrix: Matrix) -> dict[str, Any]:
    """The package data for this matrix (a pure function of it: the sync test compares the two)."""
    up = matrix.upstream
    releases = up.get("flash_attn", {})
    flash = {
        version: {**{k: v for k, v in rel.items() if k not in ("url", "include")}, "wheels": _flash_wheels(up, version)}
        for version, rel in releases.items() if not rel.get("wheels_unknown")
    }
    unlisted = {version: {k: v for k, v in rel.items() if k != "url"}
                for version, rel in releases.items() if rel.get("wheels_unknown")}
    cells = [
        {"id": c.id, "python": c.python, "cuda": c.cuda, "torch": c.torch, "flash_attn": c.flash_attn.source}
        for c in matrix.cells
    ]
    return {
        "schema": SCHEMA,
        "generated_from": "requirements/matrix.toml (python -m ci.matrix.facts --write)",
        "torch": up.get("torch", {}),
        "cuda_archs": up.get("cuda", {}),
        "driver": up.get("driver", {}),
        "triton": up.get("triton", {}),
        "flash_attn": flash,
        "flash_attn_unlisted": unlisted,
        "flash_attn_build": up.get("flash_attn_build", {}),
        "cells": cells,
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
        print(f"wrote {args.out}")
        return 0
    if not args.out.exists() or args.out.read_text() != text:
        print(f"{args.out} is stale: run `python -m ci.matrix.facts --write` and commit it", file=sys.stderr)
        return 1
    print(f"{args.out.name} matches {args.matrix.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
