"""docs/migration.md covers every item of the seed documents (nsa-vibe's runbooks, reports and test plan):
each command, toggle, test name, -k selector, script, artifact path and probe snippet of
tests/ci/data/seed_items.txt appears in it literally. With NSA_SEED_DOCS set to a directory holding the seed
documents, the stored list must also be exactly what tests/ci/seed_items.py extracts from them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.ci import seed_items

ROOT = Path(__file__).resolve().parents[2]
ITEMS = ROOT / "tests" / "ci" / "data" / "seed_items.txt"


def _items() -> list[tuple[str, str]]:
    return [tuple(line.split("\t", 1)) for line in ITEMS.read_text().splitlines() if line.strip()]


def test_the_list_has_every_kind_of_item():
    kinds = {kind for kind, _ in _items()}
    assert kinds == {"command", "toggle", "test", "selector", "path", "snippet"}
    assert len(_items()) >= 100


def test_migration_page_names_every_seed_item():
    page = (ROOT / "docs" / "migration.md").read_text()
    missing = [f"{kind}: {item}" for kind, item in _items() if item not in page]
    assert not missing, "docs/migration.md does not mention:\n" + "\n".join(missing)


def test_every_retired_toggle_is_on_the_page_as_retired():
    from nsa import toggles

    page = (ROOT / "docs" / "migration.md").read_text()
    rows = [ln for ln in page.splitlines() if "retired (warns)" in ln]
    for name in toggles.RETIRED:
        assert any(f"`{name}`" in ln for ln in rows), name


def test_extraction_finds_items_of_each_kind():
    text = ("```bash\nexport NSA_USE_FA2=1\nPYTHONPATH=. NSA_X_Y=1 \\\n  python bench/b.py --steps 2\n```\n"
            "- `NSA_TEST_FA2=1 pytest -q -k \"a or b\"`  # note\n- see `test_x_gpu.py` and scripts/run.sh\n"
            "from nsa.kernels import thing\n")
    got = seed_items.extract(text)
    assert got["command"] == sorted(["export NSA_USE_FA2=1", "PYTHONPATH=. NSA_X_Y=1 python bench/b.py --steps 2",
                                     'NSA_TEST_FA2=1 pytest -q -k "a or b"'])
    assert got["toggle"] == ["NSA_TEST_FA2", "NSA_USE_FA2", "NSA_X_Y"]
    assert got["test"] == ["test_x_gpu.py"] and got["selector"] == ['-k "a or b"']
    assert "scripts/run.sh" in got["path"] and "bench/b.py" in got["path"]
    assert got["snippet"] == ["from nsa.kernels import thing"]


@pytest.mark.skipif(not os.environ.get("NSA_SEED_DOCS"), reason="NSA_SEED_DOCS (the seed documents' directory) unset")
def test_stored_list_is_what_the_seeds_give():
    assert seed_items.extract_dir(Path(os.environ["NSA_SEED_DOCS"])) == ITEMS.read_text().splitlines()
