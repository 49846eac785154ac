"""one outcome vocabulary; tenant scopes in every key

negatives.status (an HTTP status) becomes negatives.outcome, symbol_tables.status becomes
symbol_tables.outcome and retry_after becomes expires_at: the words of symbolize.outcome.
Artifacts, negatives and symbol tables gain a scope ("" for shared rows, so every existing row
stays what it was); symbol tables are keyed by (scope, build_id).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

_SYMBOL_TABLE_COLUMNS = ("format", "source_key", "size", "load_address", "code_ranges",
                         "cold_ranges", "has_lines", "file_layout", "error", "built_at",
                         "build_seconds")


def _symbol_tables(name: str, pk: tuple[str, ...], outcome: str, expiry: str) -> None:
    op.create_table(
        name,
        *([sa.Column("scope", sa.String(255), nullable=False, server_default="")]
          if "scope" in pk else []),
        sa.Column("build_id", sa.String(128), nullable=False),
        sa.Column(outcome, sa.String(16), nullable=False),
        sa.Column("format", sa.String(32), nullable=False),
        sa.Column("source_key", sa.Text(), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("load_address", sa.BigInteger(), nullable=False),
        sa.Column("code_ranges", sa.Text(), nullable=False),
        sa.Column("cold_ranges", sa.Text(), nullable=False),
        sa.Column("has_lines", sa.Boolean(), nullable=False),
        sa.Column("file_layout", sa.Text(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("built_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("build_seconds", sa.Float(), nullable=False),
        sa.Column(expiry, sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint(*pk, name=f"{name}_pkey"),
    )


def _name_primary_key(temporary: str) -> None:
    """PostgreSQL keeps a constraint's name through a table rename: give it back the name a
    later migration will expect. SQLite's primary keys have no name to fix."""
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"ALTER TABLE symbol_tables RENAME CONSTRAINT {temporary} "
                   "TO symbol_tables_pkey")


def upgrade() -> None:
    with op.batch_alter_table("artifacts") as batch:
        batch.add_column(sa.Column("scope", sa.String(255), nullable=False, server_default=""))

    with op.batch_alter_table("negatives") as batch:
        batch.add_column(sa.Column("scope", sa.String(255), nullable=False, server_default=""))
        batch.add_column(sa.Column("outcome", sa.String(16), nullable=False,
                                   server_default="not_found"))
    # Only 404s and 410s were ever remembered: both are not_found.
    op.execute("UPDATE negatives SET outcome = 'not_found'")
    with op.batch_alter_table("negatives") as batch:
        batch.drop_column("status")

    # A new primary key: copy into a new table rather than alter constraints whose names
    # differ between SQLite and PostgreSQL.
    _symbol_tables("symbol_tables_new", ("scope", "build_id"), "outcome", "expires_at")
    columns = ", ".join(_SYMBOL_TABLE_COLUMNS)
    op.execute(f"INSERT INTO symbol_tables_new (scope, build_id, outcome, {columns}, expires_at) "
               f"SELECT '', build_id, status, {columns}, retry_after FROM symbol_tables")
    op.drop_table("symbol_tables")
    op.rename_table("symbol_tables_new", "symbol_tables")
    _name_primary_key("symbol_tables_new_pkey")


def downgrade() -> None:
    _symbol_tables("symbol_tables_old", ("build_id",), "status", "retry_after")
    columns = ", ".join(_SYMBOL_TABLE_COLUMNS)
    # Tenants' tables cannot be told apart without a scope: they are dropped (rebuilt on use).
    op.execute(f"INSERT INTO symbol_tables_old (build_id, status, {columns}, retry_after) "
               f"SELECT build_id, outcome, {columns}, expires_at FROM symbol_tables "
               f"WHERE scope = ''")
    op.drop_table("symbol_tables")
    op.rename_table("symbol_tables_old", "symbol_tables")
    _name_primary_key("symbol_tables_old_pkey")
    with op.batch_alter_table("negatives") as batch:
        batch.add_column(sa.Column("status", sa.Integer(), nullable=False, server_default="404"))
    op.execute("DELETE FROM negatives WHERE scope <> ''")
    with op.batch_alter_table("negatives") as batch:
        batch.drop_column("outcome")
        batch.drop_column("scope")
    op.execute("DELETE FROM artifacts WHERE scope <> ''")
    with op.batch_alter_table("artifacts") as batch:
        batch.drop_column("scope")
