"""the shared bucket's catalogue, and leases that name one replica for a job

`bucket_objects`: one row per object in the shared S3-compatible bucket ([storage]), written
only once the object is whole there; what a replica reads before asking any upstream.
`artifacts.shared`: a replica's copy is in the bucket, or was (read from it or written to
it): the catch-up that uploads what the bucket lacks leaves it be, so what the bucket's
eviction took does not come back.
`leases`: a named job (one upstream fetch of a key, the bucket's eviction) and the replica
process holding it, until `expires_at` unless renewed: a holder that dies loses it then.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("artifacts") as batch:
        batch.add_column(sa.Column("shared", sa.Boolean(), nullable=False,
                                   server_default=sa.false()))
    op.create_table(
        "bucket_objects",
        sa.Column("key_hash", sa.String(64), primary_key=True),
        sa.Column("scope", sa.String(255), nullable=False, server_default=""),
        sa.Column("key", sa.Text(), nullable=False),
        sa.Column("build_id", sa.String(128), nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("upstream", sa.Text(), nullable=False),
        sa.Column("filename", sa.Text(), nullable=False),
        sa.Column("archive", sa.Text(), nullable=True),
        sa.Column("last_modified", sa.Text(), nullable=True),
        sa.Column("ima_signature", sa.Text(), nullable=True),
        sa.Column("pinned", sa.Boolean(), nullable=False, server_default=sa.false()),
        sa.Column("stored_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_access", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_bucket_objects_build_id", "bucket_objects", ["build_id"])
    op.create_index("ix_bucket_objects_last_access", "bucket_objects", ["last_access"])
    op.create_table(
        "leases",
        sa.Column("name", sa.String(96), primary_key=True),
        sa.Column("holder", sa.String(96), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    # The bucket's objects stay; without their rows nobody reads them, and each is written
    # over when its artifact is published again.
    op.drop_table("leases")
    op.drop_index("ix_bucket_objects_last_access", "bucket_objects")
    op.drop_index("ix_bucket_objects_build_id", "bucket_objects")
    op.drop_table("bucket_objects")
    with op.batch_alter_table("artifacts") as batch:
        batch.drop_column("shared")
