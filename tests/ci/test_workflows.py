"""The GitHub workflows, the inputs ci/github.py gives them, the action pins, and the workflow checks.

Tests that run the lint tools skip when the tools are absent (the CPU cell's venv has none), except
under `nox -s lint`, which installs requirements/locks/lint.txt and sets NSA_REQUIRE_LINT_TOOLS=1 so
that a missing tool fails instead. No test here needs torch or the network.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ci import github, images, lint  # noqa: E402
from ci.matrix import load  # noqa: E402

WORKFLOWS = ROOT / ".github" / "workflows"
REQUIRE_TOOLS = os.environ.get("NSA_REQUIRE_LINT_TOOLS") == "1"
SHA = "11bd71901bbe5b1630ceea73d27597364c9af683"


def need_tool(name: str) -> None:
    try:
        lint.find_tool(name)
    except lint.ToolMissing as exc:
        if REQUIRE_TOOLS:
            pytest.fail(str(exc))
        pytest.skip(f"{name} not installed here (run `nox -s lint`)")


def need_yaml():
    if REQUIRE_TOOLS:
        import yaml

        return yaml
    return pytest.importorskip("yaml", reason="pyyaml not installed here (run `nox -s lint`)")


# ------------------------------------------------------------------------------ matrices and build args


def run_step(workflow: str, job: str, step_id: str, env: dict[str, str]) -> str:
    """A workflow step's script, run here with bash (the runner's venv is this interpreter's)."""
    yaml = need_yaml()
    steps = yaml.safe_load((WORKFLOWS / workflow).read_text(encoding="utf-8"))["jobs"][job]["steps"]
    script = next(s["run"] for s in steps if s.get("id") == step_id).replace('"$RUNNER_TEMP/ci-venv/bin/python"',
                                                                             sys.executable)
    proc = subprocess.run(["bash", "-eo", "pipefail", "-c", script], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **env}, check=False)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.skipif(not shutil.which("jq"), reason="jq not installed here")
def test_images_matrix_is_every_cell_in_order_or_the_ones_asked(tmp_path):
    m = load()
    out = tmp_path / "out"
    for cells, want in (("", m.cells), ("cu130-torch2.11-py312,cpu-torch2.13-py311",
                                        [m.get("cu130-torch2.11-py312"), m.get("cpu-torch2.13-py311")])):
        out.write_text("")
        run_step("images.yml", "plan", "matrix", {"CELLS": cells, "GITHUB_OUTPUT": str(out)})
        name, _, value = out.read_text().strip().partition("=")
        assert name == "matrix" and json.loads(value) == {"include": [{"cell": c.id, "cpu_only": c.cpu_only}
                                                                       for c in want]}


def test_gpu_matrix_is_every_gpu_cell_on_each_gpu_it_was_built_for():
    m = load()
    out = github.gpu_matrix(m, m.cells)["include"]
    expected = {(c.id, gpu) for c in m.cells if not c.cpu_only
                for gpu, cc in github.GPU_CLASSES.items() if cc in c.gpu_archs}
    got = [(e["cell"], e["gpu"]) for e in out]
    assert len(got) == len(set(got)), "duplicate (cell, gpu) pairs: artifact names would collide"
    assert set(got) == expected
    assert {cid for cid, _ in expected} == {c.id for c in m.cells if not c.cpu_only}, "a GPU cell runs on no GPU"
    by = {(e["cell"], e["gpu"]): e for e in out}
    assert (by["cu121-torch2.4-py311", "a100"]["min_driver"], by["cu121-torch2.4-py311", "a100"]["cuda_label"]) == (
        "530.30.02", "cuda12")
    assert by["cu130-torch2.11-py312", "h100"]["min_driver_compat"] == "580.65.06"
    with pytest.raises(Exception, match="unknown GPU class"):
        github.gpu_matrix(m, m.cells, ["v100"])


