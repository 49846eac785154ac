"""The command line: serve, symbolize, inspect, prefetch, and the cache/negative/db admin."""
