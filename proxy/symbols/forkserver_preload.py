"""Imported by name in the forkserver, and only there (never by the server): what every worker
process forked from it shares.

It imports the modules the workers run (numpy, protobuf, symbolic: some 50 MB), so that a new
worker is a fork, ready at once, and their pages are shared by every worker rather than
copied into each. Two things keep them shared:

- multiprocessing starts each child by importing the parent's main module (as __mp_main__),
  which for `symgate serve` is the whole server: aiohttp, SQLAlchemy, pydantic, about 50 MB
  private to every worker. Workers only run functions of importable modules, so the
  forkserver's children skip that step.
- gc.freeze(): the cyclic collector in a worker never writes to the headers of the objects
  imported here, which would copy their pages into it one by one.
"""

from __future__ import annotations

import gc
import signal
from multiprocessing import spawn
from typing import Any

from proxy.symbols import shared_bodies, worker_process
from symbolize import otlp, symtab, worker

LOADED = (worker_process, shared_bodies, symtab, worker, otlp)  # what the workers run


def _no_main(_main: Any) -> None:
    """In place of spawn's _fixup_main_from_name/_path: the main module stays unimported."""


# Its forks (the workers) start with a terminal's Ctrl-C and hangup ignored, as
# worker_process.init sets them: the forkserver gives its children the SIGINT handler it found
# after this import, and a Ctrl-C between a worker's fork and its init killed that worker as the
# drain began, breaking its pool (a 503 for the profile the drain was to let finish).
for _sig in (signal.SIGINT, signal.SIGHUP):
    signal.signal(_sig, signal.SIG_IGN)

spawn._fixup_main_from_name = _no_main  # type: ignore[attr-defined]
spawn._fixup_main_from_path = _no_main  # type: ignore[attr-defined]
# A lone server's forkserver is a new interpreter (`python -c ...`), not a fork of one
# forked_helpers names: without this, ps -o comm showed it as `python`, beside the server.
worker_process.name_process("symgate-forksrv")
gc.freeze()
