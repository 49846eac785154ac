"""Artifacts: the service that answers a key (hit, join, remembered miss, fetch), the single
flight that streams one download to every waiting client, the cache index and remembered misses."""
