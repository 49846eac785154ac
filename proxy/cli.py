"""The `symgate` command line."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from aiohttp import web

from . import __version__, migrate
from .app import create_app
from .config import Config, ConfigError, SymbolizeConfig, load_config, parse_listen


def _config(args: argparse.Namespace) -> Config:
    cfg = load_config(args.config)
    return cfg.with_overrides(listen=getattr(args, "listen", None), data_dir=args.data_dir)


def _serve(args: argparse.Namespace) -> int:
    cfg = _config(args)
    if args.no_migrate:
        from dataclasses import replace

        cfg = replace(cfg, database=replace(cfg.database, migrate_on_start=False))
    host, port = parse_listen(cfg.server.listen, "server.listen")
    app = create_app(cfg)
    print(f"symgate {__version__} listening on http://{cfg.server.listen}/", flush=True)
    web.run_app(app, host=host, port=port, print=None,
                access_log=logging.getLogger("symgate.access") if cfg.server.access_log
                else None,
                shutdown_timeout=30.0)
    return 0


def _db(args: argparse.Namespace) -> int:
    cfg = _config(args)
    if args.db_command == "upgrade":
        migrate.upgrade(cfg.database_url)
        print(f"database at head: {cfg.database_url.split('@')[-1]}")
    else:
        migrate.current(cfg.database_url)
    return 0


def _symbolize(args: argparse.Namespace) -> int:
    body = args.input.read_bytes()
    if args.server:
        import urllib.error
        import urllib.request

        req = urllib.request.Request(
            args.server.rstrip("/") + "/symbolize", data=body, method="POST",
            headers={"Content-Type": "application/octet-stream",
                     **({"X-Scope-OrgID": args.tenant} if args.tenant else {})})
        try:
            with urllib.request.urlopen(req, timeout=args.timeout) as r:
                out, headers = r.read(), dict(r.headers)
        except urllib.error.HTTPError as e:
            print(f"symgate: {args.server} answered {e.code}: {e.read().decode().strip()}",
                  file=sys.stderr)
            return 1
        summary = {k: v for k, v in headers.items() if k.startswith("X-Symgate-")}
    else:
        from symbolize.offline import symbolize_bytes
        from symbolize.pprof.codec import ProfileError

        try:
            out, report = symbolize_bytes(body, args.debug_dir or [Path("/usr/lib/debug")],
                                          SymbolizeConfig().max_decompressed_bytes)
        except ProfileError as e:
            print(f"symgate: {args.input}: {e}", file=sys.stderr)
            return 1
        summary = {
            "mappings symbolized": str(report.mappings_symbolized),
            "mappings not symbolized": ", ".join(
                f"{k}={v}" for k, v in sorted(report.mappings_skipped.items())) or "none",
            "locations symbolized": str(report.locations_symbolized),
            "locations unresolved": ", ".join(
                f"{k}={v}" for k, v in sorted(report.locations_unresolved.items())) or "none",
        }
    args.output.write_bytes(out)
    for k, v in summary.items():
        print(f"{k}: {v}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="symgate", description=__doc__)
    parser.add_argument("--version", action="version", version=f"symgate {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", type=Path, help="TOML configuration file")
        p.add_argument("--data-dir", type=Path, help="where the SQLite file and cache live")

    serve = sub.add_parser("serve", help="run the debuginfod caching proxy")
    common(serve)
    serve.add_argument("--listen", help="HOST:PORT (default 127.0.0.1:8002)")
    serve.add_argument("--no-migrate", action="store_true",
                       help="do not run pending database migrations at start")
    serve.set_defaults(func=_serve)

    sym = sub.add_parser("symbolize", help="symbolize a pprof profile, offline or via a server")
    sym.add_argument("input", type=Path, help="pprof profile (gzip or raw)")
    sym.add_argument("-o", "--output", type=Path, required=True)
    where = sym.add_mutually_exclusive_group()
    where.add_argument("--server", help="a symgate URL: POST the profile to its /symbolize")
    where.add_argument("--debug-dir", type=Path, action="append",
                       help="a tree like /usr/lib/debug (.build-id/xx/rest.debug); repeatable;"
                            " the default when --server is not given is /usr/lib/debug")
    sym.add_argument("--tenant", help="X-Scope-OrgID to send with --server")
    sym.add_argument("--timeout", type=float, default=120.0, help="seconds, with --server")
    sym.set_defaults(func=_symbolize)

    db = sub.add_parser("db", help="database schema")
    common(db)
    db.add_argument("db_command", choices=["upgrade", "current"])
    db.set_defaults(func=_db)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return int(args.func(args))
    except ConfigError as e:
        print(f"symgate: configuration error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
