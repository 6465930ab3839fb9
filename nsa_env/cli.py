"""`nsa-env` (also `python -m nsa_env`): what this environment is, what NSA can run in it, and what is wrong
with it.

    nsa-env                          # report: Python, torch/CUDA/cuDNN, GPUs, driver, triton, flash-attn,
                                     # PyTorch's FA-2 varlen, SDPA backends, and each NSA backend (ok / why not)
    nsa-env --json                   # the same as JSON (schema "nsa-env/1")
    nsa-env --check-lock [CELL|PATH] # installed distributions vs a cell's lock (missing, extra, wrong
                                     # version); exit 1 on drift. No CELL: the cell matching this torch.
                                     # A CELL is looked up in the checkout holding the current directory.
    nsa-env doctor [--json] [--head-dim D ...] [--log FILE]
                                     # common failures explained, with the fix; exit 1 if any is an error
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from nsa_env import drift, report
from nsa_env.lockfile import LockError


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["doctor"]:
        from nsa_env.doctor.cli import main as doctor_main

        return doctor_main(argv[1:])
    ap = argparse.ArgumentParser(
        prog="nsa-env",
        description=__doc__.split("\n\n")[0].replace("\n", " "),
        epilog="Subcommand: `nsa-env doctor [--json] [--head-dim D] [--log FILE]`.",
    )
    ap.add_argument("--json", action="store_true", help="print the report (or the drift) as JSON")
    ap.add_argument(
        "--check-lock",
        nargs="?",
        const="auto",
        metavar="CELL",
        help="compare installed packages with a lock: a path, or a cell id (requirements/locks/CELL.txt of "
        "the checkout holding the current directory); without CELL, the cell matching this torch and Python",
    )
    args = ap.parse_args(argv)
    rep = report.collect()
    if args.check_lock is None:
        if args.json:
            print(json.dumps(rep, indent=2))
        else:
            report.print_report(rep)
        return 0
    cell = rep["cell"] if args.check_lock == "auto" else args.check_lock
    if not cell:
        ap.error("--check-lock: torch is not installed, so no cell can be guessed; name one")
    try:
        lock = drift.find_lock(cell)
        lock_text = lock.read_text()
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    variant = cell.split("-", 1)[0] if re.match(r"^(cpu|cu\d+)-", cell) else None
    installed = drift.installed_distributions()
    # The pin of the torch in that set: its metadata when it is the torch this process sees, else the facts.
    torch_installed = installed.get("torch")
    pin = (rep["torch"]["expected_triton"] if torch_installed == rep["torch"]["version"]
           else report.expected_triton(torch_installed, requires=[]))
    try:
        res = drift.check_lock(lock_text, installed, variant, pin)
    except LockError as e:
        print(f"error: --check-lock {lock}: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"lock": str(lock), "cell": cell, **res}, indent=2))
    else:
        drift.print_drift(lock, res)
    return 1 if res["drift"] else 0


if __name__ == "__main__":
    sys.exit(main())
