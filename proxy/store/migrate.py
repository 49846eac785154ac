"""Run alembic migrations programmatically (serve at start-up, `symgate db upgrade`)."""

from __future__ import annotations

from importlib.resources import files

from alembic import command
from alembic.config import Config as AlembicConfig


def alembic_config(url: str) -> AlembicConfig:
    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(files("migrations")))
    # "%" is alembic's interpolation character; URLs may contain it in passwords.
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    """Blocking: call it before the event loop starts or from a worker thread."""
    command.upgrade(alembic_config(url), revision)


def current(url: str) -> None:
    command.current(alembic_config(url), verbose=True)
