"""The GitHub workflows, their matrix script and their checks (issue 7).

Tests that run the lint tools skip when the tools are absent (the CPU cell's venv has none), except
under `nox -s lint`, which installs requirements/locks/lint.txt and sets NSA_REQUIRE_LINT_TOOLS=1 so
that a missing tool fails instead. No test here needs torch or the network.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ci import gh_matrix, lint  # noqa: E402

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

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


# ------------------------------------------------------------------------------------- matrix script


def raw_cells() -> list[dict]:
    data = tomllib.loads((ROOT / "requirements" / "matrix.toml").read_text(encoding="utf-8"))
    cells = data.get("cell", data.get("cells"))
    assert isinstance(cells, list) and cells, "requirements/matrix.toml has no [[cell]] tables"
    return cells


def test_images_matrix_is_every_cell_in_order():
    out = gh_matrix.images_matrix(gh_matrix.load_cells())
    assert [e["cell"] for e in out["include"]] == [c["id"] for c in raw_cells()]
    assert {e["cell"]: e["cpu_only"] for e in out["include"]} == {
        c["id"]: bool(c["cpu_only"]) for c in raw_cells()
    }


def test_gpu_matrix_is_every_gpu_cell_on_each_gpu_it_was_built_for():
    out = gh_matrix.gpu_matrix(gh_matrix.load_cells())["include"]
    expected = set()
    for c in raw_cells():
        if c["cpu_only"]:
            continue
        for gpu, cc in gh_matrix.GPU_CLASSES.items():
            if cc in [str(a) for a in c["gpu_archs"]]:
                expected.add((c["id"], gpu))
    got = [(e["cell"], e["gpu"]) for e in out]
    assert len(got) == len(set(got)), "duplicate (cell, gpu) pairs: artifact names would collide"
    assert set(got) == expected
    assert {cid for cid, _ in expected} == {c["id"] for c in raw_cells() if not c["cpu_only"]}, (
        "a GPU cell runs on no GPU class"
    )
    for e in out:
        assert e["cuda_label"] == "cuda" + e["cuda"].split(".")[0]
        assert re.fullmatch(r"\d+\.\d+(\.\d+)?", e["min_driver"])


def test_loader_and_plain_toml_agree_on_the_cells():
    via_loader = gh_matrix.load_cells()
    plain = gh_matrix.load_cells(use_loader=False)
    assert [c["id"] for c in via_loader] == [c["id"] for c in plain]
    assert gh_matrix.gpu_matrix(via_loader) == gh_matrix.gpu_matrix(plain)


def test_gpu_matrix_cli_matches_function(tmp_path):
    gh_out = tmp_path / "gh_output"
    env = {**os.environ, "GITHUB_OUTPUT": str(gh_out)}
    proc = subprocess.run(
        [sys.executable, "ci/gh_matrix.py", "gpu", "--github-output", "matrix"],
        cwd=ROOT, env=env, capture_output=True, text=True, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    name, _, value = gh_out.read_text().strip().partition("=")
    assert name == "matrix"
    assert json.loads(value) == gh_matrix.gpu_matrix(gh_matrix.load_cells())


FIXTURE = """
[[cell]]
id = "cpu-x"
python = "3.11"
cuda = "none"
cpu_only = true
torch = "2.13.0+cpu"
gpu_archs = []

[[cell]]
id = "cu130-h"
python = "3.12"
cuda = "13.0"
cpu_only = false
torch = "2.11.0"
triton = "3.6.0"
gpu_archs = ["9.0"]

