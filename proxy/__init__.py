"""symgate: a debuginfod caching proxy and symbol cache server."""

__version__ = "0.1.0"
