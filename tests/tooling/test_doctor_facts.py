"""nsa_env/upstream.json: in sync with requirements/matrix.toml, shipped in the wheel, and enough for the doctor
outside a checkout."""

from __future__ import annotations

import copy
import fnmatch
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from ci import matrix as mx
from ci.matrix import facts as doctor_facts
from ci.matrix import tomllib  # tomli on Python 3.10
from nsa_env import upstream

ROOT = Path(__file__).resolve().parents[2]


def test_shipped_facts_match_the_matrix():
    shipped = (ROOT / "nsa_env" / upstream.FACTS_FILE).read_text()
    assert shipped == doctor_facts.render(doctor_facts.build(mx.load())), (
        "nsa_env/upstream.json is stale: run `python -m ci.matrix.facts --write` and commit it"
    )


def test_editing_the_matrix_without_regenerating_fails_the_sync(tmp_path, data):
    edited = copy.deepcopy(data)
    edited["upstream"]["torch"]["2.13.0"]["cuda"].append("12.6")
    assert doctor_facts.build(mx.parse(edited)) != doctor_facts.build(mx.parse(data))
    stale = tmp_path / "upstream.json"
    stale.write_text("{}\n")
    assert doctor_facts.main(["--check", "--out", str(stale)]) == 1
    assert doctor_facts.main(["--write", "--out", str(stale)]) == 0
    assert doctor_facts.main(["--check", "--out", str(stale)]) == 0


def test_facts_spell_out_the_flash_attn_wheels_with_the_matrix_rules():
    facts = upstream.load()
    rel = facts["flash_attn"]["2.8.3"]
    # torch 2.4-2.8 x CPython 3.9-3.13 x 2 ABIs, minus torch 2.4 / 3.13, plus torch 2.9 / 3.12 / C++11 ABI
    assert len(rel["wheels"]) == 5 * 5 * 2 - 2 + 1
    assert upstream.flash_wheel(facts, "2.8.3", "2.9", "12", "3.12", True)[0] is not None
    assert upstream.flash_wheel(facts, "2.8.3", "2.9", "12", "3.11", True)[0] is None
    w, _ = upstream.flash_wheel(facts, "2.8.3", "2.4", "12", "3.12", False)
    assert w["wheel"] == "flash_attn-2.8.3+cu12torch2.4cxx11abiFALSE-cp312-cp312-linux_x86_64.whl"
    assert w["url"].endswith("/v2.8.3/flash_attn-2.8.3%2Bcu12torch2.4cxx11abiFALSE-cp312-cp312-linux_x86_64.whl")
    assert upstream.flash_wheel(facts, "2.8.3", "2.4", "12", "3.13", False)[0] is None  # excluded upstream
    assert rel["glibc"] == "2.32" and facts["triton"]["links_libcuda_so1_from"] == "3.6.0"
    assert facts["driver"]["13"] == "580.65.06" and "psutil" in facts["flash_attn_build"]["modules"]


def test_pyproject_ships_the_facts_as_package_data():
    with (ROOT / "pyproject.toml").open("rb") as f:
        pyproject = tomllib.load(f)
    patterns = pyproject["tool"]["setuptools"]["package-data"]["nsa_env"]
    assert any(fnmatch.fnmatch(upstream.FACTS_FILE, p) for p in patterns)
    assert "packaging" in pyproject["project"]["dependencies"]  # nsa_env compares versions and reads locks with it


def test_doctor_runs_from_a_built_wheel_outside_the_checkout(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for package in ("nsa", "nsa_env"):
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                    "-w", str(dist), str(src)], check=True, capture_output=True, timeout=300)
    (wheel,) = dist.glob("nsa-*.whl")
    assert f"nsa_env/{upstream.FACTS_FILE}" in zipfile.ZipFile(wheel).namelist()
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run_env = {**os.environ, "PYTHONPATH": str(site)}
    probe = ("import nsa_env, nsa_env.upstream as u; print(nsa_env.__file__); "
             "print(u.triton_pin_for_torch(u.load(), '2.11.0'))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=elsewhere, env=run_env, capture_output=True, text=True,
                         check=True, timeout=120).stdout.split()
    assert out == [str(site / "nsa_env" / "__init__.py"), "3.6.0"]
    p = subprocess.run([sys.executable, "-m", "nsa_env", "doctor", "--json"], cwd=elsewhere, env=run_env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode in (0, 1), p.stderr
    assert isinstance(json.loads(p.stdout), list)
    # An installed nsa carries no locks and looks for none beside itself: a cell id needs a checkout around
    # the current directory, and its absence is said.
    p = subprocess.run([sys.executable, "-m", "nsa_env", "--check-lock", "cpu-torch2.13-py311"], cwd=elsewhere,
                       env=run_env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "not inside a checkout" in p.stderr, p.stderr
