"""Reading header values that a client or an upstream chose: every input gives an answer.

`str.isdigit` accepts "²" and int() refuses 4,300 digits; aiohttp hands undecodable bytes
through as surrogates that SQL then refuses. These helpers say "not usable" instead.
"""

from __future__ import annotations

import email.utils
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


# On a hit on an upload: the sha256 of the uploaded file. `symgate upload` takes a HEAD's 200 for
# "already there" only with it, and of its own file: a download of the key (evictable, and the
# upstream's bytes) or another upload of it is no upload of the site's file.
UPLOAD_SHA256 = "X-Symgate-Upload-SHA256"

# The file times every filesystem a cache may sit on keeps as they are (some clamp at 2038).
_LATEST_TIME = 2**31


def http_date(value: str | None) -> str | None:
    """An HTTP date as the cached file's mtime will give it back on every later hit: parsed,
    written again in RFC 9110's form; None for one that does not parse or that a file's time
    would not keep (before 1970, past 2038): a miss must not say one Last-Modified and the hits
    after it another."""
    when = _date(value)
    return None if when is None else file_date(when)


def file_date(mtime: float) -> str | None:
    """A file's time (a local directory's) as an HTTP date, by http_date's rule: None for one
    before 1970 or past 2038. Not only for the hits' sake: tmpfs and btrfs keep times whose
    year is past 9999 or before 1, which no HTTP date can say (formatdate raises)."""
    if not 0 <= mtime < _LATEST_TIME:
        return None
    return email.utils.formatdate(mtime, usegmt=True)


def _date(value: str | None) -> float | None:
    """An HTTP date as a Unix time; None for none, or one that does not parse."""
    if not value:
        return None
    try:
        return email.utils.parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError, OverflowError):
        return None


# The longest an upstream's Retry-After is believed, by symgate (which asks that upstream
# nothing meanwhile) and for its clients (whose 502 carries it): a date far ahead (a broken
# clock, a hostile server) must not silence an upstream, or keep a client away, for good.
MAX_RETRY_AFTER_S = 3600


def retry_after(value: str | None, now: float) -> float | None:
    """Seconds a Retry-After asks to wait (delta-seconds, or an HTTP date, RFC 9110 10.2.3),
    from `now` (a Unix time); None for none, or one that does not parse."""
    if (seconds := decimal(value)) is not None:
        return float(seconds)
    when = _date(value)
    return max(0.0, when - now) if when is not None else None


# What a header value may not hold. C0, DEL and C1 controls (0x9B is CSI, as ESC [ is), the
# bidi controls (LRM/RLM/ALM, embeddings, overrides, isolates) and the line and paragraph
# separators (a new line to log viewers and JSON-minded tools) make an operator's terminal or a
# client's log show other text than the value is; surrogates are bytes aiohttp could not
# decode, which SQL refuses.
_UNPRINTABLE = re.compile(
    r"[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\ud800-\udfff]")


def printable(value: str | None, max_length: int = 1024) -> str | None:
    """`value` when it is storable, printable text of at most `max_length` characters."""
    if value is None or len(value) > max_length or _UNPRINTABLE.search(value):
        return None
    return value
