"""Locks: the committed ones are fresh; staleness, tampering (every hand edit Renovate or a person could
make) and leaked local paths are detected (on a copy of requirements/ in a tmp dir); lock generation and
re-resolution are exercised offline with a fake uv; Renovate's config never edits a lock."""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
import stat
import sys
import textwrap
from pathlib import Path

import pytest

from ci import locks
from ci import matrix as mx

CPU = "cpu-torch2.13-py311"


@pytest.fixture
def req(tmp_path: Path) -> Path:
    """A copy of requirements/ (matrix, .in files, locks) in a tmp dir."""
    dst = tmp_path / "requirements"
    shutil.copytree(mx.DEFAULT_PATH.parent, dst)
    return dst


def test_committed_locks_are_fresh():
    assert locks.check(mx.load()) == []


def test_check_passes_on_fixture_then_fails_after_editing_an_in_file(req: Path):
    m = mx.load(req / "matrix.toml")
    assert locks.check(m, [CPU]) == []
    with (req / "runtime.in").open("a") as f:
        f.write("einops>=0.8\n")
    problems = locks.check(m, [CPU])
    assert problems and "stale" in problems[0] and f"nox -s lock -- {CPU}" in problems[0]


def test_whitespace_only_edit_is_not_stale(req: Path):
    (req / "bench.in").write_text((req / "bench.in").read_text() + "\n\n   \n")
    assert locks.check(mx.load(req / "matrix.toml"), [CPU]) == []


def test_matrix_edit_makes_the_cell_stale_unless_resolution_does_not_see_it(req: Path):
    text = (req / "matrix.toml").read_text()
    images_only = text.replace('runtime_image = "python:3.11-slim-bookworm"', 'runtime_image = "python:3.11-slim"')
    (req / "matrix.toml").write_text(images_only)  # a base image does not change what is installed
    assert locks.check(mx.load(req / "matrix.toml"), [CPU]) == []
    pinned = text.replace('id = "cpu-torch2.13-py311"', 'id = "cpu-torch2.13-py311"\npins = ["einops==0.8.1"]', 1)
    (req / "matrix.toml").write_text(pinned.replace("pins = []\n", "", 1))
    assert any("stale" in p for p in locks.check(mx.load(req / "matrix.toml"), [CPU]))


def test_tampered_body_and_leaked_paths_are_reported(req: Path):
    lock = req / "locks" / f"{CPU}.txt"
    text = lock.read_text()
    leaked = "--extra-index-url " + "file" + ":///srv/mirror/simple\n"  # built here: no such URL in the repo
    lock.write_text(text.replace("triton==3.7.1", "triton==3.7.0") + leaked)
    problems = " | ".join(locks.check(mx.load(req / "matrix.toml"), [CPU]))
    assert "triton is 3.7.0, matrix says 3.7.1" in problems
    assert "file: URL" in problems and "a pip option line (--extra-index-url)" in problems


GPU = "cu130-torch2.13-py312"
HASH = "--hash=sha256:" + "a" * 64


def _tamper(req: Path, edit) -> tuple[Path, str, list[str]]:
    """Apply edit(text) -> text to a copy of the GPU cell's lock; what --check says about it."""
    lock = req / "locks" / f"{GPU}.txt"
    original = lock.read_text()
    lock.write_text(edit(original))
    assert lock.read_text() != original
    return lock, original, locks.check(mx.load(req / "matrix.toml"), [GPU])


def _edited(problems: list[str]) -> bool:
    return any(p.startswith(f"{GPU}: {GPU}.txt is not what `nox -s lock` wrote") and f"nox -s lock -- {GPU}" in p
               for p in problems)


def test_check_fails_a_single_line_version_bump_as_renovate_makes_it(req: Path):
    """torch 2.13.0 requires nvidia-cublas==13.1.1.3; the bumped pin is consistent-looking but not a resolution."""
    def bump(text):
        return re.sub(r"nvidia-cublas==13\.1\.1\.3 \\\n(    --hash=sha256:\w+ \\\n)*    --hash=sha256:\w+",
                      f"nvidia-cublas==13.4.1.3 \\\n    {HASH}", text)

    lock, _, problems = _tamper(req, bump)
    assert "nvidia-cublas==13.4.1.3" in lock.read_text()
    assert _edited(problems) and len(problems) == 1  # structurally fine: only the seal catches it offline


