#!/bin/sh
# The image's entrypoint.
#   serve [FLAGS]   symgate serve on the image's defaults: listen on $SYMGATE_LISTEN, data in
#                   $SYMGATE_DATA_DIR, config from $SYMGATE_CONFIG if set; FLAGS override them.
#   healthcheck     exit 0 when /healthz answers 200 (the image's HEALTHCHECK).
#   cache, negative, db, inspect
#                   on the server's data dir and config, as serve sees them (FLAGS override).
#   anything else   passed to symgate as it is (symgate --version, symgate symbolize, ...).
set -eu

listen="${SYMGATE_LISTEN:-0.0.0.0:8002}"
data_dir="${SYMGATE_DATA_DIR:-/data}"

case "${1:-serve}" in
serve)
    [ "$#" -gt 0 ] && shift
    if [ -n "${SYMGATE_CONFIG:-}" ]; then
        set -- --config "$SYMGATE_CONFIG" "$@"
    fi
    exec symgate serve --listen "$listen" --data-dir "$data_dir" "$@"
    ;;
healthcheck)
    port="${listen##*:}"
    # Where the server answers: a wildcard address by its loopback (an IPv6 one, [::], is
    # bound IPv6 only, so not 127.0.0.1), any other by its own address.
    host="${listen%:*}"
    case "$host" in
    "" | 0.0.0.0) host=127.0.0.1 ;;
    "[::]") host="[::1]" ;;
    esac
    exec python3 -c "import sys, urllib.request
try:
    sys.exit(0 if urllib.request.urlopen('http://$host:$port/healthz', timeout=4).status == 200 else 1)
except OSError:
    sys.exit(1)"
    ;;
cache|negative|db|inspect)
    # The server's own data: without these they would read ~/.local/share/symgate, another
    # (empty) data dir, and say nothing of the server's cache.
    command="$1"
    shift
    if [ -n "${SYMGATE_CONFIG:-}" ]; then
        set -- --config "$SYMGATE_CONFIG" "$@"
    fi
    exec symgate "$command" --data-dir "$data_dir" "$@"
    ;;
*)
    exec symgate "$@"
    ;;
esac
