"""The Docker image build plan (ci/images.py), its labels and tags, and the checks of a built image.

No docker, torch or network needed: the real build-and-check of the CPU and GPU images is
docker/ci_images.sh (`nox -s images -- --ci`). Tests that read docker/ skip inside an image, whose
/workspace holds no docker/ directory.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ci import images, locks  # noqa: E402
from ci.locks import parse_lock  # noqa: E402
from ci.matrix import load  # noqa: E402

CPU = "cpu-torch2.13-py311"
GPU = "cu130-torch2.11-py312"
SHA = "0123456789abcdef0123456789abcdef01234567"
DATE = "2026-01-02T03:04:05Z"
needs_docker_dir = pytest.mark.skipif(not (ROOT / "docker" / "Dockerfile").exists(), reason="no docker/ here")


pytestmark = pytest.mark.usefixtures("pytorchs_own_index")


@pytest.fixture(scope="module")
def matrix():
    return load()


@pytest.fixture(scope="module")
def plans(matrix):
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("NSA_PYTORCH_INDEX", raising=False)
        return {
            c.id: images.make_plan(matrix, c, repo="reg.example/team/nsa", rev=SHA, date=DATE)
            for c in matrix.cells
        }


def test_every_cell_has_a_plan(matrix, plans):
    assert set(plans) == {c.id for c in matrix.cells}
    assert CPU in plans


def test_tags_are_cell_and_cell_sha(plans):
    for cid, p in plans.items():
        assert p.tags == (f"reg.example/team/nsa:{cid}", f"reg.example/team/nsa:{cid}-{SHA[:12]}")
        for tag in p.tags:  # a valid docker reference: tag <= 128 chars of [A-Za-z0-9_.-]
            assert re.fullmatch(r"[a-z0-9./-]+:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}", tag), tag


def test_plan_lists_bases_flash_source_and_driver(plans):
    for cid, p in plans.items():
        assert p.build_args["BUILD_BASE"] and p.build_args["RUNTIME_BASE"], cid
        assert p.build_args["FLASH_ATTN_SOURCE"] in ("none", "wheel", "source"), cid
        if p.cpu_only:
            assert not p.min_driver
            assert p.build_args["PRUNE"].split() == list(images.CPU_PRUNE)
        else:
            if p.build_args["FLASH_ATTN_SOURCE"] == "source":  # compiled with nvcc in the build stage
                assert re.match(r"nvidia/cuda:.*-devel", p.build_args["BUILD_BASE"]), cid
            # The torch wheels bring CUDA's libraries: GPU images run on a slim OS base, not a CUDA image.
            assert re.fullmatch(r"ubuntu:\d\d\.\d\d", p.build_args["RUNTIME_BASE"]), cid
            assert re.match(r"\d{3}\.\d+", p.min_driver), cid
            assert p.build_args["PYTHON_SOURCE"] == "deadsnakes"
    text = images.format_plan(list(plans.values()))
    for p in plans.values():
        assert p.tags[0] in text and p.build_args["BUILD_BASE"] in text and p.flash_attn_pinned in text


def test_flash_attn_is_installed_from_the_cells_hash_pinned_file(matrix, plans):
    """Every flash-attn the images install comes from requirements/locks/<cell>.flash-attn.txt, which pins
    a wheel or the source package by sha256; source builds are bounded to the cell's architectures."""
    built = [p for p in plans.values() if p.build_args["FLASH_ATTN_SOURCE"] == "source"]
    assert built, "the matrix has a cell that builds flash-attn from source"
    for p in plans.values():
        if p.build_args["FLASH_ATTN_SOURCE"] == "none":
            continue
        pin = locks.flash_lock_path(matrix, p.cell).read_text()
        (req,) = locks.iter_lock(pin)
        assert req.name == "flash-attn" and re.fullmatch(r"[0-9a-f]{64}", req.hashes[0]), p.cell
        assert req.version.split("+")[0] == p.build_args["FLASH_ATTN_VERSION"], p.cell
        assert bool(req.url) == (p.build_args["FLASH_ATTN_SOURCE"] == "wheel"), p.cell
        assert locks.flash_lock_path(matrix, p.cell).name in p.flash_attn_pinned
    for p in built:
        assert p.build_args["GPU_ARCHS"] == ";".join(sorted(matrix.get(p.cell).gpu_archs, key=float))
        assert int(p.build_args["MAX_JOBS"]) >= 1
        assert not any(k.startswith("FLASH_ATTN_") and k not in ("FLASH_ATTN_SOURCE", "FLASH_ATTN_VERSION")
                       for k in p.build_args), "the pin file, not build args, carries what is installed"


