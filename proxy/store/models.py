"""SQL schema. Tables are created only by the alembic migrations in migrations/."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import BigInteger, DateTime, Integer, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


class Artifact(Base):
    """A file in the on-disk cache: one row per artifact key."""

    __tablename__ = "artifacts"

    # sha256 of the key text: source paths can be 4 KiB, longer than a btree index allows.
    key_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
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


class Negative(Base):
    """An upstream answered 404 for a key; remembered until expires_at."""

    __tablename__ = "negatives"

    key_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    upstream: Mapped[str] = mapped_column(Text, primary_key=True)
    key: Mapped[str] = mapped_column(Text)
    build_id: Mapped[str] = mapped_column(String(128), index=True)
    status: Mapped[int] = mapped_column(Integer)
    # Consecutive misses: each one doubles the next TTL, up to the configured maximum.
    misses: Mapped[int] = mapped_column(Integer, default=1)
    first_seen: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), index=True)


class SymbolTableRow(Base):
    """A symbol table built for a build ID, or why none could be (with a retry time)."""

    __tablename__ = "symbol_tables"

    build_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    # ok | no_symbols | malformed: the typed outcome of the last build
    status: Mapped[str] = mapped_column(String(16))
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
    build_seconds: Mapped[float] = mapped_column(default=0.0)
    # For failed builds: when trying again is worth it.
    retry_after: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
