"""Run alembic migrations programmatically (serve at start-up, `symgate db upgrade`).

alembic is imported only when a migration runs: with mako and pygments behind it, it weighs
~12 MiB that a serving process never needs again (`serve --workers N` migrates in a
short-lived fork, proxy.web.supervisor)."""

from __future__ import annotations

from importlib.resources import files
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from alembic.config import Config as AlembicConfig


def alembic_config(url: str, timeout_s: float | None = None) -> AlembicConfig:
    from alembic.config import Config as AlembicConfig

    cfg = AlembicConfig()
    # database.timeout_s, for connecting (migrations/env.py): a database that never answers
    # must not hold `symgate serve` or `symgate db ...` for asyncpg's own minute.
    cfg.attributes["connect_timeout_s"] = timeout_s
    cfg.set_main_option("script_location", str(files("migrations")))
    # "%" is alembic's interpolation character; URLs may contain it in passwords.
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head", timeout_s: float | None = None) -> None:
    """Blocking: call it before the event loop starts or from a worker thread."""
    from alembic import command

    command.upgrade(alembic_config(url, timeout_s), revision)


def current(url: str, timeout_s: float | None = None) -> None:
    from alembic import command

    command.current(alembic_config(url, timeout_s), verbose=True)
