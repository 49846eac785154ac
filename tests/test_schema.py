"""The SQL models (proxy/store/models.py) and the alembic migrations describe one schema: a
column, index, type or server default added to one and not the other is a schema that a
fresh database and an upgraded one disagree on, or queries the database cannot answer."""

from __future__ import annotations

import asyncio

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import Connection

from proxy.store.migrate import upgrade
from proxy.store.models import Base
from proxy.store.repository import create_engine


def _same_default(_context: object, _inspected: object, _column: object,
                  inspected: str | None, _default: object, rendered: str | None) -> bool | None:
    """SQLite gives an empty string's default back as "('')", which alembic's own comparison
    takes for another than the model's empty string; any other pair is alembic's to judge."""
    if inspected == "('')" and rendered == "":
        return False
    return None


def _differences(connection: Connection) -> list[object]:
    context = MigrationContext.configure(
        connection, opts={"compare_type": True, "compare_server_default": _same_default})
    return list(compare_metadata(context, Base.metadata))


async def test_the_models_are_the_schema_the_migrations_make(database_url: str) -> None:
    await asyncio.to_thread(upgrade, database_url)
    engine = create_engine(database_url)
    try:
        async with engine.connect() as connection:
            assert await connection.run_sync(_differences) == []
    finally:
        await engine.dispose()
