"""What symgate keeps: the SQL repository and its models, migrations, and the on-disk store
that owns every path (artifacts, downloads under way, symbol tables)."""
