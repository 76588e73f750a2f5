"""Which GPU architectures a CUDA shared library carries code for, read from its ELF `.nv_fatbin` section.

Reads headers only (seeking over the payloads), so a 500 MB kernel library takes milliseconds and nothing is
loaded or imported. Layout as documented by n-eiling/cuda-fatbin-decompression and jiegec/fatbinary.
Imports nothing of ours.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import BinaryIO

_FATBIN_MAGIC = 0xBA55ED50
_KIND_PTX = 1
_KIND_ELF = 2
_ELF_MAGIC = b"\x7fELF"
# Entries per library are in the thousands; a corrupt size must not loop for ever.
_MAX_ENTRIES = 1_000_000


def _section(fh: BinaryIO, name: bytes) -> tuple[int, int] | None:
    """(offset, size) of the named section of a little-endian ELF64 file, or None."""
    ident = fh.read(64)
    if len(ident) < 64 or ident[:4] != _ELF_MAGIC or ident[4] != 2 or ident[5] != 1:
        return None
    shoff = struct.unpack_from("<Q", ident, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", ident, 0x3A)
    if shoff == 0 or shentsize < 64 or shstrndx >= shnum:
        return None
    fh.seek(shoff)
    table = fh.read(shentsize * shnum)
    if len(table) < shentsize * shnum:
        return None
    headers = [struct.unpack_from("<IIQQQQ", table, i * shentsize) for i in range(shnum)]
    names_offset, names_size = headers[shstrndx][4], headers[shstrndx][5]
    fh.seek(names_offset)
    names = fh.read(names_size)
    for sh_name, _type, _flags, _addr, offset, size in headers:
        end = names.find(b"\0", sh_name)
        if names[sh_name : end if end >= 0 else None] == name:
            return offset, size
    return None


def _entries(fh: BinaryIO, start: int, size: int) -> set[str]:
    """Architectures of every fatbin concatenated in [start, start+size): `sm90` (SASS), `compute90` (PTX)."""
    found: set[str] = set()
    pos, end, seen = start, start + size, 0
    while pos + 16 <= end:
        fh.seek(pos)
        magic, _version, header_size, fat_size = struct.unpack("<IHHQ", fh.read(16))
        if magic != _FATBIN_MAGIC:
            pos += 8  # fatbins are 8-byte aligned; zero padding sits between them
            continue
        entry, fat_end = pos + header_size, pos + header_size + fat_size
        while entry + 32 <= fat_end and seen < _MAX_ENTRIES:
            fh.seek(entry)
            head = fh.read(32)
            if len(head) < 32:
                return found
            kind, _unknown, entry_header, payload = struct.unpack_from("<HHIQ", head, 0)
            arch = struct.unpack_from("<I", head, 28)[0]
            if kind == _KIND_ELF:
                found.add(f"sm{arch}")
            elif kind == _KIND_PTX:
                found.add(f"compute{arch}")
            if entry_header == 0:
                break
            entry += entry_header + payload
            seen += 1
        pos = max(fat_end, pos + 8)
    return found


def cuda_archs(path: Path) -> set[str] | None:
    """The architectures `path` has device code for, or None if it has no fatbin (or is no ELF64 file)."""
    try:
        with path.open("rb") as fh:
            section = _section(fh, b".nv_fatbin")
            if section is None:
                return None
            archs = _entries(fh, *section)
    except (OSError, struct.error):
        return None
    return archs or None
