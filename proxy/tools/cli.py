"""The `symgate` command line."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import get_args

from proxy import __version__
from proxy.config import (
    MAX_PROCESSES,
    Config,
    ConfigError,
    Fallback,
    SymbolizeConfig,
    cores,
    load_config,
    parse_listen,
)
from proxy.store import migrate
from proxy.tools.output_file import write_whole
from proxy.tools.text_table import render_table
from proxy.web import logs


def _config(args: argparse.Namespace) -> Config:
    cfg = load_config(args.config)
    return cfg.with_overrides(listen=getattr(args, "listen", None), data_dir=args.data_dir)


def _serve(args: argparse.Namespace) -> int:
    from proxy.symbols.executors import own_temp_folder
    from proxy.web.startup import CannotStart
    from proxy.web.supervisor import supervise, sweep_dead_folders

    cfg = _config(args)
    if args.no_migrate:
        from dataclasses import replace

        cfg = replace(cfg, database=replace(cfg.database, migrate_on_start=False))
    parse_listen(cfg.server.listen, "server.listen")
    workers = args.workers or cfg.server.workers or cores()
    json_logs = cfg.server.log_format == "json"
    logs.configure(json_logs, serving=workers == 1)  # each worker configures its own
    sweep_dead_folders()  # of servers killed before, with one worker or several
    own_temp_folder()
    try:
        if workers > 1:
            return supervise(cfg, workers, access_log=cfg.server.access_log,
                             json_logs=json_logs)
        from proxy.web.app import serve

        asyncio.run(serve(
            cfg, access_log=logging.getLogger("symgate.access") if cfg.server.access_log
            else None,
            access_log_class=logs.JsonAccessLogger if json_logs else logs.AccessLogger))
    except CannotStart as e:
        logging.getLogger("symgate").error("%s", e)
        return 1
    return 0


def _count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"not a whole number of at least 1: {text!r}")
    return int(text)


def _listen(text: str) -> str:
    try:
        parse_listen(text, "--listen")
    except ConfigError as e:  # a usage error: exit status 2, as argparse gives it
        raise argparse.ArgumentTypeError(str(e).removeprefix("--listen: ")) from None
    return text


def _workers(text: str) -> int:
    count = _count(text)
    if count > MAX_PROCESSES:  # as server.workers: forked until the machine ran out
        raise argparse.ArgumentTypeError(
            f"at most {MAX_PROCESSES}, got {count}")
    return count


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):  # nan too
        raise argparse.ArgumentTypeError(f"not a number of seconds above 0: {text!r}")
    return value


def _refused_server(server: str | None) -> bool:
    """Whether `server`, a --server (None: none given), is no URL a request can go to, said
    so on stderr. Said once, before any work: prefetch and upload reported aiohttp's bare
    error class for every artifact instead ("debuginfo error: NonHttpUrlClientError" for a
    URL without its http://), and inspect judged the whole profile first."""
    from yarl import URL

    if server is None:
        return False
    try:
        url = URL(server)
    except ValueError as e:  # an unclosed IPv6 address, a port past 65535
        why = f"not a URL ({e})"
    else:
        if url.scheme in ("http", "https") and url.host:
            return False
        why = "not an http:// or https:// URL"
    print(f"symgate: --server {server}: {why}", file=sys.stderr)
    return True


def _db(args: argparse.Namespace) -> int:
    cfg = _config(args)
    if args.db_command == "upgrade":
        migrate.upgrade(cfg.database_url, timeout_s=cfg.database.timeout_s)
        print(f"database at head: {cfg.database_url.split('@')[-1]}")
    else:
        if (missing := _missing_sqlite(cfg.database_url)) is not None:
            # As the cache commands say it: reading the revision made the file (and its
            # directory) and showed none, a mistyped --data-dir looking like an empty schema.
            print(f"symgate: no symgate database at {missing}: is this the server's data "
                  "dir? (--data-dir, --config)", file=sys.stderr)
            return 1
        migrate.current(cfg.database_url, timeout_s=cfg.database.timeout_s)
    return 0


SYMBOLIZE_TIMEOUT_S = 120.0  # symbolize --server's, for the whole exchange


def _symbolize(args: argparse.Namespace) -> int:
    try:
        body = args.input.read_bytes()
    except OSError as e:
        print(f"symgate: cannot read {args.input}: {e.strerror or e}", file=sys.stderr)
        return 1
    if _refused_server(args.server or None):
        return 1
    if not args.output.parent.is_dir():  # said now, not after the work
        print(f"symgate: cannot write {args.output}: no such directory {args.output.parent}",
              file=sys.stderr)
        return 1
    if args.output.is_dir():
        print(f"symgate: cannot write {args.output}: it is a directory", file=sys.stderr)
        return 1
    if args.server:
        import urllib.parse

        from proxy.tools.remote_symbolize import RemoteError, symbolize_remote

        # A tenant configured with tokens is named by its token (the header alone is 401).
        token = _token(args)
        query = f"?{urllib.parse.urlencode({'fallback': args.fallback})}" if args.fallback \
            else ""
        headers = {"Content-Type": "application/octet-stream",
                   **({"X-Scope-OrgID": args.tenant} if args.tenant else {}),
                   **({"Authorization": f"Bearer {token}"} if token else {})}
        try:
            out, summary = asyncio.run(symbolize_remote(
                args.server, args.server.rstrip("/") + "/symbolize" + query, body, headers,
                SYMBOLIZE_TIMEOUT_S if args.timeout is None else args.timeout,
                SymbolizeConfig().max_decompressed_bytes))
        except RemoteError as e:
            print(f"symgate: {e}", file=sys.stderr)
            return 1
    else:
        from symbolize.offline import symbolize_bytes
        from symbolize.pipeline import Limits
        from symbolize.pprof.codec import ProfileError

        # Offline, the user's own machine does the work: no limit on build IDs or time.
        limits = Limits(SymbolizeConfig().max_decompressed_bytes, max_build_ids=sys.maxsize,
                        fallback=args.fallback == "module-offset")
        try:
            out, report = symbolize_bytes(body, args.debug_dir or [Path("/usr/lib/debug")],
                                          limits)
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
    try:
        write_whole(args.output, out, atomic=args.atomic)
    except OSError as e:
        print(f"symgate: cannot write {args.output}: {e.strerror or e}", file=sys.stderr)
        return 1
    for k, v in summary.items():
        print(f"{k}: {v}", file=sys.stderr)
    return 0


def _inspect(args: argparse.Namespace) -> int:
    import json

    from proxy.tools.inspect_profile import inspect_profile, render, server_failures, to_json
    from symbolize.pprof.codec import ProfileError

    if _refused_server(args.server or None):
        return 1
    cfg = _config(args)
    nameless = cfg.tenants.get("")
    if args.tenant and args.tenant not in cfg.tenants and nameless is not None \
            and nameless.tokens:
        # The server refuses it (web.tenancy): judged by the global upstreams, its profile
        # would read as served.
        print(f"symgate: tenant {args.tenant!r} is not in the configuration, and requests "
              "without a token are refused there ([tenants.\"\"] tokens): the server answers "
              "this tenant's requests 401", file=sys.stderr)
        return 1
    if args.tenant and args.tenant not in cfg.tenants:
        # Served so too, as any tenant the server does not list; but a misspelt name would
        # otherwise judge the global sources in silence.
        print(f"symgate: tenant {args.tenant!r} is not in the configuration: judged by the "
              "global upstreams and settings", file=sys.stderr)
    # The tenant's view of the server's cache; one configured with tokens is named by its token.
    token = _token(args) if args.server else ""
    headers = {**({"X-Scope-OrgID": args.tenant} if args.tenant else {}),
               **({"Authorization": f"Bearer {token}"} if token else {})}
    try:
        rows = asyncio.run(inspect_profile(
            args.profile.read_bytes(), cfg, server=args.server, timeout_s=args.timeout,
            max_decompressed=cfg.symbolize.max_decompressed_bytes, tenant=args.tenant or "",
            server_headers=headers))
    except (OSError, ProfileError) as e:
        print(f"symgate: {args.profile}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(to_json(rows), indent=2) if args.json else render(rows), end="")
    if failed := server_failures(rows):
        # The table says it per mapping; this, that the command did not do what was asked.
        print(f"symgate: {args.server}: {failed[0].reason or failed[0].status}"
              f"{f' (and {len(failed) - 1} more checks)' if len(failed) > 1 else ''}",
              file=sys.stderr)
        return 1
    return 0


def _prefetch(args: argparse.Namespace) -> int:
    import json

    from proxy.tools.prefetch import (
        TIMED_OUT,
        IdFileError,
        Summary,
        build_ids_from,
        prefetch,
        terminal_progress,
    )
    from symbolize.pprof.codec import ProfileError

    if _refused_server(args.server):
        return 1
    summary = Summary()
    try:
        ids = build_ids_from(args.build_ids, args.file or [], args.profile or [],
                             SymbolizeConfig().max_decompressed_bytes, summary)
    except (OSError, ProfileError, IdFileError) as e:
        print(f"symgate: {e}", file=sys.stderr)
        return 1
    for bad in summary.invalid:
        print(f"symgate: skipping {bad[:80]!r}: not a build ID", file=sys.stderr)
    if not ids:
        print("symgate: no build IDs to prefetch", file=sys.stderr)
        return 2
    finished = asyncio.run(prefetch(args.server, ids, args.kind, args.concurrency, summary,
                                    terminal_progress, args.timeout))
    counts = summary.counts()
    if not finished:
        print(f"symgate: prefetch stopped after --timeout {args.timeout:g} s: "
              f"{counts[TIMED_OUT]} artifacts not done by {args.server}", file=sys.stderr)
    failed = sum(n for status, n in counts.items() if status not in ("200", "404"))
    if failed and finished:
        # On stderr, naming the server: the summary on stdout may go to a file or a pipe.
        why = ", ".join(f"{n} {status}" for status, n in counts.most_common()
                        if status not in ("200", "404"))
        print(f"symgate: {args.server}: {failed} of {len(ids) * len(args.kind)} artifacts "
              f"failed ({why})", file=sys.stderr)
    if args.json:
        print(json.dumps({"results": summary.results, "bytes": summary.bytes,
                          "invalid": summary.invalid}))
    else:
        print(f"{len(ids)} build IDs, {len(ids) * len(args.kind)} artifacts: "
              f"{counts['200']} cached, {counts['404']} not found upstream, {failed} failed; "
              f"{summary.bytes} bytes")
        for bid, kinds in summary.results.items():
            short = {k: v for k, v in kinds.items() if v != "200"}
            if short:
                print(f"  {bid}: " + ", ".join(f"{k} {v}" for k, v in sorted(short.items())))
    return 1 if failed else 0


class TokenError(ValueError):
    """A token that no Authorization header can carry; never shown (it is a secret)."""


def _token(args: argparse.Namespace) -> str:
    """The bearer token of --token-file, else of $SYMGATE_TOKEN; "" for none."""
    where = f"--token-file {args.token_file}" if args.token_file else "SYMGATE_TOKEN"
    refused = TokenError(f"{where}: not a bearer token (one line of printable text)")
    try:
        token = (args.token_file.read_text().strip() if args.token_file
                 else os.environ.get("SYMGATE_TOKEN", ""))
    except UnicodeDecodeError:
        raise refused from None
    if not token.isprintable():
        # A second line, a control character: aiohttp refused the header with a traceback
        # that printed the token, wherever the command's output goes.
        raise refused
    return token


def _upload(args: argparse.Namespace) -> int:
    from proxy.tools.upload import Summary, find_items, report, terminal_progress, upload

    if _refused_server(args.server):
        return 1
    token = _token(args)
    if not token:
        print("symgate: uploads need a bearer token: SYMGATE_TOKEN, or --token-file",
              file=sys.stderr)
        return 2
    summary = Summary()
    items = find_items(args.paths, summary)
    if not items:
        print(report(summary), end="", file=sys.stderr)
        print("symgate: nothing to upload", file=sys.stderr)
        return 2
    finished = asyncio.run(upload(args.server, token, args.tenant, items, args.concurrency,
                                  summary, terminal_progress, args.timeout))
    print(report(summary), end="")
    failed = summary.counts()["failed"]
    if failed:
        # On stderr, naming the server: the report on stdout may go to a file or a pipe.
        stopped = "" if finished else f"stopped after --timeout {args.timeout:g} s: "
        print(f"symgate: {args.server}: {stopped}{failed} of {len(items)} artifacts not "
              "uploaded", file=sys.stderr)
    return 1 if failed else 0


def _admin(args: argparse.Namespace) -> int:
    import json

    from proxy.errors import InvalidRequest
    from proxy.store import replica
    from proxy.tools.admin import Admin

    cfg = _config(args)
    if (missing := _missing_sqlite(cfg.database_url)) is not None:
        # Not made here: an empty database and cache in the wrong place would answer "no such
        # table", or list nothing, instead of saying that this is not the server's data dir.
        print(f"symgate: no symgate database at {missing}: is this the server's data dir? "
              "(--data-dir, --config)", file=sys.stderr)
        return 1
    if args.command == "cache" and args.action in ("ls", "stats") \
            and not (cfg.cache_dir / replica.FILE_NAME).exists():
        # They show one replica's cache: with a database that several share, a cache dir that
        # no server has used would get an id of its own and list nothing, as if empty.
        print(f"symgate: no symgate cache at {cfg.cache_dir}: cache {args.action} shows the "
              "cache of a server's data dir (--data-dir, --config); purges and negative "
              "commands reach every replica from anywhere", file=sys.stderr)
        return 1
    admin = Admin(cfg)
    target: str | None = getattr(args, "build_id", None)

    async def run() -> int:
        try:
            if args.command == "cache":
                return await _cache(admin, args, target)
            return await _negative(admin, args, target)
        finally:
            await admin.close()

    async def _cache(admin: Admin, args: argparse.Namespace, target: str | None) -> int:
        if args.action == "stats":
            st = await admin.stats()
            if args.json:
                print(json.dumps(st.__dict__))
            else:
                print(f"entries {st.entries}, {st.bytes} bytes of {st.max_bytes} "
                      f"({100 * st.bytes / max(st.max_bytes, 1):.1f}%), {st.hits} hits, "
                      f"{st.symbol_tables} symbol tables")
                print(f"uploads (pinned, outside that budget) {st.pinned_entries}, "
                      f"{st.pinned_bytes} bytes of {st.upload_max_bytes}")
                for kind, (n, size) in st.by_kind.items():
                    print(f"  {kind:<11} {n:>7} entries {size:>14} bytes")
            return 0
        rows = await (admin.purge(target) if args.action == "purge" else admin.artifacts(target))
        # A failed build is of no artifact (a local debug tree's file): purged by build ID too.
        forgotten = await admin.forget_failed_builds(target) if args.action == "purge" else 0
        if args.pinned:
            rows = [r for r in rows if r.pinned]
        if args.json:
            print(json.dumps([{"key": r.key, "scope": r.scope, "size": r.size,
                               "upstream": r.upstream, "hits": r.hits, "pinned": r.pinned,
                               "fetched_at": r.fetched_at.isoformat(),
                               "last_access": r.last_access.isoformat()} for r in rows]))
        elif args.action == "purge":
            print(f"purged {len(rows)} artifacts ({sum(r.size for r in rows)} bytes)")
            if forgotten:
                print(f"forgot {forgotten} failed symbol-table builds")
        else:
            print(render_table([[r.key, r.scope or "-", str(r.size), str(r.hits),
                                 r.last_access.strftime("%F %T"), r.upstream,
                                 "yes" if r.pinned else "no"] for r in rows],
                               ["KEY", "SCOPE", "SIZE", "HITS", "LAST ACCESS (UTC)", "UPSTREAM",
                                "PINNED"]))
        return 0

    async def _negative(admin: Admin, args: argparse.Namespace, target: str | None) -> int:
        if args.action == "clear":
            n = await admin.clear_negatives(target)
            print(f"cleared {n} remembered misses: the next request asks the upstreams again")
            return 0
        rows = await admin.negatives(target)
        if args.json:
            print(json.dumps([{"key": r.key, "upstream": r.upstream, "misses": r.misses,
                               "live": r.live, "first_seen": r.first_seen.isoformat(),
                               "expires_at": r.expires_at.isoformat()} for r in rows]))
        else:
            print(render_table([[r.key, r.upstream, str(r.misses), r.expires_at.strftime("%F %T"),
                           "yes" if r.live else "expired"] for r in rows],
                         ["KEY", "UPSTREAM", "MISSES", "EXPIRES (UTC)", "LIVE"]))
        return 0

    try:
        return asyncio.run(run())
    except InvalidRequest as e:
        print(f"symgate: {e.reason}", file=sys.stderr)
        return 2


def _missing_sqlite(url: str) -> Path | None:
    """The SQLite file `url` names, if it does not exist."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or not parsed.database \
            or parsed.database == ":memory:":
        return None
    path = Path(parsed.database)
    return None if path.exists() else path


# The one action of each admin command that --all (everything) goes with.
_ALL_GOES_WITH = {"cache": "purge", "negative": "clear"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="symgate", description=__doc__)
    parser.add_argument("--version", action="version", version=f"symgate {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", type=Path, help="TOML configuration file")
        p.add_argument("--data-dir", type=Path, help="where the SQLite file and cache live")

    serve = sub.add_parser("serve", help="run the debuginfod caching proxy")
    common(serve)
    serve.add_argument("--listen", type=_listen, help="HOST:PORT (default 127.0.0.1:8002)")
    serve.add_argument("--no-migrate", action="store_true",
                       help="do not run pending database migrations at start")
    serve.add_argument("--workers", type=_workers,
                       help="serving processes on the one port, at most 256 (default: "
                            "server.workers, or one per core)")
    serve.set_defaults(func=_serve)

    sym = sub.add_parser("symbolize", help="symbolize a pprof profile, offline or via a server")
    sym.add_argument("input", type=Path, help="pprof profile (gzip or raw)")
    sym.add_argument("-o", "--output", type=Path, required=True,
                     help="the file to write; an existing one is written into, as by a shell's >")
    sym.add_argument("--atomic", action="store_true",
                     help="replace an existing OUTPUT by rename in one step (readers never see "
                          "part of it; its hard links keep the old one)")
    where = sym.add_mutually_exclusive_group()
    where.add_argument("--server", help="a symgate URL: POST the profile to its /symbolize")
    where.add_argument("--debug-dir", type=Path, action="append",
                       help="a tree like /usr/lib/debug (.build-id/xx/rest.debug); repeatable;"
                            " the default when --server is not given is /usr/lib/debug")
    sym.add_argument("--tenant", help="X-Scope-OrgID to send with --server")
    sym.add_argument("--token-file", type=Path,
                     help="with --server, a file holding the tenant's bearer token (default: "
                          "$SYMGATE_TOKEN, if set)")
    sym.add_argument("--fallback", choices=get_args(Fallback),
                     help="names for frames left unsymbolized: none, or module-offset "
                          "(libc.so.6+0x1234); default: the server's setting, or none")
    # None when not given, so that one given without --server is told apart from the default.
    sym.add_argument("--timeout", type=_seconds,
                     help=f"seconds, with --server (default {SYMBOLIZE_TIMEOUT_S:g})")
    sym.set_defaults(func=_symbolize)

    insp = sub.add_parser("inspect", help="why a profile's frames are or are not symbolized")
    common(insp)
    insp.add_argument("profile", type=Path, help="pprof profile (gzip or raw)")
    insp.add_argument("--server", help="a symgate URL, to check its cache too")
    insp.add_argument("--timeout", type=_seconds, default=10.0, help="seconds per check")
    insp.add_argument("--json", action="store_true", help="machine-readable output")
    insp.add_argument("--tenant", help="X-Scope-OrgID: judge this tenant's requests (its "
                                       "[tenants.NAME] upstreams and symbolize setting, and its "
                                       "view of the --server cache)")
    insp.add_argument("--token-file", type=Path,
                      help="with --server, a file holding the tenant's bearer token (default: "
                           "$SYMGATE_TOKEN, if set)")
    insp.set_defaults(func=_inspect)

    pre = sub.add_parser("prefetch", help="warm a symgate's cache and symbol tables")
    pre.add_argument("build_ids", nargs="*", help="build IDs")
    pre.add_argument("--file", type=Path, action="append",
                     help="a file of build IDs, whitespace-separated, # comments; repeatable")
    pre.add_argument("--profile", type=Path, action="append",
                     help="a pprof profile: its mappings without functions; repeatable")
    pre.add_argument("--server", default="http://127.0.0.1:8002",
                     help="the symgate to warm (default %(default)s)")
    pre.add_argument("--kind", action="append", choices=["debuginfo", "executable"],
                     help="artifacts to fetch (default: debuginfo and executable)")
    pre.add_argument("--concurrency", type=_count, default=8)
    pre.add_argument("--timeout", type=_seconds, default=3600.0,
                     help="seconds for the whole prefetch (default 3600); what is not done "
                          "by then is reported failed, and the exit status is 1")
    pre.add_argument("--json", action="store_true", help="machine-readable summary")
    pre.set_defaults(func=_prefetch)

    up = sub.add_parser("upload", help="upload a site's own debug files to a symgate")
    up.add_argument("paths", nargs="+", type=Path, help="ELF files, or directories of them")
    up.add_argument("--server", default="http://127.0.0.1:8002",
                    help="the symgate to fill (default %(default)s)")
    up.add_argument("--token-file", type=Path,
                    help="a file holding the bearer token (default: $SYMGATE_TOKEN)")
    up.add_argument("--tenant", help="X-Scope-OrgID: with an admin token, the tenant to "
                                     "upload for (default: the shared scope)")
    up.add_argument("--concurrency", type=_count, default=4)
    up.add_argument("--timeout", type=_seconds, default=3600.0,
                    help="seconds for the whole upload (default 3600); what is not done by "
                         "then is reported failed, and the exit status is 1")
    up.set_defaults(func=_upload)

    for name, actions, help_text in (
        ("cache", ("ls", "stats", "purge"), "see and purge cached artifacts"),
        ("negative", ("ls", "clear"), "see and clear remembered misses"),
    ):
        p = sub.add_parser(name, help=help_text)
        common(p)
        p.add_argument("action", choices=actions)
        p.add_argument("build_id", nargs="?", help="only this build ID")
        p.add_argument("--all", action="store_true",
                       help=f"with {_ALL_GOES_WITH[name]}: everything")
        p.add_argument("--json", action="store_true", help="machine-readable output")
        if name == "cache":
            p.add_argument("--pinned", action="store_true",
                           help="with ls: only uploads, which are never evicted")
        p.set_defaults(func=_admin)

    db = sub.add_parser("db", help="database schema")
    common(db)
    db.add_argument("db_command", choices=["upgrade", "current"])
    db.set_defaults(func=_db)
    return parser


def _refuse_what_goes_nowhere(parser: argparse.ArgumentParser, args: argparse.Namespace
                              ) -> None:
    """An option given to a command it means nothing to is a usage error (exit 2): said, not
    ignored, for the command did its work as if it had not been given, and nothing told the
    user that it went nowhere."""
    if args.func in (_symbolize, _inspect) and not args.server:
        # inspect's --tenant and --timeout are the configuration's upstreams' too.
        only_with_server = ["--token-file"] + (["--tenant", "--timeout"]
                                               if args.func is _symbolize else [])
        given = [flag for flag in only_with_server
                 if getattr(args, flag[2:].replace("-", "_")) is not None]
        if given:
            named = " and ".join([", ".join(given[:-1]), given[-1]] if len(given) > 1 else given)
            parser.error(f"{named} {'need' if len(given) > 1 else 'needs'} --server")
    if args.func is _admin:
        if args.all and args.action != _ALL_GOES_WITH[args.command]:
            parser.error(f"--all goes with {args.command} {_ALL_GOES_WITH[args.command]}, not "
                         f"{args.command} {args.action}")
        if args.all and args.build_id is not None:  # the BUILD_ID's alone were taken
            parser.error(f"{args.command} {args.action} takes a BUILD_ID or --all, not both")
        if args.action == _ALL_GOES_WITH[args.command] and args.build_id is None \
                and not args.all:
            parser.error(f"{args.command} {args.action} needs a BUILD_ID, or --all")
        if getattr(args, "pinned", False) and args.action != "ls":
            parser.error(f"--pinned goes with cache ls, not cache {args.action}")
        if args.command == "cache" and args.action == "stats" and args.build_id is not None:
            # It took a BUILD_ID, as ls and purge do, and printed the whole cache's numbers.
            parser.error("cache stats is of the whole cache; `cache ls BUILD_ID` lists one "
                         "build ID's artifacts")


def main(argv: list[str] | None = None, loaded: Callable[[], None] | None = None) -> int:
    """Run the command line `argv`; `loaded` is called once the command's modules are
    imported (proxy.tools.entry)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # argparse matches a positional that may be empty to nothing once an option comes between
    # it and what went before: `cache purge --config FILE ID` and `prefetch ID --server URL
    # ID2` were "unrecognized arguments: ID". Such words are taken as those positionals.
    func = getattr(args, "func", None)
    if extra and not any(word.startswith("-") for word in extra):
        if func is _admin and args.build_id is None:
            args.build_id = extra.pop(0)
        elif func is _prefetch:
            args.build_ids += extra
            extra = []
        elif func is _upload:
            args.paths += [Path(word) for word in extra]
            extra = []
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.func is _serve:
        import proxy.web.app  # noqa: F401  (before `loaded`: the server's modules)
    if loaded is not None:
        loaded()
    _refuse_what_goes_nowhere(parser, args)
    if args.func is _prefetch and not args.kind:
        args.kind = ["debuginfo", "executable"]
    logs.configure(json_lines=False)
    from sqlalchemy.exc import SQLAlchemyError

    try:
        return int(args.func(args))
    except ConfigError as e:
        # Not 2, a usage error's: a bad file is no misuse of the command, and a service
        # manager told not to restart on EX_CONFIG (systemd's RestartPreventExitStatus=) stops
        # there rather than failing again in a loop.
        where = f"{e.file}: " if e.file is not None else ""
        print(f"symgate: configuration error: {where}{e}", file=sys.stderr)
        return os.EX_CONFIG
    except TokenError as e:
        print(f"symgate: {e}", file=sys.stderr)
        return 2
    except migrate.UnknownRevision as e:  # db commands: a database a newer symgate migrated
        print(f"symgate: database error: {e}", file=sys.stderr)
        return 1
    except SQLAlchemyError as e:  # db and admin commands: a database out of reach, a bad URL
        text = str(getattr(e, "orig", None) or e).splitlines()[0]
        print(f"symgate: database error: {text}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # Its reader stopped reading (`symgate cache ls | head`): nothing is wrong with the
        # database, and nothing is left to say. Python would report the pipe again as it
        # flushes stdout at exit: stdout goes nowhere from here on.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as e:  # asyncpg raises the socket's own error for a refused connection
        on_database = args.command in ("db", "cache", "negative")
        what = "cannot reach the database: " if on_database else ""
        if on_database and isinstance(e, TimeoutError):  # which says nothing of itself
            e = TimeoutError("no answer within database.timeout_s "
                             f"({_config(args).database.timeout_s:g} s)")
        print(f"symgate: {what}{e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
