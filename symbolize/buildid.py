"""The build-ID rule shared by the proxy and the profile rewriter."""

from __future__ import annotations

import re

# elfutils' client refuses build IDs longer than 128 hex characters; GNU build IDs are 20 bytes.
MAX_BUILD_ID_HEX = 128
_HEX = re.compile(r"^[0-9a-f]+$")


class InvalidBuildId(ValueError):
    """Not a build ID; the message says why, in one line."""


def normalize_build_id(raw: str) -> str:
    """Lowercase hex, even length, 2 to 128 digits; InvalidBuildId otherwise."""
    bid = raw.strip().lower()
    if len(bid) < 2 or len(bid) % 2:
        raise InvalidBuildId("invalid build ID: need an even number of hex digits, at least 2")
    if len(bid) > MAX_BUILD_ID_HEX:
        raise InvalidBuildId(f"invalid build ID: longer than {MAX_BUILD_ID_HEX} hex digits")
    if not _HEX.match(bid):
        raise InvalidBuildId("invalid build ID: not hexadecimal")
    return bid
