"""purge notices name the version they are about

A notice used to name a key only, and each serving process removed whatever it held of that
key. An upload's DELETE, or an upload that replaces a download, needs a notice as well (the
other serving processes keep the old file in memory), but a notice by key alone, applied a
poll later, would remove a re-upload made in between. `purges` gains the version it is about:
`sha256` (the file's bytes: what other replicas' copies share), `fetched_at` (the commit on
the replica that left it) and `replica` (that replica: its own disk and rows are already
done with). All three are NULL for an operator's `cache purge`, which removes every version.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("purges") as batch:
        batch.add_column(sa.Column("sha256", sa.String(64), nullable=True))
        batch.add_column(sa.Column("fetched_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("replica", sa.String(64), nullable=True))


def downgrade() -> None:
    # Code from before reads a notice as "remove every version of the key": one left for a
    # single version would remove a re-upload made since. Those notices go; the versions they
    # were about stay in the other processes' memory until their restart, as before.
    op.execute("DELETE FROM purges WHERE replica IS NOT NULL")
    with op.batch_alter_table("purges") as batch:
        batch.drop_column("replica")
        batch.drop_column("fetched_at")
        batch.drop_column("sha256")
