"""artifacts and negatives

Revision ID: 0001
Revises:
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "artifacts",
        sa.Column("key_hash", sa.String(64), primary_key=True),
        sa.Column("key", sa.Text(), nullable=False),
        sa.Column("build_id", sa.String(128), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("upstream", sa.Text(), nullable=False),
        sa.Column("filename", sa.Text(), nullable=False),
        sa.Column("archive", sa.Text(), nullable=True),
        sa.Column("fetched_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_access", sa.DateTime(timezone=True), nullable=False),
        sa.Column("hits", sa.BigInteger(), nullable=False),
    )
    op.create_index("ix_artifacts_build_id", "artifacts", ["build_id"])
    op.create_index("ix_artifacts_last_access", "artifacts", ["last_access"])
    op.create_table(
        "negatives",
        sa.Column("key_hash", sa.String(64), primary_key=True),
        sa.Column("upstream", sa.Text(), primary_key=True),
        sa.Column("key", sa.Text(), nullable=False),
        sa.Column("build_id", sa.String(128), nullable=False),
        sa.Column("status", sa.Integer(), nullable=False),
        sa.Column("misses", sa.Integer(), nullable=False),
        sa.Column("first_seen", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_negatives_build_id", "negatives", ["build_id"])
    op.create_index("ix_negatives_expires_at", "negatives", ["expires_at"])


def downgrade() -> None:
    op.drop_table("negatives")
    op.drop_table("artifacts")