[[cell]]
id = "cu121-a"
python = "3.11"
cuda = "cu121"
cpu_only = false
torch = "2.4.1"
gpu_archs = "8.0;8.6"
"""


def fixture_cells(tmp_path, text=FIXTURE):
    p = tmp_path / "matrix.toml"
    p.write_text(text)
    return gh_matrix._cells_from_toml(p)


def test_gpu_matrix_pairs_cells_with_their_archs_and_drivers(tmp_path):
    out = gh_matrix.gpu_matrix(fixture_cells(tmp_path))["include"]
    assert [(e["cell"], e["gpu"]) for e in out] == [("cu130-h", "h100"), ("cu121-a", "a100")]
    h, a = out
    assert (h["cuda"], h["cuda_label"], h["min_driver"], h["min_driver_compat"]) == (
        "13.0", "cuda13", "580.65.06", "580.65.06",
    )
    assert (a["cuda"], a["cuda_label"], a["min_driver"], a["min_driver_compat"]) == (
        "12.1", "cuda12", "530.30.02", "525.60.13",
    )
    assert gh_matrix.min_driver("12.8") == ("570.26", "525.60.13")
    assert gh_matrix.min_driver("12.7")[1] == "525.60.13"
    with pytest.raises(gh_matrix.MatrixError, match="unknown GPU class"):
        gh_matrix.gpu_matrix(fixture_cells(tmp_path), ["v100"])


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.replace('id = "cu121-a"', 'id = "cu130-h"'), "duplicate cell id"),
        (lambda t: t.replace('cuda = "cu121"', 'cuda = "twelve"'), "CUDA version"),
        (lambda t: t.replace('cuda = "cu121"', 'cuda = "11.8"'), "no known driver floor"),
        (lambda t: t.replace('gpu_archs = "8.0;8.6"', 'gpu_archs = ["ampere"]'), "GPU arch"),
    ],
)
def test_gpu_matrix_rejects_bad_cells(tmp_path, edit, message):
    p = tmp_path / "matrix.toml"
    p.write_text(edit(FIXTURE))
    with pytest.raises(gh_matrix.MatrixError, match=message):
        gh_matrix.gpu_matrix(gh_matrix.load_cells(p, use_loader=False))



def test_images_lock_pins_every_entry_by_digest(tmp_path):
    m = gh_matrix.gpu_matrix(fixture_cells(tmp_path))
    digest = "sha256:" + "a" * 64
    lock = {"cu130-h": {"image": "ghcr.io/o/nsa", "digest": digest}}
    with pytest.raises(gh_matrix.MatrixError, match=r"no valid digest for cell\(s\) \['cu121-a'\]"):
        gh_matrix.attach_images(m, lock)
    lock["cu121-a"] = {"image": "ghcr.io/o/nsa", "digest": "latest"}
    with pytest.raises(gh_matrix.MatrixError, match="cu121-a"):
        gh_matrix.attach_images(gh_matrix.gpu_matrix(fixture_cells(tmp_path)), lock)
    lock["cu121-a"]["digest"] = digest
    m = gh_matrix.gpu_matrix(fixture_cells(tmp_path))
    gh_matrix.attach_images(m, lock)
    assert all(e["image"] == f"ghcr.io/o/nsa@{digest}" for e in m["include"])


def test_build_args_only_those_the_dockerfile_declares(tmp_path):
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text("ARG BUILD_BASE=x\nFROM ${BUILD_BASE}\nARG CELL\nARG TORCH_CUDA_ARCH_LIST=\n")
    cells = {c["id"]: c for c in fixture_cells(tmp_path)}
    assert gh_matrix.build_args(cells["cu121-a"], dockerfile) == {
        "CELL": "cu121-a", "TORCH_CUDA_ARCH_LIST": "8.0;8.6",
    }
    assert gh_matrix.build_args(cells["cpu-x"], dockerfile) == {"CELL": "cpu-x"}
    real = ROOT / "docker" / "Dockerfile"
    if real.exists():
        args = gh_matrix.build_args(gh_matrix.load_cells()[0], real)
        assert set(args) <= gh_matrix.dockerfile_args(real)
        assert args.get("CELL") == gh_matrix.load_cells()[0]["id"]


# ------------------------------------------------------------------------------- nox sessions called


def nox_sessions() -> set[str]:
    """Session names defined in noxfile.py (ast: no nox import needed), cross-checked with
    `nox --list --json` when nox is installed."""
    tree = ast.parse((ROOT / "noxfile.py").read_text(encoding="utf-8"))
    names = set()
    for node in ast.walk(tree):
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
    assert "pull_request_target" not in doc["on"]
    assert doc["permissions"] == {"contents": "read"}
    assert doc["concurrency"]["cancel-in-progress"] is True
    plan, gpu = doc["jobs"]["plan"], doc["jobs"]["gpu"]
    assert lint.FORK_GUARD in " ".join(plan["if"].split())
    assert "contains(github.event.pull_request.labels.*.name, 'gpu-ci')" in plan["if"]
    assert gpu["runs-on"] == "${{ matrix.runs_on }}"
    for e in gh_matrix.gpu_matrix(gh_matrix.load_cells())["include"]:
        assert e["runs_on"] == ["self-hosted", "linux", "x64", "gpu", e["gpu"], e["cuda_label"]]
    declared = set(lint._load_yaml(ROOT / ".github" / "actionlint.yaml")["self-hosted-runner"]["labels"])
    used = {label for e in gh_matrix.gpu_matrix(gh_matrix.load_cells())["include"] for label in e["runs_on"]}
    assert used - {"self-hosted", "linux", "x64"} <= declared, "declare every runner label in actionlint.yaml"
    assert gh_matrix.runs_on("h100", "cuda13", scale_sets=True) == ["nsa-h100-cuda13"]
    assert gpu["container"]["options"].startswith("--gpus all --shm-size 16g --ipc host")
    assert gpu["timeout-minutes"] > 0
    upload = [s for s in gpu["steps"] if str(s.get("uses", "")).startswith("actions/upload-artifact@")]
    name = upload[0]["with"]["name"]
    assert "${{ matrix.cell }}" in name and "${{ matrix.gpu }}" in name
    runs = [s.get("run", "") for s in gpu["steps"]]
    assert any("GITHUB_STEP_SUMMARY" in r and "summary.md" in r for r in runs)


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
        "without a fork guard",
        "not pinned by a full 40-hex commit SHA",
        "persist-credentials: false",
        "checks out the PR head ref",
    ):
        assert expected in problems, f"policy missed {expected!r}:\n{problems}"


def test_policy_needs_the_fork_guard_on_gpu_jobs(tmp_path):
    need_yaml()
    text = (WORKFLOWS / "gpu.yml").read_text(encoding="utf-8")
    guard = "github.event.pull_request.head.repo.full_name == github.repository &&"
    assert guard in text
    bad = seed(tmp_path, text.replace(guard, ""), "gpu.yml")
    problems = lint.check_policy_file(bad)
    assert any("job 'gpu'" in p and "fork guard" in p for p in problems), problems


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
    from ci import rehearse

    doc = rehearse.load_workflow(WORKFLOWS / "ci.yml")
    out = rehearse.offline_copy(doc, ["lint", "tests"])
    assert set(out["jobs"]) == {"lint", "tests"}
    for job in out["jobs"].values():
        uses = [str(s["uses"]).split("@")[0] for s in job["steps"] if "uses" in s]
        assert uses == ["actions/checkout"]
    with pytest.raises(rehearse.RehearsalError, match="no job"):
        rehearse.offline_copy(doc, ["nope"])