def test_without_flash_attn_leaves_it_out_and_says_so(matrix, plans):
    full = plans[GPU]
    slim = images.make_plan(matrix, matrix.get(GPU), repo="reg.example/team/nsa", rev=SHA, date=DATE,
                            flash_attn=False)
    assert full.build_args["FLASH_ATTN_SOURCE"] == "source" and "MAX_JOBS" in full.build_args
    assert slim.build_args["FLASH_ATTN_SOURCE"] == "none" and "MAX_JOBS" not in slim.build_args
    assert slim.labels["nsa.flash-attn"] == "none" and slim.labels["nsa.flash-attn.source"] == "none"
    others = {k: v for k, v in full.build_args.items() if not k.startswith(("FLASH_ATTN", "MAX_JOBS"))}
    assert others.items() <= slim.build_args.items()


def test_every_cells_index_is_a_build_arg(matrix, plans):
    for cell in matrix.cells:
        assert plans[cell.id].build_args["TORCH_INDEX_URL"] == matrix.index_url(cell), cell.id
    assert plans[CPU].build_args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert plans[GPU].build_args["TORCH_INDEX_URL"] == ""


def test_labels(plans):
    p = plans[CPU]
    lock = ROOT / "requirements" / "locks" / f"{CPU}.txt"
    assert p.labels["nsa.lock.sha256"] == hashlib.sha256(lock.read_bytes()).hexdigest()
    assert p.labels["nsa.cell"] == CPU
    assert p.labels["nsa.torch"] == "2.13.0+cpu"
    assert p.labels["nsa.cuda"] == "none"
    assert p.labels["nsa.triton"] == parse_lock(lock.read_text())["triton"].version
    assert p.labels["org.opencontainers.image.revision"] == SHA
    assert p.labels["org.opencontainers.image.created"] == DATE
    assert p.labels["org.opencontainers.image.source"].startswith("https://")
    for cid, q in plans.items():
        for key in ("nsa.torch", "nsa.cuda", "nsa.triton", "nsa.flash-attn", "nsa.lock.sha256"):
            assert q.labels[key], f"{cid}: empty label {key}"


def test_edited_lock_gives_another_lock_label(tmp_path, matrix):
    cell = matrix.get(CPU)
    (tmp_path / "requirements" / "locks").mkdir(parents=True)
    lock = tmp_path / "requirements" / "locks" / f"{CPU}.txt"
    shutil.copy(ROOT / "requirements" / "locks" / f"{CPU}.txt", lock)
    kw = dict(root=tmp_path, rev=SHA, date=DATE)
    before = images.make_plan(matrix, cell, **kw)
    again = images.make_plan(matrix, cell, **kw)
    assert before.labels == again.labels and before.build_args == again.build_args
    text = lock.read_text()
    assert "einops==" in text
    lock.write_text(re.sub(r"einops==\S+", "einops==0.0.1", text, count=1))
    after = images.make_plan(matrix, cell, **kw)
    assert after.labels["nsa.lock.sha256"] != before.labels["nsa.lock.sha256"]
    assert after.build_args["LOCK_SHA256"] == after.labels["nsa.lock.sha256"]