def test_check_fails_a_new_package_in_a_lock_body(req: Path):
    _, _, problems = _tamper(req, lambda t: t + f"six==1.17.0 \\\n    {HASH}\n    # via nothing\n")
    assert _edited(problems) and len(problems) == 1


@pytest.mark.parametrize("line, what", [
    ("-r other.txt", "a pip option line (-r)"),
    ("--trusted-host example.invalid", "a pip option line (--trusted-host)"),
    ("-e git+https://example.invalid/x.git#egg=x", "a pip option line (-e)"),
    ("--index-url https://example.invalid/simple", "a pip option line (--index-url)"),
    ("x @ git+https://example.invalid/x.git", "a URL or VCS requirement"),
    ("x @ https://example.invalid/x-1.0-py3-none-any.whl " + HASH, "a URL or VCS requirement"),
    ("x==1.0", "a requirement without --hash=sha256"),
    ("x>=1.0 " + HASH, "not `name==version [; marker]`"),
], ids=["include", "trusted-host", "editable-git", "index-url", "vcs", "url", "unhashed", "unpinned"])
def test_check_fails_any_line_but_a_hash_pinned_requirement(req: Path, line: str, what: str):
    lock, _, problems = _tamper(req, lambda t: t.replace("numpy==", f"{line}\nnumpy==", 1))
    n = lock.read_text().splitlines().index(line) + 1
    assert f"{GPU}: {GPU}.txt: line {n}: {what}" in problems[0] and _edited(problems), problems


def test_lint_accepts_what_uv_writes():
    text = textwrap.dedent("""\
        # header
        filelock==4.1.0 ; python_full_version < '3.11' \\
            --hash=sha256:{a} \\
            --hash=sha256:{a}
            # via
            #   nox
        torch==2.13.0+cpu \\
            --hash=sha256:{a}
            # via -r requirements/matrix.toml (cell cpu-torch2.13-py311)
        """).format(a="a" * 64)
    assert locks.lint_lock(text) == []
    for lock in [*(mx.DEFAULT_PATH.parent / "locks").glob("*.txt"), mx.DEFAULT_PATH.parent / "bootstrap.txt"]:
        if not lock.name.endswith(".flash-attn.txt"):  # a URL pin, compared byte for byte instead
            assert locks.lint_lock(lock.read_text()) == [], lock.name


FAKE_RESOLVER = """#!{python}
import os, shutil, sys
args = sys.argv[1:]
if args == ["--version"]:
    print("uv 0.0.1 (fake)")
    sys.exit(0)
out = args[args.index("--output-file") + 1]
with open(os.environ["FAKE_UV_SEEN"], "a") as seen:  # the pins uv was asked to prefer
    seen.write(open(out).read() + "=====\\n")
shutil.copyfile(os.environ["FAKE_UV_RESULT"], out)
"""


@pytest.fixture
def resolver(tmp_path: Path, monkeypatch) -> tuple[str, Path, Path]:
    """A fake uv whose resolution is the file FAKE_UV_RESULT; it appends the preferences it got to FAKE_UV_SEEN."""
    uv = tmp_path / "fake-uv"
    uv.write_text(FAKE_RESOLVER.format(python=sys.executable))
    uv.chmod(uv.stat().st_mode | stat.S_IEXEC)
    result, seen = tmp_path / "result.txt", tmp_path / "seen.txt"
    monkeypatch.setenv("FAKE_UV_RESULT", str(result))
    monkeypatch.setenv("FAKE_UV_SEEN", str(seen))
    return str(uv), result, seen


