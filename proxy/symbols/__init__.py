"""Symbol tables per (scope, build ID): the table store, the open-table LRU, the build pool and
the resolver that finds a source, builds and opens them."""
