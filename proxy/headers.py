"""Reading header values that a client or an upstream chose: every input gives an answer.

`str.isdigit` accepts "²" and int() refuses 4,300 digits; aiohttp hands undecodable bytes
through as surrogates that SQL then refuses. These helpers say "not usable" instead.
"""

from __future__ import annotations

import re

_DECIMAL = re.compile(r"[0-9]+")
# More digits than any size can have (2**64 has 20): such a value means "no limit" at most.
_MAX_DIGITS = 19


def decimal(value: str | None) -> int | None:
    """A non-negative ASCII decimal, or None for anything else (absent, "²", "-1", " ")."""
    if value is None:
        return None
    text = value.strip()
    if not _DECIMAL.fullmatch(text):
        return None
    return int(text) if len(text) <= _MAX_DIGITS else 10**_MAX_DIGITS


def printable(value: str | None, max_length: int = 1024) -> str | None:
    """`value` when it is storable, printable text of at most `max_length` characters."""
    if value is None or len(value) > max_length:
        return None
    if any(ord(c) < 0x20 or ord(c) == 0x7F or 0xD800 <= ord(c) <= 0xDFFF for c in value):
        return None
    return value
