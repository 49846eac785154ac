"""What `symgate serve` checks before anything starts, and how it says what is wrong.

Light on purpose (the standard library only): the supervisor of several serving processes
imports it, and stays small.
"""

from __future__ import annotations

import errno

from proxy.config import Config


class CannotStart(Exception):
    """A fault at start that the operator has to fix; the message says which, in one line."""


def make_data_dirs(config: Config) -> None:
    for d in (config.server.data_dir, config.cache_dir):
        if d.exists() and not d.is_dir():
            raise CannotStart(f"cannot use data directory {d}: it is a file, not a directory")
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CannotStart(f"cannot use data directory {d}: {reason(e)}") from None


def reason(e: OSError) -> str:
    if e.errno == errno.EADDRINUSE:
        return "address already in use"
    text = e.strerror or str(e)
    text = text[0].lower() + text[1:] if text else type(e).__name__
    return f"{text} ({e.filename})" if e.filename else text
