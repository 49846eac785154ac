"""Alembic environment: runs migrations over symgate's async engines (aiosqlite, asyncpg)."""

from __future__ import annotations

import asyncio
from typing import Any

from alembic import context
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from sqlalchemy import event
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine

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
        # Every migration in the one transaction, on SQLite too (see _transactional_ddl):
        # alembic committed SQLite's one by one.
        transactional_ddl=True,
    )
    if context.get_context().opts.get("dont_mutate"):
        # `symgate db current`: it reads, and shows what it read (the shortcut below returned
        # before it showed anything), in a read-only transaction.
        _show_current(connection)
        return
    if connection.dialect.name == "sqlite" and _at_head(connection):
        # Read only, in a transaction of its own: a file at head that cannot be written
        # (read-only, immutable) starts as before, without the write lock below.
        return
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            # Replicas started at once on a fresh database would each create the same tables
            # (and fail on PostgreSQL's catalogue); one at a time, each later one finds the
            # schema at head. Held until this transaction ends. SQLite locks the file anyway.
            connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_MIGRATION_LOCK})")
        _known_revision()
        context.run_migrations()


def _at_head(connection: Connection) -> bool:
    connection.info[_READING] = True
    try:
        heads = set(context.get_context().get_current_heads())
    finally:
        connection.rollback()
        connection.info.pop(_READING)
    return heads == set(ScriptDirectory.from_config(config).get_heads())


def _show_current(connection: Connection) -> None:
    connection.info[_READING] = True
    try:
        _known_revision()
        context.run_migrations()  # with dont_mutate, alembic only calls the command's fn
    finally:
        connection.rollback()
        connection.info.pop(_READING)


# Set on a connection while it only reads: its transaction begins without the write lock.
_READING = "symgate_reading"


def _known_revision() -> None:
    """UnknownRevision when the database is at a revision these scripts lack (a newer
    symgate's), rather than alembic's traceback from deep in its revision map."""
    script = ScriptDirectory.from_config(config)
    for revision in context.get_context().get_current_heads():
        try:
            script.get_revision(revision)
        except CommandError:
            raise UnknownRevision(revision, script.get_current_head()) from None


def _transactional_ddl(engine: AsyncEngine) -> None:
    """SQLite's DDL inside the migrations' transaction. Its driver begins one only before an
    INSERT, UPDATE or DELETE: each CREATE or ALTER before one was committed by itself, so a
    server killed while it migrated (its first start, or a newer version's) left tables
    without their revision, and every later start failed on "table artifacts already
    exists". The driver is told to begin nothing, and each transaction SQLAlchemy begins is
    a BEGIN of SQLite's own, rolled back whole by a kill."""

    @event.listens_for(engine.sync_engine, "connect")
    def _no_implicit_begin(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None

    @event.listens_for(engine.sync_engine, "begin")
    def _begin(conn: Connection) -> None:
        # IMMEDIATE: the file's write lock taken now, waited for (busy_timeout) while another
        # server's migration holds it. A plain BEGIN read alembic_version first and asked for
        # the lock at the first CREATE: with a migration of another server started at the
        # same moment, SQLite answers "database is locked" at once (it cannot wait for a
        # writer whose commit would change what this transaction has read), and that start
        # failed.
        conn.exec_driver_sql("BEGIN" if conn.info.get(_READING) else "BEGIN IMMEDIATE")


async def _run_online() -> None:
    engine = create_engine(config.get_main_option("sqlalchemy.url") or "",
                           config.attributes.get("connect_timeout_s"), statements=False)
    if engine.dialect.name == "sqlite":
        _transactional_ddl(engine)
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
