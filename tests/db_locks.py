"""A database held by another connection for a block of a test: the await point a test
controls when it needs symgate to be inside a SQL statement (a migration, a flush) at a
given moment."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import AsyncIterator


@contextlib.asynccontextmanager
async def database_held(database_url: str, sqlite_begin: str, pg_lock: str,
                        pg_before: str = "") -> AsyncIterator[None]:
    """The block runs while another connection holds a lock: on SQLite, a transaction
    begun `BEGIN <sqlite_begin>` (IMMEDIATE holds writes, EXCLUSIVE reads too); on
    PostgreSQL, `pg_lock` run in a transaction (after `pg_before`, outside it). Rolled back
    at the block's end."""
    if database_url.startswith("sqlite"):
        conn = sqlite3.connect(database_url.split(":///", 1)[1], isolation_level=None)
        conn.execute(f"BEGIN {sqlite_begin}")
        try:
            yield
        finally:
            conn.close()
        return
    import asyncpg

    pg = await asyncpg.connect(database_url.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        if pg_before:
            await pg.execute(pg_before)
        tx = pg.transaction()
        await tx.start()
        await pg.execute(pg_lock)
        try:
            yield
        finally:
            await tx.rollback()
    finally:
        await pg.close()
