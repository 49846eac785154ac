"""Alembic migrations: the only code that creates or changes symgate's schema."""
