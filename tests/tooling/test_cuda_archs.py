"""nsa_env.cuda_archs: the architectures of a CUDA ELF read from its fat binaries (a synthetic .so built here),
and which architectures run on which GPU."""

from __future__ import annotations

import struct
import sys
from importlib.machinery import EXTENSION_SUFFIXES

import pytest

from nsa_env import report as env
from nsa_env.cuda_archs import FATBIN_MAGIC, KIND_PTX, KIND_SASS, fatbin_archs, runs_on


def fatbin(entries: list[tuple[int, int, int]]) -> bytes:
    """One fat binary: entries of (kind, sm, payload size), each with a 64-byte header."""
    body = b""
    for kind, arch, size in entries:
        header = struct.pack("<HHIQ", kind, 0x0101, 64, size) + bytes(12) + struct.pack("<I", arch)
        body += header.ljust(64, b"\0") + b"\xab" * size
    return struct.pack("<IHHQ", FATBIN_MAGIC, 1, 16, len(body)) + body


def elf(sections: dict[str, bytes]) -> bytes:
    """A minimal ELF64 little-endian file holding the given sections (and its section name table)."""
    names = b"\0.shstrtab\0" + b"".join(n.encode() + b"\0" for n in sections)
    blobs = [(".shstrtab", names)] + list(sections.items())
    data, offsets = b"", []
    for _, blob in blobs:
        offsets.append(64 + len(data))
        data += blob + bytes(-len(blob) % 8)
    shoff = 64 + len(data)
    header = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9)
    header += struct.pack("<HHIQQQIHHHHHH", 3, 62, 1, 0, 0, shoff, 0, 64, 0, 0, 64, len(blobs) + 1, 1)
    shdrs = bytes(64)
    for (name, blob), off in zip(blobs, offsets):
        shdrs += struct.pack("<IIQQQQIIQQ", names.index(name.encode() + b"\0"), 1, 0, 0, off, len(blob), 0, 0, 8, 0)
    return header + data + shdrs


def test_reads_sass_and_ptx_across_several_fat_binaries(tmp_path):
    blob = fatbin([(KIND_SASS, 80, 40), (KIND_SASS, 90, 24), (KIND_PTX, 90, 16)]) + bytes(8)
    blob += fatbin([(KIND_SASS, 120, 8), (KIND_SASS, 80, 8)])
    so = tmp_path / "ext.so"
    so.write_bytes(elf({".text": b"\x90" * 32, ".nv_fatbin": blob}))
    assert fatbin_archs(so) == {"sass": ["sm_80", "sm_90", "sm_120"], "ptx": ["compute_90"]}


def test_files_without_cuda_kernels_are_refused_with_the_reason(tmp_path):
    plain = tmp_path / "plain.so"
    plain.write_bytes(elf({".text": b"\x90" * 16}))
    with pytest.raises(ValueError, match="no .nv_fatbin"):
        fatbin_archs(plain)
    junk = tmp_path / "junk.so"
    junk.write_bytes(elf({".nv_fatbin": bytes(64)}))
    with pytest.raises(ValueError, match="no fat binary"):
        fatbin_archs(junk)
    text = tmp_path / "notes.txt"
    text.write_text("not an ELF file at all")
    with pytest.raises(ValueError, match="not a 64-bit"):
        fatbin_archs(text)


@pytest.mark.parametrize(
    "archs, capability, ok",
    [
        (["sm_80", "sm_90"], "9.0", True),
        (["sm_80", "sm_90"], "12.0", False),  # Blackwell consumer GPU, torch built before CUDA 12.8
        (["sm_80"], "8.6", True),  # SASS runs on later minors of its major
        (["sm_86"], "8.0", False),
        (["sm_80", "compute_90"], "12.0", True),  # PTX is JIT-compiled for newer GPUs
        (["compute_90"], "8.0", False),
        (["sm_90a"], "9.0", True),
        (["sm_100a"], "10.3", False),  # arch-specific SASS runs only on its exact GPU
        (["sm_100"], "12.0", False),
        ([], "9.0", False),
    ],
)
def test_runs_on(archs, capability, ok):
    assert runs_on(archs, capability) is ok


def test_env_reads_flash_attn_extension_archs_without_importing_it(tmp_path, monkeypatch):
    ext = tmp_path / f"flash_attn_2_cuda{EXTENSION_SUFFIXES[0]}"
    ext.write_bytes(elf({".nv_fatbin": fatbin([(KIND_SASS, 80, 8), (KIND_SASS, 90, 8)])}))
    monkeypatch.syspath_prepend(str(tmp_path))
    archs, err = env._flash_archs()
    assert err is None and archs == {"sass": ["sm_80", "sm_90"], "ptx": []}
    assert "flash_attn_2_cuda" not in sys.modules
    ext.write_bytes(b"garbage")
    archs, err = env._flash_archs()
    assert archs is None and "cannot read" in err
