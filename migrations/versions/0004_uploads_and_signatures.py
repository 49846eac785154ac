"""uploads pinned outside the LRU budget; IMA signatures kept with their files

artifacts gain `pinned` (uploads, never evicted, under their own budget) and `ima_signature`
(the X-DEBUGINFOD-IMASIGNATURE an upstream or uploader sent, served with every hit). Existing
rows are downloads without a signature: not pinned, NULL.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("artifacts") as batch:
        batch.add_column(sa.Column("ima_signature", sa.Text(), nullable=True))
        batch.add_column(sa.Column("pinned", sa.Boolean(), nullable=False,
                                   server_default=sa.false()))
        batch.create_index("ix_artifacts_pinned", ["pinned"])


def downgrade() -> None:
    # Uploads cannot be told from downloads without the column: their rows go (their files
    # are dropped as orphans at the next start, and uploaded again by `symgate upload`).
    op.execute("DELETE FROM artifacts WHERE pinned")
    with op.batch_alter_table("artifacts") as batch:
        batch.drop_index("ix_artifacts_pinned")
        batch.drop_column("pinned")
        batch.drop_column("ima_signature")
