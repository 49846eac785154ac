"""replicas: each artifact row names the replica whose disk holds the file; purge notices

Several replicas (hosts with disks of their own) may share one PostgreSQL. Until now a row
said only "this file is cached", and each replica's start-up deleted the rows whose file was
not on its own disk: a restart of one replica wiped the others' catalogue.

`artifacts` gains `replica` (proxy.store.replica: an id made once per cache directory) and
its primary key becomes (key_hash, replica): one row per artifact and disk. One table rather
than a shared "artifacts" plus a per-replica "copies" table, because every column but the
key's describes one copy: its size as verified on that disk, its hits and last access (what
that disk's LRU evicts by), and whether it is an upload pinned on that disk. A separate
table would have split each hit lookup, eviction and flush into a join for no column that
is truly shared; the bucket phase adds the bucket's copies as rows of a replica of its own
or a table of its own, without touching these. key_hash comes first in the key: a purge
deletes one key on every replica; each replica's own rows are found by the `replica` index.

Existing rows get the replica "pre-0005": the first replica that loads them with a whole
file on its disk takes them as its own (proxy.artifacts.index.ArtifactCache.load), so a
single node upgraded in place keeps every file as a hit and re-fetches nothing. A code from
before 0005 cannot write rows once this ran (its ON CONFLICT names the old key): stop old
processes before new ones start, as for any migration.

`purges` holds `cache purge` notices: every serving process polls it (cache.purge_poll_s)
and removes its own copy of a purged file; notices are deleted after a day.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

UNCLAIMED = "pre-0005"  # proxy.store.replica.UNCLAIMED; migrations import nothing of the code

_COLUMNS = ("key_hash", "scope", "key", "build_id", "kind", "size", "sha256", "upstream",
            "filename", "archive", "fetched_at", "last_access", "hits", "ima_signature",
            "pinned")


def _artifacts(name: str, *, replicas: bool) -> None:
    op.create_table(
        name,
        sa.Column("key_hash", sa.String(64), nullable=False),
        *([sa.Column("replica", sa.String(64), nullable=False)] if replicas else []),
        sa.Column("scope", sa.String(255), nullable=False, server_default=""),
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
        sa.Column("ima_signature", sa.Text(), nullable=True),
        sa.Column("pinned", sa.Boolean(), nullable=False, server_default=sa.false()),
        sa.PrimaryKeyConstraint(*(("key_hash", "replica") if replicas else ("key_hash",)),
                                name=f"{name}_pkey"),
    )


def _swap(new: str, *, replicas: bool) -> None:
    """Replace artifacts by `new`, with the indexes and key name the models expect.
    (A new table rather than altering the primary key in place: its name differs between
    SQLite, which has none, and PostgreSQL.)"""
    op.drop_table("artifacts")
    op.rename_table(new, "artifacts")
    if op.get_bind().dialect.name == "postgresql":  # the key keeps its name through a rename
        op.execute(f"ALTER TABLE artifacts RENAME CONSTRAINT {new}_pkey TO artifacts_pkey")
    op.create_index("ix_artifacts_build_id", "artifacts", ["build_id"])
    op.create_index("ix_artifacts_last_access", "artifacts", ["last_access"])
    op.create_index("ix_artifacts_pinned", "artifacts", ["pinned"])
    if replicas:
        op.create_index("ix_artifacts_replica", "artifacts", ["replica"])


def upgrade() -> None:
    columns = ", ".join(_COLUMNS)
    _artifacts("artifacts_new", replicas=True)
    op.execute(f"INSERT INTO artifacts_new (replica, {columns}) "
               f"SELECT '{UNCLAIMED}', {columns} FROM artifacts")
    _swap("artifacts_new", replicas=True)
    op.create_table(
        "purges",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("key_hash", sa.String(64), nullable=False),
        sa.Column("scope", sa.String(255), nullable=False),
        sa.Column("key", sa.Text(), nullable=False),
        sa.Column("purged_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_purges_purged_at", "purges", ["purged_at"])


def downgrade() -> None:
    op.drop_index("ix_purges_purged_at", "purges")
    op.drop_table("purges")
    # One row per key again: one replica's copy is kept (the others' files become orphans,
    # removed at their next start, and fetched again on their next request).
    columns = ", ".join(_COLUMNS)
    _artifacts("artifacts_old", replicas=False)
    op.execute(f"INSERT INTO artifacts_old ({columns}) SELECT {columns} FROM artifacts a "
               "WHERE a.replica = (SELECT MIN(b.replica) FROM artifacts b "
               "WHERE b.key_hash = a.key_hash)")
    _swap("artifacts_old", replicas=False)
