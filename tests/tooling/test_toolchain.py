"""nsa_env.toolchain: the facts the doctor's install checks read, looked up as their consumers look them up
(simulated with environment variables and files in a temporary folder)."""

from __future__ import annotations

import stat

import pytest

from nsa_env import toolchain


def fake_nvcc(root, release: str, headers: bool):
    (root / "bin").mkdir(parents=True)
    nvcc = root / "bin" / "nvcc"
    nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.1'\n")
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IEXEC)
    if headers:
        (root / "include").mkdir()
        (root / "include" / "cuda_runtime.h").write_text("")
    return nvcc


def test_cuda_home_from_the_variable_then_from_nvcc_on_path(tmp_path, monkeypatch):
    fake_nvcc(tmp_path / "cuda-12.4", "12.4", headers=True)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda-12.4"))
    ch = toolchain.cuda_home()
    assert (ch["from"], ch["nvcc_version"], ch["headers"]) == ("CUDA_HOME", "12.4", True)
    # A wrapper on PATH: torch takes its grandparent folder as CUDA_HOME, which has no headers.
    wrapper = fake_nvcc(tmp_path / "wrap", "13.0", headers=False)
    monkeypatch.delenv("CUDA_HOME")
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", str(wrapper.parent))
    ch = toolchain.cuda_home()
    assert ch["path"] == str(tmp_path / "wrap") and ch["from"] == "nvcc on PATH"
    assert ch["nvcc_version"] == "13.0" and ch["headers"] is False


def test_libcuda_from_triton_libcuda_path(tmp_path, monkeypatch):
    (tmp_path / "libcuda.so.1").write_text("")
    monkeypatch.setenv("TRITON_LIBCUDA_PATH", str(tmp_path))
    assert toolchain.libcuda() == {"from": "TRITON_LIBCUDA_PATH", "so1_dirs": [str(tmp_path)], "so_dirs": []}
    (tmp_path / "libcuda.so").symlink_to("libcuda.so.1")
    assert toolchain.libcuda()["so_dirs"] == [str(tmp_path)]


def test_c_compiler_named_by_cc_must_exist(monkeypatch):
    monkeypatch.setenv("CC", "no-such-compiler-here")
    assert toolchain.c_compiler() == {"path": None, "from": "CC", "name": "no-such-compiler-here"}
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("CC")
    assert toolchain.c_compiler()["path"] is None


@pytest.mark.parametrize(
    "tag, glibc",
    [("manylinux_2_28_x86_64", (2, 28)), ("manylinux2014_x86_64", (2, 17)), ("manylinux1_x86_64", (2, 5)),
     ("linux_x86_64", None), ("musllinux_1_2_x86_64", None)],
)
def test_tag_glibc(tag, glibc):
    assert toolchain.tag_glibc(tag) == glibc


def test_wheel_glibc_reads_the_least_demanding_tag_of_each_installed_wheel(tmp_path, monkeypatch):
    for name, tags in (("nsa_fake_a", ["cp312-cp312-manylinux_2_27_x86_64", "cp312-cp312-manylinux_2_28_x86_64"]),
                       ("nsa_fake_b", ["py3-none-linux_x86_64"])):
        info = tmp_path / f"{name}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        (info / "WHEEL").write_text("Wheel-Version: 1.0\n" + "".join(f"Tag: {t}\n" for t in tags))
    monkeypatch.syspath_prepend(str(tmp_path))
    found = toolchain.wheel_glibc()
    assert found["nsa_fake_a"] == "2.27" and "nsa_fake_b" not in found


def test_facts_of_this_machine_are_complete():
    f = toolchain.facts(["packaging", "no_such_module_for_nsa"])
    assert f["cpus"] >= 1 and (f["mem_available_gib"] is None or f["mem_available_gib"] > 0)
    assert f["build_modules"] == {"packaging": True, "no_such_module_for_nsa": False}
    assert f["python_h"]["include"] and set(f) >= {"cc", "cuda_home", "libcuda", "glibc", "wheel_glibc", "env"}
