"""Shared pytest setup: one seeded generator per test, one torch thread per xdist worker."""

from __future__ import annotations

import os
import zlib

import pytest
import torch

# Under pytest-xdist every worker gets its own process: with several workers on few cores, torch's
# own thread pool would oversubscribe the CPU. One thread per worker keeps `-n auto` fastest.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


@pytest.fixture
def gen(request) -> torch.Generator:
    """A CPU generator seeded from the test's id (and NSA_TEST_SEED, default 0).

    Every test draws fresh inputs of its own, reproducibly: the same test id gives the same inputs, a
    different NSA_TEST_SEED gives other ones (run the suite with a few seeds to widen coverage).
    """
    base = int(os.environ.get("NSA_TEST_SEED", "0"))
    seed = zlib.crc32(request.node.nodeid.encode()) ^ (base * 0x9E3779B1 & 0xFFFFFFFF)
    g = torch.Generator()
    g.manual_seed(seed)
    return g


@pytest.fixture(scope="module")
def data() -> dict:
    """requirements/matrix.toml as parsed TOML (tests deep-copy it before editing): the tests of ci/ and of the
    environment tooling."""
    from ci import matrix as mx
    from ci.matrix import tomllib

    with mx.DEFAULT_PATH.open("rb") as f:
        return tomllib.load(f)
# The seeds' test names (nsa-vibe) as -k keywords of the files that test the same thing now, so their
# selectors keep selecting what they meant (docs/migration.md has the full list of old names and paths).
SEED_KEYWORDS = {
    "test_backward_varlen.py": ("backward_parity",),
    "test_gradcheck_gpu.py": ("gradcheck_varlen",),
    "test_fa2_edge_shapes.py": ("fa2_parity_improved",),
}


# Files whose tests run Triton kernels in the interpreter or compile with Inductor: marked `heavy`. The core
# tier (-m "not slow and (sample or not heavy)") keeps only their `sample` tests.
HEAVY_FILES = ("test_compile.py",)


def is_heavy(name: str) -> bool:
    return name.endswith("_interp.py") or name in HEAVY_FILES


def pytest_collection_modifyitems(config, items):
    for item in items:
        if is_heavy(item.path.name):
            item.add_marker(pytest.mark.heavy)
        for keyword in SEED_KEYWORDS.get(item.path.name, ()):
            item.extra_keyword_matches.add(keyword)
