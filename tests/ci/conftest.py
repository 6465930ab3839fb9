"""Fixtures of the tests of ci/ (the configuration matrix, its locks, images and Quick start); `data`, the
parsed matrix, is tests/conftest.py's (the tooling tests read it too)."""

from __future__ import annotations

import pytest


@pytest.fixture
def pytorchs_own_index(monkeypatch):
    """URLs in these tests are PyTorch's own: a mirror set around the test run (NSA_PYTORCH_INDEX) must not
    count. Modules that need it say `pytestmark = pytest.mark.usefixtures("pytorchs_own_index")`."""
    monkeypatch.delenv("NSA_PYTORCH_INDEX", raising=False)
