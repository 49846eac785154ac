"""SQL schema. Tables are created only by the alembic migrations in migrations/; these models
say the same, server defaults (which migrations gave columns added to tables with rows) and
types included, as tests/test_schema.py checks."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import BigInteger, Boolean, DateTime, Float, Integer, String, Text, false
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


class Artifact(Base):
    """A file in a replica's on-disk cache: one row per artifact key and replica."""

    __tablename__ = "artifacts"

    # sha256 of the scope and key text: source paths can be 4 KiB, longer than a btree index
    # allows (see proxy.artifacts.index.key_hash).
    key_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    # The replica whose disk holds the file (proxy.store.replica); see migration 0005.
    replica: Mapped[str] = mapped_column(String(64), primary_key=True, index=True)
    # "" for what every client may see; a tenant's name for what came from its own sources.
    scope: Mapped[str] = mapped_column(String(255), default="", server_default="")
    key: Mapped[str] = mapped_column(Text)
    build_id: Mapped[str] = mapped_column(String(128), index=True)
    kind: Mapped[str] = mapped_column(String(16))
    size: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    upstream: Mapped[str] = mapped_column(Text)
    filename: Mapped[str] = mapped_column(Text)
    archive: Mapped[str | None] = mapped_column(Text, nullable=True)
    fetched_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    last_access: Mapped[datetime] = mapped_column(DateTime(timezone=True), index=True)
    hits: Mapped[int] = mapped_column(BigInteger, default=0)
    # X-DEBUGINFOD-IMASIGNATURE as the upstream (or uploader) sent it, served with every hit.
    ima_signature: Mapped[str | None] = mapped_column(Text, nullable=True)
    # An upload: kept outside the LRU budget (under upload.max_bytes) and never evicted.
    pinned: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false(),
                                         index=True)
    # In the shared bucket, or was: the catch-up does not upload it (again); migration 0006.
    shared: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())


class Negative(Base):
    """An upstream's answer for a key that is worth remembering; believed until expires_at."""

    __tablename__ = "negatives"

    key_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    upstream: Mapped[str] = mapped_column(Text, primary_key=True)
    scope: Mapped[str] = mapped_column(String(255), default="", server_default="")
    key: Mapped[str] = mapped_column(Text)
    build_id: Mapped[str] = mapped_column(String(128), index=True)
    # A symbolize.outcome.Outcome value: not_found today.
    outcome: Mapped[str] = mapped_column(String(16), server_default="not_found")
    # Consecutive misses: each one doubles the next TTL, up to the configured maximum.
    misses: Mapped[int] = mapped_column(Integer, default=1)
    first_seen: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), index=True)


class SymbolTableRow(Base):
    """A symbol table built for a build ID in a scope, or why none could be (until when)."""

    __tablename__ = "symbol_tables"

    # The scope of the artifact it was built from: "" for shared ones, else a tenant's name.
    scope: Mapped[str] = mapped_column(String(255), primary_key=True, server_default="")
    build_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    # ok | no_symbols | malformed: a symbolize.outcome.Outcome value
    outcome: Mapped[str] = mapped_column(String(16))
    format: Mapped[str] = mapped_column(String(32))
    # The artifact it was built from: evicting that artifact drops the table.
    source_key: Mapped[str] = mapped_column(Text)
    size: Mapped[int] = mapped_column(BigInteger, default=0)
    load_address: Mapped[int] = mapped_column(BigInteger, default=0)
    code_ranges: Mapped[str] = mapped_column(Text, default="[]")  # JSON [[start, end], ...]
    cold_ranges: Mapped[str] = mapped_column(Text, default="[]")  # JSON [[start, end], ...]
    has_lines: Mapped[bool] = mapped_column(default=False)
    # JSON program headers with real file offsets (from the executable), once known.
    file_layout: Mapped[str | None] = mapped_column(Text, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    built_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    build_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    # For failed builds: until when the outcome is believed (then a build is tried again); for
    # a table from an executable: until its debug file is asked for again.
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class Purge(Base):
    """An artifact removed for good, for every serving process (on every replica) to apply to
    its own memory and disk: an operator's `cache purge` of every version of it, or one
    version an upload's DELETE or replacement removed (migration 0007); kept for a while
    (proxy.artifacts.purges), then deleted."""

    __tablename__ = "purges"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    key_hash: Mapped[str] = mapped_column(String(64))
    scope: Mapped[str] = mapped_column(String(255))
    key: Mapped[str] = mapped_column(Text)
    purged_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), index=True)
    # The version removed, and the replica that removed it from its own disk and rows; all
    # NULL for an operator's purge, which is of every version on every replica.
    sha256: Mapped[str | None] = mapped_column(String(64), nullable=True)
    fetched_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    replica: Mapped[str | None] = mapped_column(String(64), nullable=True)


class BucketObject(Base):
    """An object in the shared bucket ([storage]): an artifact, or a symbol table, whole there.
    Written after the object, deleted before it (migration 0006)."""

    __tablename__ = "bucket_objects"

    key_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    scope: Mapped[str] = mapped_column(String(255), default="", server_default="")
    key: Mapped[str] = mapped_column(Text)
    build_id: Mapped[str] = mapped_column(String(128), index=True)
    # An artifact kind (debuginfo, executable, source, section), or "symtab".
    kind: Mapped[str] = mapped_column(String(32))
    size: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    upstream: Mapped[str] = mapped_column(Text)
    filename: Mapped[str] = mapped_column(Text)
    archive: Mapped[str | None] = mapped_column(Text, nullable=True)
    last_modified: Mapped[str | None] = mapped_column(Text, nullable=True)
    ima_signature: Mapped[str | None] = mapped_column(Text, nullable=True)
    # An upload: never evicted from the bucket either.
    pinned: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    stored_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    # The last time a replica read it: the bucket's eviction goes oldest first.
    last_access: Mapped[datetime] = mapped_column(DateTime(timezone=True), index=True)


class Lease(Base):
    """A job one replica process does for the cluster (an upstream fetch of a key, the
    bucket's eviction), held until expires_at unless renewed."""

    __tablename__ = "leases"

    name: Mapped[str] = mapped_column(String(96), primary_key=True)
    holder: Mapped[str] = mapped_column(String(96))
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
