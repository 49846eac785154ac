"""ELF structure via pyelftools: build-ID notes.

Files come from upstreams we do not control, so they are opened with ELFFile(stream) and
never with ELFFile.load_from_path, which follows .gnu_debuglink names from the file's bytes.
"""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

from elftools.common.exceptions import ELFError, ELFParseError
from elftools.elf.elffile import ELFFile

NT_GNU_BUILD_ID = "NT_GNU_BUILD_ID"


def _build_id_from_notes(notes: object) -> str | None:
    for note in notes:  # type: ignore[attr-defined]
        if note["n_type"] == NT_GNU_BUILD_ID and note["n_name"] == "GNU":
            desc = note["n_desc"]
            return desc.lower() if isinstance(desc, str) else bytes(desc).hex()
    return None


def build_id_of_stream(stream: BinaryIO) -> str | None:
    """The GNU build ID of an ELF file, or None if it is not ELF or has no build-ID note.

    Section headers are tried first: detached debug files keep the note section but their
    program headers may point at contents that objcopy dropped.
    """
    try:
        elf = ELFFile(stream)
        for section in elf.iter_sections():
            if section["sh_type"] == "SHT_NOTE":
                found = _build_id_from_notes(section.iter_notes())  # type: ignore[attr-defined]
                if found:
                    return found
        for segment in elf.iter_segments():
            if segment["p_type"] == "PT_NOTE":
                found = _build_id_from_notes(segment.iter_notes())  # type: ignore[attr-defined]
                if found:
                    return found
    except (ELFError, ELFParseError, ValueError, KeyError, OSError, EOFError, AssertionError):
        # pyelftools raises a spread of types on malformed input; all mean "not a valid ELF".
        return None
    except Exception as e:  # construct's errors have no common public base we can import
        if type(e).__module__.startswith(("construct", "elftools")):
            return None
        raise
    return None


def build_id_of_file(path: Path) -> str | None:
    with path.open("rb") as f:
        return build_id_of_stream(f)
