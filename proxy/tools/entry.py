"""The `symgate` command: its modules imported with the cyclic garbage collector off.

A start imports some 110,000 objects that live as long as the process (modules, and the tables
SQLAlchemy, pydantic and aiohttp build as they are imported); the collector went through them
again and again while they were made, a tenth or more of each start (the test suite starts
hundreds of servers). It is on again once they are in, with them frozen (gc.freeze): never
traversed by a collection again, a serving process's full collections (57 ms each over them,
the event loop held) cost what the objects made since cost.
"""

from __future__ import annotations

import gc


def main() -> int:
    gc.disable()
    from proxy.tools.cli import main as command

    return command(loaded=_collect_from_now_on)


def _collect_from_now_on() -> None:
    gc.freeze()
    gc.enable()


if __name__ == "__main__":
    import sys

    sys.exit(main())
