"""pytest plugin `-p ci.sessions.gpu_split`: xdist workers spread over the visible GPUs, each pinned to one.
It loads tests/gpu/_pinning.py by path, so that it works from the repository root before any conftest."""

import importlib.util
import sys
from pathlib import Path

_spec = importlib.util.spec_from_file_location("_nsa_gpu_pinning", Path(__file__).parents[2] / "tests/gpu/_pinning.py")
sys.modules["_nsa_gpu_pinning"] = _mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mod)
pytest_xdist_auto_num_workers, visible_gpus = _mod.pytest_xdist_auto_num_workers, _mod.visible_gpus
pin_worker, workers_per_gpu = _mod.pin_worker, _mod.workers_per_gpu
