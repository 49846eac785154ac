"""Run alembic migrations programmatically (serve at start-up, `symgate db upgrade`).

alembic is imported only when a migration runs: with mako and pygments behind it, it weighs
~12 MiB that a serving process never needs again (`serve --workers N` migrates in a
short-lived fork, proxy.web.supervisor)."""

from __future__ import annotations

import io
from importlib.resources import files
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from alembic.config import Config as AlembicConfig


class UnknownRevision(Exception):
    """The database's schema is at a revision these migrations do not know: a newer symgate
    migrated it. Neither upgraded nor used: this symgate's queries are not written for it."""

    def __init__(self, revision: str, head: str | None) -> None:
        super().__init__(f"its schema is at revision {revision}, which this symgate does not "
                         f"know (its newest is {head}): a newer symgate migrated it; run that "
                         "version, or give this one another database")
        self.revision = revision


def alembic_config(url: str, timeout_s: float | None = None, *, quiet: bool = False
                   ) -> AlembicConfig:
    from alembic.config import Config as AlembicConfig

    cfg = AlembicConfig(stdout=io.StringIO()) if quiet else AlembicConfig()
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


def check(url: str, timeout_s: float | None = None) -> None:
    """Blocking, as upgrade: UnknownRevision when the database is at a revision these
    migrations lack, read without migrating (`serve --no-migrate`, whose schema a deploy's
    own `symgate db upgrade` keeps). A newer symgate's schema was used with this one's
    queries, written for another. A schema older than these, or none, is left to the start,
    which says to upgrade it."""
    from alembic import command

    command.current(alembic_config(url, timeout_s, quiet=True))
