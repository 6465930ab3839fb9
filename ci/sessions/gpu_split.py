"""pytest plugin: one xdist worker per visible GPU, each pinned to its GPU (`-p ci.sessions.gpu_split`).

The implementation lives in tests/gpu/_pinning.py (which tests/gpu/conftest.py may import too); this
module loads it by path so it works as a `-p` plugin from the repository root, before any conftest.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "tests" / "gpu" / "_pinning.py"
_spec = importlib.util.spec_from_file_location("_nsa_gpu_pinning", _PATH)
_mod = importlib.util.module_from_spec(_spec)
sys.modules["_nsa_gpu_pinning"] = _mod
_spec.loader.exec_module(_mod)

pytest_xdist_auto_num_workers = _mod.pytest_xdist_auto_num_workers
visible_gpus = _mod.visible_gpus
pin_worker = _mod.pin_worker