def test_gpu_matrix_cli_matches_function():
    proc = subprocess.run([sys.executable, "-m", "ci.github", "gpu"], cwd=ROOT, capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 0 and len(proc.stdout.splitlines()) == 1, proc.stderr  # one line for $GITHUB_OUTPUT
    m = load()
    assert json.loads(proc.stdout) == github.gpu_matrix(m, m.cells)
    bad = subprocess.run([sys.executable, "-m", "ci.github", "gpu", "--gpus", "v100"], cwd=ROOT,
                         capture_output=True, text=True, check=False)
    assert bad.returncode == 2 and "unknown GPU class(es) ['v100']" in bad.stderr


def test_images_lock_pins_every_entry_by_digest():
    m = load()
    cells = [m.get("cu121-torch2.4-py311"), m.get("cu130-torch2.11-py312")]
    digest = "sha256:" + "a" * 64
    lock = {"cu130-torch2.11-py312": {"image": "ghcr.io/o/r", "digest": digest}}
    with pytest.raises(Exception, match=r"no valid digest for cell\(s\) \['cu121-torch2.4-py311'\]"):
        github.attach_images(github.gpu_matrix(m, cells), lock)
    lock["cu121-torch2.4-py311"] = {"image": "ghcr.io/o/r", "digest": "latest"}
    with pytest.raises(Exception, match="cu121-torch2.4-py311"):
        github.attach_images(github.gpu_matrix(m, cells), lock)
    lock["cu121-torch2.4-py311"]["digest"] = digest
    out = github.gpu_matrix(m, cells)
    github.attach_images(out, lock)
    assert all((e["image"], e["digest"]) == ("ghcr.io/o/r", digest) for e in out["include"])


def test_images_workflow_bakes_the_plans_build_args_for_every_cell():
    """images.yml builds from `python -m ci.images bake CELL`: its args are exactly the plan's, every cell."""
    yaml = need_yaml()
    steps = yaml.safe_load((WORKFLOWS / "images.yml").read_text(encoding="utf-8"))["jobs"]["build"]["steps"]
    runs = "\n".join(s.get("run", "") for s in steps)
    assert '-m ci.images bake "$CELL" > "$RUNNER_TEMP/bake.json"' in runs
    assert 'docker buildx bake -f "$RUNNER_TEMP/bake.json"' in runs
    assert not any(str(s.get("uses", "")).startswith("docker/build-push-action@") for s in steps)
    m = load()
    proc = subprocess.run([sys.executable, "-m", "ci.images", "bake"], cwd=ROOT, capture_output=True, text=True,
                          check=True)
    bake = json.loads(proc.stdout)
    assert bake["group"]["default"]["targets"] == [images.bake_target(c.id) for c in m.cells]
    for cell in m.cells:
        target = bake["target"][images.bake_target(cell.id)]
        assert target["args"] == images.make_plan(m, cell).build_args, cell.id
        assert (target["dockerfile"], target["target"], "tags" in target) == ("docker/Dockerfile", "runtime", False)


def test_every_lock_install_passes_its_cells_index():
    """Workflows install cell locks only through nox sessions (ci/sessions/install.py adds the cell's index) or the
    Docker build (build arg TORCH_INDEX_URL); a direct `pip install -r <cell lock>` must carry an index."""
    from ci.sessions.install import pip_args

    m = load()
    for cell in m.cells:
        args = pip_args(m, cell)
        url = m.index_url(cell)
        assert (args[args.index("--extra-index-url") + 1] == url) if url else "--extra-index-url" not in args
    cell_locks = {f"requirements/locks/{c.id}.txt" for c in m.cells}
    for wf in sorted(WORKFLOWS.glob("*.yml")):
        for line in wf.read_text(encoding="utf-8").replace("\\\n", " ").splitlines():
            if "pip install" in line and any(lock in line for lock in cell_locks):
                assert "--extra-index-url" in line or "pypi" in line, f"{wf.name}: {line.strip()}"
            if re.search(r"pip install .*-r requirements/locks/\$", line):
                pytest.fail(f"{wf.name}: installs a lock chosen at run time without its index: {line.strip()}")


# ------------------------------------------------------------------------------- nox sessions called


def nox_sessions() -> set[str]:
    """Session names defined in noxfile.py (ast: no nox import needed): decorated functions and the GPU
    suites registered from the GPU_SUITES table, cross-checked with `nox --list --json` when nox is installed."""
    tree = ast.parse((ROOT / "noxfile.py").read_text(encoding="utf-8"))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and [ast.unparse(x) for x in node.targets] == ["GPU_SUITES"]:
            names.update(ast.literal_eval(node.value))
        if not isinstance(node, ast.FunctionDef):
            continue
        for dec in node.decorator_list:
            call = dec if isinstance(dec, ast.Call) else None
            target = call.func if call else dec
            if ast.unparse(target) not in ("nox.session", "session"):
                continue
            name = node.name
            for kw in call.keywords if call else []:
                if kw.arg == "name" and isinstance(kw.value, ast.Constant):
                    name = kw.value.value
            names.add(name)
    return names


def workflow_nox_calls() -> dict[str, set[str]]:
    """session -> {workflow:job} for every `nox ... -s A [B ...]` in a run: step."""
    calls: dict[str, set[str]] = {}
    for wf in sorted(WORKFLOWS.glob("*.yml")):
        for line in wf.read_text(encoding="utf-8").splitlines():
            m = re.search(r"(?:\bnox\b|\$\{?NSA_NOX\}?)(.*?)\s(?:-s|--sessions?)\s+(.*)$", line)
            if not m or line.strip().startswith("#"):
                continue
            rest = m.group(2).split(" --", 1)[0].split(";")[0].split("&&")[0].split("#")[0]
            words = [w.strip("'\"") for w in rest.split()]
            for w in words:
                if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", w):
                    break
                calls.setdefault(w, set()).add(wf.name)
    return calls


def test_every_nox_session_a_workflow_calls_exists():
    calls = workflow_nox_calls()
    expected = {"lint", "tests", "cpu_smoke", "lock", "images", "gpu_parity", "backward", "bench", "publish"}
    assert expected <= set(calls), f"parser missed a session: found {sorted(calls)}"
    defined = nox_sessions()
    try:
        proc = subprocess.run(
            # --json lists only the selected sessions: select every defined one.
            [sys.executable, "-m", "nox", "--list", "--json", "-s", *sorted(defined)], cwd=ROOT,
            capture_output=True, text=True,
            check=False, timeout=120,
        )
        if proc.returncode == 0:
            listed = {s["name"].split("(")[0].split("-")[0] for s in json.loads(proc.stdout)}
            assert listed >= defined, f"nox --list misses {sorted(defined - listed)}"
    except FileNotFoundError:
        pass
    missing = {s: sorted(w) for s, w in calls.items() if s not in defined}
    assert not missing, "workflows call nox sessions that noxfile.py does not define: " + ", ".join(
        f"{s} (in {', '.join(w)})" for s, w in sorted(missing.items())
    )


def test_session_parser_sees_seeded_missing_session(tmp_path, monkeypatch):
    wf_dir = tmp_path / "wf"
    wf_dir.mkdir()
    (wf_dir / "x.yml").write_text("jobs:\n  a:\n    steps:\n      - run: nox -s lint no_such_session -- x\n")
    monkeypatch.setattr(sys.modules[__name__], "WORKFLOWS", wf_dir)
    calls = workflow_nox_calls()
    assert set(calls) == {"lint", "no_such_session"}
    assert "no_such_session" not in nox_sessions()


# ------------------------------------------------------------------------------------------- the gate


def gate_script() -> str:
    yaml = need_yaml()
    doc = yaml.safe_load((WORKFLOWS / "ci.yml").read_text(encoding="utf-8"))
    gate = doc["jobs"]["gate"]
    assert gate["if"] == "${{ always() }}"
    assert set(gate["needs"]) == set(doc["jobs"]) - {"gate"}, "the gate must need every other job"
    (step,) = [s for s in gate["steps"] if "run" in s]
    return step["run"]


@pytest.mark.parametrize(
    ("results", "ok"),
    [
        ({"lint": "success", "tests": "success"}, True),
        ({"lint": "success", "tests": "failure"}, False),
        ({"lint": "cancelled", "tests": "success"}, False),
        ({"lint": "skipped", "tests": "success"}, False),
    ],
)
def test_gate_fails_unless_every_job_succeeded(results, ok):
    needs = json.dumps({job: {"result": r, "outputs": {}} for job, r in results.items()})
    proc = subprocess.run(
        ["bash", "-c", gate_script()], env={**os.environ, "NEEDS": needs}, capture_output=True, text=True,
        check=False,
    )
    assert (proc.returncode == 0) == ok, proc.stdout + proc.stderr


# ------------------------------------------------------------------------------------- workflow rules


def test_gpu_workflow_contract():
    need_yaml()
    doc = lint._load_yaml(WORKFLOWS / "gpu.yml")
    assert set(doc["on"]) == {"push", "schedule", "workflow_dispatch"}, "no pull-request-like trigger"
    assert {"pr", "sha"} <= set(doc["on"]["workflow_dispatch"]["inputs"])
    assert doc["permissions"] == {"contents": "read"}
    # main's runs never cancel each other (a group per run id); a newer dispatch for a PR supersedes the older.
    group = " ".join(doc["concurrency"]["group"].split())
    assert "format('run-{0}', github.run_id)" in group and "format('pr-{0}', inputs.pr)" in group
    cancel = "${{ github.event_name == 'workflow_dispatch' && inputs.pr != '' }}"
    assert doc["concurrency"]["cancel-in-progress"] == cancel
    plan, gpu, known = doc["jobs"]["plan"], doc["jobs"]["gpu"], doc["jobs"]["known-good"]
    commit = next(s for s in plan["steps"] if s.get("id") == "commit")["run"]
    for needle in ('gh api "repos/$REPO/pulls/$PR"', '"$head_repo" != "$REPO"', '"$head_sha" != "$WANT"'):
        assert needle in commit, f"the PR-head check lost {needle!r}"
    verify = "\n".join(s.get("run", "") for s in plan["steps"])
    flat = " ".join(verify.replace("\\\n", " ").split())
    assert ('gh attestation verify "oci://$image@$digest" --repo "$REPO" --signer-workflow '
            '"$REPO/.github/workflows/images.yml" --source-ref refs/heads/main') in flat
    assert "python -m ci.images repo" in verify and plan["permissions"]["attestations"] == "read"
    assert all(lint.main_guarded(job) for job in (plan, gpu)) and gpu["environment"] == "gpu"
    assert gpu["runs-on"] == "${{ matrix.runs_on }}" and gpu["name"].startswith("gpu ") and "container" not in gpu
    assert (gpu["env"]["NSA_IMAGE"], gpu["env"]["NSA_IMAGE_DIGEST"]) == ("${{ matrix.image }}", "${{ matrix.digest }}")
    checkout = next(s for s in gpu["steps"] if str(s.get("uses", "")).startswith("actions/checkout@"))
    assert checkout["with"]["ref"] == "${{ needs.plan.outputs.sha }}"
    docker = next(s["run"] for s in gpu["steps"] if "docker run" in s.get("run", ""))
    assert '--gpus "device=$gpu"' in docker and "--shm-size 16g" in docker and "--ipc" not in docker
    assert '"$NSA_IMAGE@$NSA_IMAGE_DIGEST" "$@"' in docker and "NSA_RUNNER_GPU" in docker
    assert " ".join(known["if"].split()) == (
        "success() && needs.gpu.result == 'success' && github.ref == 'refs/heads/main' && "
        "(github.event_name == 'push' || github.event_name == 'schedule')")
    assert set(known["needs"]) == {"plan", "gpu"} and known["permissions"] == {"contents": "read"}
    assert doc["jobs"]["status"]["permissions"] == {"statuses": "write"}
    m = load()
    entries = github.gpu_matrix(m, m.cells)["include"]
    for e in entries:
        assert e["runs_on"] == ["self-hosted", "linux", "x64", "gpu", e["gpu"], e["cuda_label"]]
    declared = set(lint._load_yaml(ROOT / ".github" / "actionlint.yaml")["self-hosted-runner"]["labels"])
    used = {label for e in entries for label in e["runs_on"]}
    assert used - {"self-hosted", "linux", "x64"} <= declared, "declare every runner label in actionlint.yaml"
    assert github.runs_on("h100", "cuda13", scale_sets=True) == ["nsa-h100-cuda13"]
    upload = [s for s in gpu["steps"] if str(s.get("uses", "")).startswith("actions/upload-artifact@")]
    name = upload[0]["with"]["name"]
    assert "${{ matrix.cell }}" in name and "${{ matrix.gpu }}" in name
    runs = [s.get("run", "") for s in gpu["steps"]]
    assert any("GITHUB_STEP_SUMMARY" in r and "summary.md" in r for r in runs)


def test_images_workflow_pushes_by_digest_and_moves_tags_only_from_main_after_the_checks():
    need_yaml()
    doc = lint._load_yaml(WORKFLOWS / "images.yml")
    steps = doc["jobs"]["build"]["steps"]
    names = [s.get("name") or str(s.get("uses", "")).split("@")[0] for s in steps]
    order = [names.index(n) for n in ("Build and push by digest (bake; SBOM and max-mode provenance from BuildKit)",
                                      next(n for n in names if n.startswith("Check the pushed digest")),
                                      "actions/attest-build-provenance", "Move the tags (main; release tags)")]
    assert order == sorted(order), "build, check, attest, then move tags"
    build, check, tag = (steps[order[i]]["run"] for i in (0, 1, 3))
    assert "push-by-digest=true" in build and "-t " not in build and "--provenance=mode=max" in build
    for needle in ('cmp - "requirements/locks/$CELL.txt"', "nsa_env --check-lock", "pip check", "import torch",
                   "run python -m nsa_env\n"):
        assert needle in check, needle
    assert steps[order[3]]["if"] == "${{ github.ref == 'refs/heads/main' || startsWith(github.ref, 'refs/tags/v') }}"
    assert 'tags=(-t "$REPO:$CELL-$REF_NAME")' in tag and 'docker buildx imagetools create "${tags[@]}"' in tag
    attest = steps[order[2]]["with"]
    assert attest["subject-digest"] == "${{ steps.build.outputs.digest }}" and attest["push-to-registry"] is True


def test_every_pip_install_is_followed_by_pip_check(tmp_path):
    """After every pip install of a workflow step or Dockerfile RUN, a `pip check` (before the image's checks)."""
    def unchecked(text: str) -> list[str]:
        blocks = re.split(r"\n(?=\s*(?:- name:|- run:|run:|RUN |- uses:))", text.replace("\\\n", " "))
        return [b.strip()[:80] for b in blocks if re.search(r"pip install(?! --upgrade)", b)
                and not re.search(r"pip install[\s\S]*pip check", b)]
    files = [*WORKFLOWS.glob("*.yml"), ROOT / "docker" / "Dockerfile"]
    assert {f.name: unchecked(f.read_text()) for f in files} == {f.name: [] for f in files}
    seeded = "      - run: |\n          python -m pip install -r requirements/bootstrap.txt\n          nox -s tests\n"
    assert unchecked(seeded), "the check missed a seeded install without pip check"


def test_policy_passes_on_our_workflows():
    need_yaml()
    result = lint.check_policy(ROOT, lint.workflow_files(ROOT))
    assert result.ok, result.output


BAD_WORKFLOW = f"""\
name: bad
on:
  pull_request_target:
  pull_request:
jobs:
  build:
    runs-on: [self-hosted, linux, x64, gpu, h100]
    steps:
      - uses: actions/checkout@v4
        with:
          ref: ${{{{ github.event.pull_request.head.sha }}}}
      - uses: actions/setup-python@{SHA}
      - run: echo "${{{{ github.event.pull_request.title }}}}"
"""


def seed(tmp_path: Path, text: str = BAD_WORKFLOW, name: str = "bad.yml") -> Path:
    wf = tmp_path / ".github" / "workflows"
    wf.mkdir(parents=True, exist_ok=True)
    for cfg in ("actionlint.yaml", "zizmor.yml"):
        src = ROOT / ".github" / cfg
        if src.exists():
            (tmp_path / ".github" / cfg).write_text(src.read_text())
    if (ROOT / ".yamllint").exists():
        (tmp_path / ".yamllint").write_text((ROOT / ".yamllint").read_text())
    (wf / name).write_text(text)
    return wf / name


def test_policy_fails_on_seeded_bad_workflow(tmp_path):
    need_yaml()
    problems = "\n".join(lint.check_policy_file(seed(tmp_path)))
    for expected in (
        "pull_request_target is forbidden",
        "no top-level `permissions:`",
        "no `concurrency:`",
        "no timeout-minutes",
        "in a workflow triggered by ['pull_request', 'pull_request_target']",
        "without `if: github.ref == 'refs/heads/main'`",
        "not pinned by a full 40-hex commit SHA",
        "persist-credentials: false",
        "checks out the PR head ref",
    ):
        assert expected in problems, f"policy missed {expected!r}:\n{problems}"


FORK_GPU_WORKFLOW = f"""\
name: fork-added
on: pull_request
permissions:
  contents: read
concurrency:
  group: x
jobs:
  pwn:
    if: github.ref == 'refs/heads/main'
    runs-on: [self-hosted, gpu]
    timeout-minutes: 5
    steps:
      - uses: actions/checkout@{SHA}
        with:
          persist-credentials: false
      - run: nvidia-smi
"""


def test_policy_rejects_a_fork_added_gpu_workflow(tmp_path):
    """A workflow a fork adds, triggered by pull_request, with a job on our GPU labels: even with the main guard."""
    need_yaml()
    problems = lint.check_policy_file(seed(tmp_path, FORK_GPU_WORKFLOW, "fork.yml"))
    assert problems == ["fork.yml: job 'pwn': runs on self-hosted/GPU runners ['self-hosted', 'gpu'] in a workflow "
                        "triggered by ['pull_request']: pull request code would reach them; accepted: GPU jobs only "
                        "in workflows without pull-request-like triggers (gpu.yml, dispatched for a PR head)"]
    for runs_on in ("nsa-h100-cuda13", "${{ matrix.runs_on }}", "{group: gpu}"):
        text = FORK_GPU_WORKFLOW.replace("[self-hosted, gpu]", runs_on)
        assert lint.check_policy_file(seed(tmp_path, text, "fork.yml")), f"runs-on {runs_on} passed"
    hosted = FORK_GPU_WORKFLOW.replace("[self-hosted, gpu]", "ubuntu-latest")
    assert lint.check_policy_file(seed(tmp_path, hosted, "fork.yml")) == []


@pytest.mark.parametrize("event", ["pull_request", "pull_request_target", "issue_comment", "merge_group"])
def test_policy_rejects_gpu_yml_with_a_pull_request_like_trigger(tmp_path, event):
    need_yaml()
    text = (WORKFLOWS / "gpu.yml").read_text(encoding="utf-8")
    assert "on:\n  push:\n" in text
    problems = lint.check_policy_file(seed(tmp_path, text.replace("on:\n  push:\n", f"on:\n  {event}:\n  push:\n"),
                                           "gpu.yml"))
    assert any(p.startswith("gpu.yml: job 'gpu': runs on self-hosted/GPU runners") and f"'{event}'" in p
               for p in problems), problems


@pytest.mark.parametrize(("cond", "ok"), [
    ("github.ref == 'refs/heads/main'", True),
    ("${{ github.ref == 'refs/heads/main' && needs.plan.result == 'success' }}", True),
    ("always() && github.ref == 'refs/heads/main'", False),  # the guard must come first
    ("github.ref == 'refs/heads/main' || github.event_name == 'workflow_dispatch'", False),
    ("github.ref == 'refs/heads/main' && x || y", False),
    ("github.ref == 'refs/heads/mainline'", False),
    ("", False),
])
def test_gpu_jobs_need_the_main_guard_first(tmp_path, cond, ok):
    need_yaml()
    doc = lint._load_yaml(WORKFLOWS / "gpu.yml")
    doc["jobs"]["gpu"]["if"] = cond
    assert lint.main_guarded(doc["jobs"]["gpu"]) is ok
    yaml = need_yaml()
    problems = lint.check_policy_file(seed(tmp_path, yaml.safe_dump(doc, sort_keys=False), "gpu.yml"))
    assert any("job 'gpu'" in p and "without `if: github.ref == 'refs/heads/main'`" in p for p in problems) is not ok


def test_lint_passes_on_our_workflows():
    for tool in ("actionlint", "check-jsonschema", "zizmor", "yamllint"):
        need_tool(tool)
    need_yaml()
    results = lint.run_checks(ROOT, ["actionlint", "schema", "zizmor", "yamllint", "policy"])
    failed = {r.name: r.output for r in results if not r.ok}
    assert not failed, failed


@pytest.mark.parametrize(
    ("check", "tool", "text", "expect"),
    [
        ("zizmor", "zizmor", BAD_WORKFLOW, "dangerous-triggers"),
        ("zizmor", "zizmor", BAD_WORKFLOW, "unpinned-uses"),
        ("zizmor", "zizmor", BAD_WORKFLOW, "template-injection"),
        # an unknown runner label and a job output of a job that does not exist
        (
            "actionlint", "actionlint",
            "on: push\npermissions: {}\njobs:\n  a:\n    runs-on: [self-hosted, v100]\n"
            "    steps:\n      - run: echo ${{ needs.nope.outputs.x }}\n",
            "label",
        ),
        # `step:` is not a job key; `runs-on` missing
        ("schema", "check-jsonschema", "on: push\njobs:\n  a:\n    step:\n      - run: echo\n", "validat"),
        ("yamllint", "yamllint", "on: push\njobs:\n  a:   \n    runs-on: x\n", "trailing-spaces"),
    ],
)
def test_lint_fails_on_seeded_bad_workflow(tmp_path, check, tool, text, expect):
    need_tool(tool)
    seed(tmp_path, text)
    (result,) = lint.run_checks(tmp_path, [check])
    assert not result.ok, f"{check} passed a seeded bad workflow:\n{result.output}"
    assert expect in result.output, result.output


def test_hadolint_fails_on_seeded_bad_dockerfile(tmp_path):
    need_tool("hadolint")
    (tmp_path / "docker").mkdir()
    dockerfile = tmp_path / "docker" / "Dockerfile"
    dockerfile.write_text("FROM ubuntu:latest\nRUN apt-get update && apt-get install -y curl\n")
    (result,) = lint.run_checks(tmp_path, ["hadolint"])
    assert not result.ok and "DL3007" in result.output, result.output
    dockerfile.write_text('FROM debian:bookworm-slim\nCMD ["true"]\n')
    (result,) = lint.run_checks(tmp_path, ["hadolint"])
    assert result.ok, result.output


def test_lint_cli_exit_code(tmp_path):
    need_yaml()
    seed(tmp_path)
    proc = subprocess.run(
        [sys.executable, "ci/lint.py", "--root", str(tmp_path), "--only", "policy"],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )
    assert proc.returncode == 1 and "FAIL  policy" in proc.stdout, proc.stdout + proc.stderr


# ------------------------------------------------------------------------------------------ rehearsal


def test_rehearsal_copy_keeps_every_run_step_and_drops_remote_setup_actions():
    need_yaml()
    from ci.sessions import rehearse

    doc = lint._load_yaml(WORKFLOWS / "ci.yml")
    out = rehearse.offline_copy(doc, ["lint", "tests"])
    assert set(out["jobs"]) == {"lint", "tests"}
    for job in out["jobs"].values():
        uses = [str(s["uses"]).split("@")[0] for s in job["steps"] if "uses" in s]
        assert uses == ["actions/checkout"]
    with pytest.raises(rehearse.RehearsalError, match="no job"):
        rehearse.offline_copy(doc, ["nope"])


def test_act_plans_no_gpu_job_for_a_fork_or_same_repo_pull_request(tmp_path):
    """`act pull_request --list` with a fork's and a same-repository PR's event, over our workflows: no job on
    self-hosted/GPU runners. Seeded: a fork-added GPU workflow and gpu.yml with a pull_request trigger."""
    need_tool("act")
    need_yaml()
    from ci.sessions import rehearse

    for kind, pr in rehearse.PULL_REQUESTS.items():
        assert rehearse.pr_gpu_jobs(WORKFLOWS, pr) == [], kind
    wf = seed(tmp_path, FORK_GPU_WORKFLOW, "fork.yml").parent
    gpu = (WORKFLOWS / "gpu.yml").read_text(encoding="utf-8")
    (wf / "gpu.yml").write_text(gpu.replace("on:\n  push:\n", "on:\n  pull_request:\n  push:\n"))
    for kind, pr in rehearse.PULL_REQUESTS.items():
        assert rehearse.pr_gpu_jobs(wf, pr) == ["fork.yml:pwn", "gpu.yml:gpu"], kind


def test_act_only_a_green_push_or_nightly_run_of_main_publishes():
    """gpu.yml's jobs run on this host under act for each scenario (failed, cancelled legs; dispatches of main,
    of a PR head, from a branch): known-good runs only after green push/nightly runs of main. Seeded: the old
    `always() && needs.gpu.result != 'skipped'` gate, a gate without the event check, a GPU job without the
    main guard."""
    need_tool("act")
    from ci.sessions import rehearse

    doc = lint._load_yaml(WORKFLOWS / "gpu.yml")
    assert rehearse.publish_rehearsal(doc) == []
    old = {**doc, "jobs": {**doc["jobs"], "known-good": {
        **doc["jobs"]["known-good"], "if": "${{ always() && !cancelled() && needs.gpu.result != 'skipped' }}"}}}
    assert {p.split(":")[0] for p in rehearse.publish_rehearsal(old)} == {
        "push to main, a leg failed", "push to main, a leg cancelled", "dispatch on main", "dispatch of a PR head",
        "dispatch of a PR head, red"}
    any_event = {**doc, "jobs": {**doc["jobs"], "known-good": {
        **doc["jobs"]["known-good"], "if": "success() && needs.gpu.result == 'success'"}}}
    assert {p.split(":")[0] for p in rehearse.publish_rehearsal(any_event)} == {
        "dispatch on main", "dispatch of a PR head"}
    unguarded = {**doc, "jobs": {**doc["jobs"], "plan": {k: v for k, v in doc["jobs"]["plan"].items() if k != "if"},
                                 "gpu": {k: v for k, v in doc["jobs"]["gpu"].items() if k != "if"}}}
    assert [p.split(":")[0] for p in rehearse.publish_rehearsal(unguarded)] == ["dispatch from a branch"]


# ------------------------------------------------------------------------------------ action pins


def test_no_action_runs_on_node20_or_an_unrecorded_commit():
    facts = lint.load_action_facts(ROOT)
    assert facts, ".github/actions.toml records the pinned actions"
    for pin, fact in facts.items():
        assert re.fullmatch(r"[\w.-]+/[\w.-]+@[0-9a-f]{40}", pin), pin
        assert fact["runs_using"] in ("node24", "composite", "docker"), f"{pin}: {fact['runs_using']}"
        assert fact.get("checked"), f"{pin}: say how its facts were established"
    used = set()
    for wf in lint.workflow_files(ROOT):
        assert lint.check_action_pins(wf, facts) == [], wf.name
        used |= {f"{m[1]}@{m[2]}" for line in wf.read_text().splitlines() if (m := lint.USES_LINE.match(line))}
    inner = {i for f in facts.values() for i in f.get("runs_inner", [])}
    assert set(facts) - used - inner == set(), "facts recorded for pins no workflow uses"


def test_action_pin_check_fails_on_node20_unrecorded_and_mislabelled_pins(tmp_path):
    old = "actions/checkout@11bd71901bbe5b1630ceea73d27597364c9af683"
    facts = {**lint.load_action_facts(ROOT),
             old: {"repo": "actions/checkout", "version": "v4.2.2", "runs_using": "node20"}}
    wf = tmp_path / "x.yml"
    wf.write_text(
        "jobs:\n  a:\n    steps:\n"
        f"      - uses: {old} # v4.2.2\n"
        "      - uses: actions/setup-python@a309ff8b426b58ec0e2a45f0f869d46889d02405 # v6.0.0\n"
        "      - uses: someone/else@" + "b" * 40 + " # v1\n"
        "      - uses: ./.github/actions/local\n"
    )
    problems = "\n".join(lint.check_action_pins(wf, facts))
    assert "actions/checkout@11bd71901bbe5b1630ceea73d27597364c9af683 runs on node20" in problems
    assert "is v6.2.0, but its comment says 'v6.0.0'" in problems
    assert "someone/else@" + "b" * 40 + " is not recorded" in problems
    assert "local" not in problems
    composite = {**facts, old: {**facts[old], "runs_using": "composite", "runs_inner": ["x/y@" + "c" * 40]}}
    assert "runs x/y@" in "\n".join(lint.check_action_pins(wf, composite))


def test_dependency_updates_cover_actions_locks_and_base_images():
    config = json.loads((ROOT / ".github" / "renovate.json").read_text())
    assert {"github-actions", "pip_requirements", "custom.regex"} <= set(config["enabledManagers"])
    # Renovate edits the lock inputs; the locks are regenerated (`nox -s lock`), never edited by a manager.
    inputs = [re.compile(p.strip("/")) for p in config["pip_requirements"]["managerFilePatterns"]]
    assert any(p.search("requirements/test.in") for p in inputs) and "requirements/locks/**" in config["ignorePaths"]
    (regex,) = config["customManagers"]
    assert "matrix" in regex["managerFilePatterns"][0] and regex["datasourceTemplate"] == "docker"
    pattern = re.compile(regex["matchStrings"][0].replace("(?<", "(?P<"))
    text = (ROOT / "requirements" / "matrix.toml").read_text()
    found = {(m["depName"], m["currentValue"]) for m in pattern.finditer(text)}
    m = load()
    assert found == {tuple(i.split(":", 1)) for c in m.cells for i in (c.base_image, c.runtime_image)}


def test_each_session_lists_as_one_whole_sentence():
    """`nox -l` shows the first line of each session's docstring: it must be a sentence of its own (ending in a
    period, not cut off mid-sentence), short enough for one terminal line."""
    tree = ast.parse((ROOT / "noxfile.py").read_text(encoding="utf-8"))
    firsts = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and [ast.unparse(x) for x in node.targets] == ["GPU_SUITES"]:
            firsts.update({k: v.splitlines()[0] for k, v in ast.literal_eval(node.value).items()})
        if isinstance(node, ast.FunctionDef) and any("session" in ast.unparse(d) for d in node.decorator_list):
            firsts[node.name] = (ast.get_docstring(node) or "").splitlines()[0] if ast.get_docstring(node) else ""
    assert set(nox_sessions()) <= set(firsts)
    bad = {name: line for name, line in firsts.items() if not line.endswith(".") or len(line) > 118}
    assert not bad, f"`nox -l` would cut or run on these descriptions: {bad}"