def test_resolve_names_what_resolving_the_inputs_changes(req: Path, resolver):
    uv, result, seen = resolver
    lock = req / "locks" / f"{GPU}.txt"
    result.write_text(lock.read_text())  # uv's resolution of the inputs: the committed lock
    m = mx.load(req / "matrix.toml")
    assert locks.resolve_check(m, [GPU], uv=uv) == []  # a fixed point
    text = lock.read_text().replace("nvidia-cublas==13.1.1.3", "nvidia-cublas==13.4.1.3")
    text = text.replace("rich==", "-r other.txt\n--trusted-host example.invalid\nrich==")
    lock.write_text(text + f"six==1.17.0 \\\n    {HASH}\n")
    problems = locks.resolve_check(m, [GPU], uv=uv)
    assert problems == [f"{GPU}: {GPU}.txt: nvidia-cublas is 13.4.1.3, resolving the inputs gives 13.1.1.3",
                        f"{GPU}: {GPU}.txt: six==1.17.0 is not in the resolution of the inputs"]
    preferred = seen.read_text().split("=====\n")[1]
    assert "nvidia-cublas==13.4.1.3\n" in preferred and "torch==2.13.0\n" in preferred
    assert "other.txt" not in preferred and "trusted-host" not in preferred  # only pins reach uv
    result.write_text(text.replace("rich==", "rich-extra==1.0 \\\n    " + HASH + "\nrich=="))
    assert f"{GPU}: {GPU}.txt: rich-extra==1.0 is missing (the resolution of the inputs has it)" in \
        locks.resolve_check(m, [GPU], uv=uv)


def test_relock_starts_from_the_pins_and_upgrade_from_nothing(req: Path, resolver):
    uv, result, seen = resolver
    m = mx.load(req / "matrix.toml")
    lock = req / "locks" / f"{GPU}.txt"
    result.write_text(lock.read_text().split("\n#\n", 1)[1])  # the body, as uv writes it (--no-header)
    before = lock.read_text()
    locks.compile_cell(m, m.get(GPU), uv=uv)
    unsealed = [re.sub(r"# lock-sha256: \w+\n", "", t) for t in (lock.read_text(), before)]
    assert unsealed[0].replace("uv 0.0.1", "uv 0.13.9") == unsealed[1]  # the same lock, from another uv
    locks.compile_cell(m, m.get(GPU), uv=uv, upgrade=True)
    first, second, _ = seen.read_text().split("=====\n")
    assert "torch==2.13.0\n" in first and second == ""
    assert locks.check(m, [GPU]) == []


def test_missing_and_orphan_locks(req: Path):
    (req / "locks" / f"{CPU}.txt").rename(req / "locks" / "cu999-torch9.9-py399.txt")
    problems = " | ".join(locks.check(mx.load(req / "matrix.toml")))
    assert f"{CPU}: no lock" in problems and "cu999-torch9.9-py399.txt: no cell" in problems


def test_parse_lock_handles_markers_urls_and_duplicates():
    text = textwrap.dedent("""\
        # header
        filelock==4.1.0 ; python_full_version < '3.11' \\
            --hash=sha256:{a}
        filelock==4.2.11 ; python_full_version >= '3.11' \\
            --hash=sha256:{a}
            # via nox
        flash-attn @ https://example.invalid/flash_attn-2.8.3%2Bcu12-cp311-cp311-linux_x86_64.whl \\
            --hash=sha256:{a}
        Typing_Extensions==4.16.0
        """).format(a="a" * 64)
    lines = list(locks.iter_lock(text))
    assert len(lines) == 4
    reqs = locks.parse_lock(text)
    assert reqs["filelock"].version == "4.2.11" and reqs["flash-attn"].url.startswith("https://")
    assert reqs["typing-extensions"].hashes == ()
    for bad in ("this is not a requirement\n", "numpy>=2 \\\n    --hash=sha256:" + "a" * 64 + "\n",
                "x @ https://example.invalid/x-1.0.tar.gz\n"):
        with pytest.raises(locks.LockError, match="unparseable"):
            locks.parse_lock(bad)


FAKE_UV = """#!{python}
import sys
args = sys.argv[1:]
if args == ["--version"]:
    print("uv 0.0.1 (fake)")
    sys.exit(0)
cell_in = next(a for a in args if a.endswith("cell.in"))
with open(args[args.index("--output-file") + 1], "w") as out:  # uv writes its result to the output file
    out.write("torch==2.13.0+cpu \\\\\\n    --hash=sha256:{torch}\\n    # via -r " + cell_in + "\\n")
    out.write("triton==3.7.1 \\\\\\n    --hash=sha256:{other}\\n    # via -r " + cell_in + "\\n")
    out.write("numpy==2.4.6 \\\\\\n    --hash=sha256:{other}\\n    # via -r requirements/runtime.in\\n")
"""


