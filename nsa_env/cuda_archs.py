"""Which GPU architectures a CUDA binary carries, and whether they can run on a given GPU.

`fatbin_archs(path)` reads the `.nv_fatbin` section of an ELF shared object (a CUDA extension such as
flash-attn's flash_attn_2_cuda*.so) and lists the SASS (cubin) and PTX architectures of its kernels,
without a CUDA toolkit (cuobjdump) and without loading the library: it walks the fat binary headers,
which nvcc writes as a 16-byte header (magic 0xBA55ED50, version, header size, payload size) followed by
entries (kind 1 = PTX, 2 = ELF/SASS; header size; payload size; ...; the sm number at byte 28).

`runs_on(archs, capability)`: SASS for sm_XY runs on GPUs of the same major with minor >= Y (arch-
specific sm_XYa only on X.Y); PTX for compute_XY is JIT-compiled by the driver for any GPU >= X.Y.
"""

from __future__ import annotations

import mmap
import re
import struct
from pathlib import Path

FATBIN_MAGIC = 0xBA55ED50
KIND_PTX, KIND_SASS = 1, 2


def _sections(m: mmap.mmap) -> dict[str, tuple[int, int]]:
    """ELF64 little-endian section name -> (file offset, size)."""
    if m[:4] != b"\x7fELF" or m[4] != 2 or m[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    (shoff,) = struct.unpack_from("<Q", m, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", m, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", m, shoff + i * shentsize) for i in range(shnum)]
    strtab = headers[shstrndx][4]
    out = {}
    for name_off, _type, _flags, _addr, offset, size in headers:
        start = strtab + name_off
        out[m[start : m.find(b"\0", start)].decode(errors="replace")] = (offset, size)
    return out


def fatbin_archs(path: str | Path) -> dict[str, list[str]]:
    """{"sass": ["sm_80", "sm_90"], "ptx": ["compute_90"]} of a CUDA ELF; ValueError when it has none."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        sec = _sections(m).get(".nv_fatbin")
        if sec is None:
            raise ValueError(f"{Path(path).name} has no .nv_fatbin section (no CUDA kernels)")
        pos, end = sec[0], sec[0] + sec[1]
        sass: set[int] = set()
        ptx: set[int] = set()
        while pos + 16 <= end:
            magic, _version, header_size, payload = struct.unpack_from("<IHHQ", m, pos)
            if magic != FATBIN_MAGIC:  # alignment padding between the fat binaries of each object file
                pos += 8
                continue
            entry, stop = pos + header_size, min(pos + header_size + payload, end)
            while entry + 32 <= stop:
                kind, _, entry_header, size = struct.unpack_from("<HHIQ", m, entry)
                (arch,) = struct.unpack_from("<I", m, entry + 28)
                (ptx if kind == KIND_PTX else sass if kind == KIND_SASS else set()).add(arch)
                if entry_header == 0:
                    break
                entry += entry_header + size
            pos = stop
    if not sass and not ptx:
        raise ValueError(f"{Path(path).name}: .nv_fatbin holds no fat binary this reader understands")
    return {"sass": [f"sm_{a}" for a in sorted(sass)], "ptx": [f"compute_{a}" for a in sorted(ptx)]}


_ARCH = re.compile(r"^(sm|compute)_(\d+?)(\d)([a-z]?)$")


def runs_on(archs: list[str], capability: str) -> bool:
    """Whether code built for `archs` (torch.cuda.get_arch_list() style: sm_90, sm_90a, compute_90) has a
    kernel image for a GPU of compute capability "9.0"."""
    major, minor = (int(x) for x in capability.split(".")[:2])
    for a in archs:
        m = _ARCH.match(a)
        if not m:
            continue
        kind, amaj, amin, suffix = m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)
        if kind == "compute" and (amaj, amin) <= (major, minor):
            return True
        if kind == "sm" and amaj == major and (amin == minor if suffix else amin <= minor):
            return True
    return False
