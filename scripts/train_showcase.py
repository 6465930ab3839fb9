"""The seeds' command line, `python scripts/train_showcase.py --dataset fineweb_edu --steps 200`: the training
showcase lives at bench/train_showcase.py (same flags, NSA_BATCH_SIZE and NSA_ACCUM); this forwards to it."""

import runpy
import sys
from pathlib import Path

if __name__ == "__main__":
    target = Path(__file__).resolve().parents[1] / "bench" / "train_showcase.py"
    sys.argv[0] = str(target)
    runpy.run_path(str(target), run_name="__main__")