def test_missing_lock_cannot_be_built(tmp_path, matrix):
    plan = images.make_plan(matrix, matrix.get(CPU), root=tmp_path, rev=SHA, date=DATE)
    assert plan.lock_sha256 == ""
    with pytest.raises(images.ImageError, match="no lock"):
        images.build_command(plan, offline=True)


@needs_docker_dir
def test_build_command(plans):
    p = plans[CPU]
    cmd = images.build_command(p, offline=True)
    assert cmd[cmd.index("--network") + 1] == "none"
    assert cmd[cmd.index("-f") + 1] == "docker/Dockerfile" and cmd[-1] == "."
    assert [cmd[i + 1] for i, a in enumerate(cmd) if a == "-t"] == list(p.tags)
    online = images.build_command(p, offline=False)
    assert online[online.index("--network") + 1] == "host"


@needs_docker_dir
def test_every_build_arg_is_declared_in_the_dockerfile(plans):
    declared = set(re.findall(r"^ARG\s+([A-Z_][A-Z0-9_]*)", (ROOT / "docker" / "Dockerfile").read_text(), re.M))
    for cid, p in plans.items():
        unknown = set(p.build_args) - declared
        assert not unknown, f"{cid}: build args the Dockerfile does not declare: {unknown}"


@needs_docker_dir
def test_the_lock_install_passes_the_cells_index():
    """The Dockerfile's only install of the lock adds the cell's index (build arg TORCH_INDEX_URL)."""
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    installs = re.findall(r"pip install --require-hashes[^\n]*", dockerfile)
    assert len(installs) == 1 and '"$@"' in installs[0]
    assert 'set -- --extra-index-url "${TORCH_INDEX_URL}"' in dockerfile


@needs_docker_dir
def test_dockerignore_lets_through_what_the_dockerfile_copies():
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    for script in sorted(set(re.findall(r"(docker/[\w.]+\.(?:sh|py))", dockerfile))):
        assert f"!{script}" in ignore, f"{script} is COPYed but excluded by .dockerignore"
    assert "!docker/wheelhouse/" in ignore and ignore[0].strip() == "*" or "*" in ignore


@needs_docker_dir
def test_hadolint_ignores_are_justified():
    lines = (ROOT / ".hadolint.yaml").read_text().splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"\s*-\s*(DL\d{4}|SC\d{4})\b(.*)", line)
        if m:
            assert "#" in m[2] or (i and lines[i - 1].strip().startswith("#")), f"{m[1]} ignored without a reason"


def dockerfile_labels(text: str, args: dict[str, str]) -> dict[str, str]:
    """The runtime stage's LABEL instruction with the build arguments substituted (defaults where unset)."""
    defaults = dict(re.findall(r"^ARG\s+(\w+)=(.*)$", text, re.M))
    label = re.search(r"^LABEL (.*?)(?=\n\S|\Z)", text, re.M | re.S)[1]
    return {k: re.sub(r"\$\{(\w+)\}", lambda m: args.get(m[1], defaults.get(m[1], "")), v)
            for k, v in re.findall(r'([\w.-]+)="([^"]*)"', label)}


@needs_docker_dir
def test_dockerfile_labels_are_the_plans(plans):
    """The image's labels come from the build args through the Dockerfile's LABEL: every label of the plan
    is what the Dockerfile makes of the plan's args (docker/ci_images.sh checks the built images too)."""
    text = (ROOT / "docker" / "Dockerfile").read_text()
    for cid, p in plans.items():
        got = dockerfile_labels(text, p.build_args)
        assert {k: got.get(k) for k in p.labels} == p.labels, cid
    bad = text.replace('nsa.triton="${TRITON_VERSION}"', 'nsa.triton="${TORCH_VERSION}"')
    assert dockerfile_labels(bad, plans[CPU].build_args)["nsa.triton"] != plans[CPU].labels["nsa.triton"]


