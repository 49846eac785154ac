"""Alembic environment: runs migrations over symgate's async engines (aiosqlite, asyncpg)."""

from __future__ import annotations

import asyncio

from alembic import context
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from sqlalchemy.engine import Connection

from proxy.store.migrate import UnknownRevision
from proxy.store.models import Base
from proxy.store.repository import create_engine

config = context.config
target_metadata = Base.metadata


# Any constant: the key of the PostgreSQL advisory lock that migrations run under.
_MIGRATION_LOCK = 0x73796D67617465


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            # Replicas started at once on a fresh database would each create the same tables
            # (and fail on PostgreSQL's catalogue); one at a time, each later one finds the
            # schema at head. Held until this transaction ends. SQLite locks the file anyway.
            connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_MIGRATION_LOCK})")
        _known_revision()
        context.run_migrations()


def _known_revision() -> None:
    """UnknownRevision when the database is at a revision these scripts lack (a newer
    symgate's), rather than alembic's traceback from deep in its revision map."""
    script = ScriptDirectory.from_config(config)
    for revision in context.get_context().get_current_heads():
        try:
            script.get_revision(revision)
        except CommandError:
            raise UnknownRevision(revision, script.get_current_head()) from None


async def _run_online() -> None:
    engine = create_engine(config.get_main_option("sqlalchemy.url") or "",
                           config.attributes.get("connect_timeout_s"), statements=False)
    async with engine.connect() as connection:
        await connection.run_sync(_run)
        await connection.commit()
    await engine.dispose()


if context.is_offline_mode():
    context.configure(url=config.get_main_option("sqlalchemy.url"), target_metadata=target_metadata,
                      literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    asyncio.run(_run_online())
