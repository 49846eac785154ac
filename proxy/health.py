"""What is wrong with symgate's own world right now (disk full, database unreachable), for
/healthz and the status page. Set where the failure is met, cleared where success is."""

from __future__ import annotations

import time
from dataclasses import dataclass

DISK = "disk"
DATABASE = "database"
BUCKET = "bucket"


@dataclass(frozen=True, slots=True)
class Condition:
    name: str
    reason: str
    since: float  # wall-clock time it began


class Health:
    def __init__(self) -> None:
        self._conditions: dict[str, Condition] = {}

    def fail(self, name: str, reason: str) -> None:
        held = self._conditions.get(name)
        self._conditions[name] = Condition(name, reason, held.since if held else time.time())

    def ok(self, name: str) -> None:
        self._conditions.pop(name, None)

    def get(self, name: str) -> Condition | None:
        return self._conditions.get(name)

    @property
    def conditions(self) -> list[Condition]:
        return sorted(self._conditions.values(), key=lambda c: c.name)