def _fake_uv(tmp_path: Path, torch_sha: str) -> str:
    uv = tmp_path / "uv"
    uv.write_text(FAKE_UV.format(python=sys.executable, torch=torch_sha, other="b" * 64))
    uv.chmod(uv.stat().st_mode | stat.S_IEXEC)
    return str(uv)


def test_compile_cell_writes_a_checked_lock_without_local_paths(req: Path, tmp_path: Path, monkeypatch):
    monkeypatch.setenv("NSA_LOCK_FIND_LINKS", str(tmp_path / "wheels"))
    m = mx.load(req / "matrix.toml")
    cell = m.get(CPU)
    out = locks.compile_cell(m, cell, uv=_fake_uv(tmp_path, cell.torch_sha256))
    text = out.read_text()
    assert str(tmp_path) not in text and "/tmp" not in text
    assert "# via -r requirements/matrix.toml (cell cpu-torch2.13-py311)" in text
    assert locks.header_fields(text)["resolver"].startswith("uv 0.0.1")
    assert locks.check(m, [CPU]) == []


def test_compile_cell_resolves_from_the_cells_index(req: Path, tmp_path: Path, monkeypatch):
    """Without a find-links folder, uv sees exactly the cell's index (PyTorch's CPU index for the CPU cell)."""
    monkeypatch.delenv("NSA_LOCK_FIND_LINKS", raising=False)
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.setenv("NSA_PYTORCH_INDEX", "http://mirror.invalid/whl")
    seen = []
    real_run = locks.subprocess.run

    def spy(cmd, **kw):
        seen.append(cmd)
        return real_run(cmd, **kw)

    monkeypatch.setattr(locks.subprocess, "run", spy)
    m = mx.load(req / "matrix.toml")
    cell = m.get(CPU)
    text = locks.compile_cell(m, cell, uv=_fake_uv(tmp_path, cell.torch_sha256)).read_text()
    compile_cmd = next(c for c in seen if "compile" in c)
    assert compile_cmd[compile_cmd.index("--extra-index-url") + 1] == "http://mirror.invalid/whl/cpu"
    assert "mirror.invalid" not in text  # the header names PyTorch's own index, never a mirror
    assert "--extra-index-url https://download.pytorch.org/whl/cpu -r cpu-torch2.13-py311.txt" in text


def test_compile_cell_refuses_a_torch_wheel_with_another_hash(req: Path, tmp_path: Path, monkeypatch):
    monkeypatch.setenv("NSA_LOCK_FIND_LINKS", str(tmp_path))
    m = mx.load(req / "matrix.toml")
    with pytest.raises(locks.LockError, match="torch_sha256"):
        locks.compile_cell(m, m.get(CPU), uv=_fake_uv(tmp_path, "c" * 64))


def test_cli_check_and_unknown_target(capsys):
    from ci.locks.__main__ import main

    assert main(["--check", CPU]) == 0
    assert main(["--check", "nope"]) == 2
    assert "unknown" in capsys.readouterr().err


SOURCE_CELL, WHEEL_CELL, NO_FLASH_CELL = "cu130-torch2.12-py312", "cu128-torch2.8-py311", "cu130-torch2.14-py312"


def test_flash_attn_pins_sit_beside_the_gpu_locks():
    m = mx.load()
    for cell in m.cells:
        path = locks.flash_lock_path(m, cell.id)
        assert path.exists() == (cell.flash_attn.source != "none"), cell.id
    src = locks.parse_lock(locks.flash_lock_path(m, SOURCE_CELL).read_text())["flash-attn"]
    assert (src.version, src.url, src.hashes) == ("2.8.3.post2", "", (m.flash_sdist_sha256("2.8.3.post2"),))
    whl = locks.parse_lock(locks.flash_lock_path(m, WHEEL_CELL).read_text())["flash-attn"]
    assert whl.url == m.flash_wheel_url(m.get(WHEEL_CELL)) and whl.hashes == (m.get(WHEEL_CELL).flash_attn.sha256,)
    args, env = locks.flash_install_args(m, m.get(SOURCE_CELL))
    assert "--no-build-isolation" in args and env["FLASH_ATTENTION_FORCE_BUILD"] == "TRUE"  # never an unpinned wheel
    assert env["FLASH_ATTN_CUDA_ARCHS"] == "80;86;89;90;100;120"
    assert "--only-binary=:all:" in locks.flash_install_args(m, m.get(WHEEL_CELL))[0]


