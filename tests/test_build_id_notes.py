"""The quick build-ID reader (symbolize.elf.build_id_of_notes) against pyelftools': the same
answer on real files, and on broken ones either the same answer or none (then pyelftools is
asked), never another build ID and never an exception."""

from __future__ import annotations

import struct
from pathlib import Path

from symbolize.elf import build_id_of_file, build_id_of_notes
from tests.elfs import ElfSet, broken_copies, on_descriptor, real_elf_files


def quick(path: Path) -> str | None:
    return on_descriptor(path, build_id_of_notes)


def test_the_same_build_id_as_pyelftools_on_real_files(elfs: ElfSet) -> None:
    for path in real_elf_files(elfs):
        assert quick(path) is not None, path
        assert quick(path) == build_id_of_file(path), path


def test_broken_files_give_the_right_build_id_or_none(elfs: ElfSet, tmp_path: Path) -> None:
    original = elfs.prog.debug.read_bytes()
    want = elfs.prog.build_id
    broken = tmp_path / "broken"
    cases = broken_copies(original, 7)
    for data in cases:
        broken.write_bytes(data)
        got = quick(broken)
        assert got is None or got == build_id_of_file(broken), data[:8]
        if got is not None and got != want:
            # A flipped byte inside the note itself: pyelftools reads the same wrong ID.
            assert build_id_of_file(broken) == got


def test_big_endian_and_32_bit_headers_are_read(tmp_path: Path) -> None:
    """A hand-made ELF32 big-endian file with one note section, as pyelftools reads it."""
    desc = bytes(range(20))
    note = struct.pack(">III", 4, len(desc), 3) + b"GNU\0" + desc
    shstr = b"\0.note.gnu.build-id\0.shstrtab\0"
    ehsize, shentsize = 52, 40
    note_at = ehsize
    shstr_at = note_at + len(note)
    shoff = shstr_at + len(shstr)
    header = (b"\x7fELF" + bytes([1, 2, 1, 0]) + bytes(8)
              + struct.pack(">HHIIIIIHHHHHH", 2, 8, 1, 0, 0, shoff, 0, ehsize, 0, 0,
                            shentsize, 3, 2))
    sections = (bytes(shentsize)
                + struct.pack(">IIIIIIIIII", 1, 7, 2, 0, note_at, len(note), 0, 0, 4, 0)
                + struct.pack(">IIIIIIIIII", 20, 3, 0, 0, shstr_at, len(shstr), 0, 0, 1, 0))
    path = tmp_path / "be32"
    path.write_bytes(header + note + shstr + sections)
    assert build_id_of_file(path) == desc.hex()
    assert quick(path) == desc.hex()
