"""The fatbin reader on a built ELF: which GPU architectures a CUDA library carries."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from gateway.doctor.fatbin import cuda_archs

pytestmark = pytest.mark.timeout(30)


def _fatbin(entries: list[tuple[int, int]]) -> bytes:
    """One fatbin: (kind, arch) entries with 16-byte payloads."""
    body = b""
    for kind, arch in entries:
        header = struct.pack("<HHIQIIHHI", kind, 0x101, 64, 16, 0, 0, 0, 0, arch).ljust(64, b"\0")
        body += header + bytes(16)
    return struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(body)) + body


def _elf_with_section(name: bytes, data: bytes) -> bytes:
    """A minimal little-endian ELF64 file: null, .shstrtab and one section holding `data`."""
    names = b"\0.shstrtab\0" + name + b"\0"
    names_at, data_at = 64, 64 + len(names)
    table_at = data_at + len(data) + (-(data_at + len(data)) % 8)
    header = b"\x7fELF\x02\x01\x01".ljust(16, b"\0")
    header += struct.pack("<HHIQQQIHHHHHH", 3, 0xBE, 1, 0, 0, table_at, 0, 64, 0, 0, 64, 3, 1)
    section = struct.Struct("<IIQQQQIIQQ")
    table = section.pack(0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    table += section.pack(1, 3, 0, 0, names_at, len(names), 0, 0, 1, 0)
    table += section.pack(11, 1, 0, 0, data_at, len(data), 0, 0, 8, 0)
    return header + names + data + bytes(table_at - data_at - len(data)) + table


def test_fatbin_archs_from_an_elf(tmp_path: Path) -> None:
    first = _fatbin([(2, 80), (1, 80)])
    data = first + bytes(8) + _fatbin([(2, 90), (2, 90)])  # zero padding between fatbins
    library = tmp_path / "_fa_C.abi3.so"
    library.write_bytes(_elf_with_section(b".nv_fatbin", data))
    assert cuda_archs(library) == {"sm80", "compute80", "sm90"}


def test_fatbin_reader_refuses_what_is_not_cuda(tmp_path: Path) -> None:
    plain = tmp_path / "plain.so"
    plain.write_bytes(_elf_with_section(b".text", b"\x90" * 32))
    assert cuda_archs(plain) is None
    text = tmp_path / "notes.txt"
    text.write_text("not an ELF file")
    assert cuda_archs(text) is None
    assert cuda_archs(tmp_path / "missing.so") is None