@needs_docker_dir
def test_localize_lock(tmp_path):
    sys.path.insert(0, str(ROOT / "docker"))
    try:
        import localize_lock
    finally:
        sys.path.remove(str(ROOT / "docker"))
    name = "flash_attn-2.8.3+cu12torch2.8cxx11abiTRUE-cp311-cp311-linux_x86_64.whl"
    url = f"https://h/x/{name.replace('+', '%2B')}"
    lock = f"torch==2.8.0 \\\n    --hash=sha256:aa\nflash-attn @ {url} \\\n    --hash=sha256:bb\n"
    with pytest.raises(SystemExit, match="not in the wheelhouse"):
        localize_lock.localize(lock, tmp_path)
    (tmp_path / name).write_bytes(b"")
    out = localize_lock.localize(lock, tmp_path)
    assert f"{tmp_path / name} \\\n    --hash=sha256:bb" in out and out.startswith("torch==2.8.0 \\")


def test_cli_plan_json_runs():
    res = subprocess.run(
        [sys.executable, "-m", "ci.images", "plan", CPU, "--json", "--repo", "r/nsa"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    assert f'"r/nsa:{CPU}"' in res.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "ci.images", "plan", "no-such-cell"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert bad.returncode == 2 and "unknown cell" in bad.stderr


def test_one_image_repository_derived_from_the_github_repository(monkeypatch):
    assert images.image_repo({}) == "ghcr.io/nsa-project/nsa" == f"ghcr.io/{images.REPOSITORY}"
    assert images.image_repo({"GITHUB_REPOSITORY": "Some-Org/NSA"}) == "ghcr.io/some-org/nsa"
    assert images.image_repo({"GITHUB_REPOSITORY": "o/r", "NSA_IMAGE_REPO": "Reg.example/X/y"}) == "reg.example/x/y"
    assert images.source_url({"GITHUB_REPOSITORY": "o/r"}) == "https://github.com/o/r"
    monkeypatch.setenv("GITHUB_REPOSITORY", "Fork-Owner/nsa")
    monkeypatch.delenv("NSA_IMAGE_REPO", raising=False)
    out = subprocess.run([sys.executable, "-m", "ci.images", "repo"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "ghcr.io/fork-owner/nsa"


def test_docs_name_the_one_image_repository_and_a_runnable_pull_command():
    """README and docs/images.md: the default repository (or the <owner>/<repo> pattern), no other
    ghcr.io/.../nsa name, no IMAGE placeholder in the README's run command."""
    default = images.image_repo({})
    readme = (ROOT / "README.md").read_text()
    cmd = (f"docker run --gpus all --shm-size 16g {default}:cu130-torch2.11-py312 "
           "nox --no-venv -s gpu_parity backward bench")
    assert cmd in readme, "README: the one command to pull and run the GPU suites"
    section = readme[readme.index("## GPU suites, images and CI"):]
    section = section[:section.index("\n## ", 3)]
    assert not re.search(r"\bIMAGE\b", section), "README: a placeholder IMAGE where the real name belongs"
    for doc in ("README.md", "docs/images.md", "docs/runners.md", "docs/gpu-suites.md"):
        names = set(re.findall(r"ghcr\.io/[\w<>.-]+/[\w<>.-]+", (ROOT / doc).read_text()))
        names -= {default, "ghcr.io/<owner>/<repo>", "ghcr.io/actions/actions-runner-controller-charts"}
        assert not names, f"{doc}: image names other than {default} or ghcr.io/<owner>/<repo>: {sorted(names)}"


def test_bake_target_names_are_valid_and_distinct(matrix):
    names = [images.bake_target(c.id) for c in matrix.cells]
    assert len(set(names)) == len(names) and all(re.fullmatch(r"[A-Za-z0-9_-]+", n) for n in names)
    assert images.bake_target("cu130-torch2.11-py312") == "cu130-torch2_11-py312"
