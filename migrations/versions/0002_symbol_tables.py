"""symbol tables

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "symbol_tables",
        sa.Column("build_id", sa.String(128), primary_key=True),
        sa.Column("status", sa.String(16), nullable=False),
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
        sa.Column("retry_after", sa.DateTime(timezone=True), nullable=True),
    )


def downgrade() -> None:
    op.drop_table("symbol_tables")