def test_flash_attn_pin_edits_missing_and_orphans_are_reported(req: Path):
    m = mx.load(req / "matrix.toml")
    pin = locks.flash_lock_path(m, SOURCE_CELL)
    pin.write_text(pin.read_text().replace("2.8.3.post2", "2.8.3"))
    assert any(f"{pin.name} is stale" in p for p in locks.check(m, [SOURCE_CELL]))
    pin.unlink()
    assert any(f"{pin.name} is missing" in p for p in locks.check(m, [SOURCE_CELL]))
    locks.write_flash_lock(m, m.get(SOURCE_CELL))
    assert locks.check(m, [SOURCE_CELL]) == []
    # The pin follows the matrix's facts: another sdist sha256 there makes it stale.
    text = (req / "matrix.toml").read_text()
    old = m.flash_sdist_sha256("2.8.3.post2")
    (req / "matrix.toml").write_text(text.replace(old, "0" * 64))
    assert any("is stale" in p for p in locks.check(mx.load(req / "matrix.toml"), [SOURCE_CELL]))
    (req / "matrix.toml").write_text(text)
    stray = locks.flash_lock_path(m, NO_FLASH_CELL)
    stray.write_text(pin.read_text())
    assert any("exists but the cell has no flash-attn" in p for p in locks.check(m, [NO_FLASH_CELL]))
    (req / "locks" / "cu999-torch9.9-py399.flash-attn.txt").write_text("")
    assert any("cu999-torch9.9-py399.flash-attn.txt: no cell 'cu999-torch9.9-py399'" in p for p in locks.check(m))


# Renovate's own defaults for the file patterns of the managers we enable (its docs, per manager); the
# config's managerFilePatterns are added to these, never replace them.
RENOVATE_DEFAULTS = {
    "github-actions": [r"/(^|/)(workflow-templates|\.(?:github|gitea|forgejo)/(?:workflows|actions))/.+\.ya?ml$/",
                       r"/(^|/)action\.ya?ml$/"],
    "pip_requirements": [r"/(^|/)[\w-]*requirements([-._]\w+)?\.(txt|pip)$/"],
    "custom.regex": [],
}


def _matches(pattern: str, path: str) -> bool:
    """A Renovate file pattern: /regex/ or a glob."""
    if len(pattern) > 1 and pattern.startswith("/") and pattern.endswith("/"):
        return re.search(pattern[1:-1], path) is not None
    return fnmatch.fnmatch(path, pattern)


def test_renovate_never_edits_a_lock_and_relocks_after_updating_an_input():
    root = mx.DEFAULT_PATH.parent.parent
    config = json.loads((root / ".github" / "renovate.json").read_text())
    enabled = config["enabledManagers"]
    assert set(enabled) <= set(RENOVATE_DEFAULTS), "a new manager: add its default file patterns here"
    patterns = {m: RENOVATE_DEFAULTS[m] + config.get(m, {}).get("managerFilePatterns", []) for m in enabled}
    patterns["custom.regex"] += [p for c in config.get("customManagers", []) for p in c["managerFilePatterns"]]
    lock_files = [f.relative_to(root).as_posix() for f in (root / "requirements" / "locks").glob("*.txt")]
    lock_files.append("requirements/bootstrap.txt")  # generated too (`nox -s lock -- bootstrap`)
    assert len(lock_files) > 40
    for f in lock_files:
        assert not [(m, p) for m, ps in patterns.items() for p in ps if _matches(p, f)], f
        assert any(_matches(p, f) for p in config["ignorePaths"]), f
    assert all(any(_matches(p, f"requirements/{n}.in") for p in patterns["pip_requirements"])
               for n in ("runtime", "test", "bench", "bootstrap", "tools", "lint"))
    task = config["postUpgradeTasks"]
    assert any("nox -s lock" in c for c in task["commands"]) and "requirements/locks/*.txt" in task["fileFilters"]
