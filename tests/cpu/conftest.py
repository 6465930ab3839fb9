"""Fixtures shared by the tests of ci/ (the configuration matrix, its locks, images and Quick start)."""

from __future__ import annotations

import pytest

from ci import matrix as mx
from ci.matrix import tomllib


@pytest.fixture
def pytorchs_own_index(monkeypatch):
    """URLs in these tests are PyTorch's own: a mirror set around the test run (NSA_PYTORCH_INDEX) must not
    count. Modules that need it say `pytestmark = pytest.mark.usefixtures("pytorchs_own_index")`."""
    monkeypatch.delenv("NSA_PYTORCH_INDEX", raising=False)


@pytest.fixture(scope="module")
def data() -> dict:
    """requirements/matrix.toml as parsed TOML (tests deep-copy it before editing)."""
    with mx.DEFAULT_PATH.open("rb") as f:
        return tomllib.load(f)
