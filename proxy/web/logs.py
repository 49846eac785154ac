"""Access and event logs: text for people, or JSON lines for log pipelines.

Handlers put what they learned (outcome, upstream, artifact kind) on the request under
LOG_FIELDS; the access logger adds status, bytes and duration and writes one line a request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import select
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from aiohttp.web import BaseRequest, StreamResponse

LOG_FIELDS: web.RequestKey[dict[str, Any]] = web.RequestKey("symgate.log", dict)


def annotate(request: BaseRequest, **fields: Any) -> None:
    """Add fields to this request's access-log line."""
    request.setdefault(LOG_FIELDS, {}).update(fields)


# What a process holds of its stderr lines while nobody reads them, before it drops lines.
HELD_BYTES = 4 * 1024 * 1024
# How long a stopping process waits for its held lines to go out to a reader that is stalled.
_LAST_WRITE_S = 2.0


class StderrLines:
    """Everything a process writes to its stderr (access lines and event records), written by
    a thread of its own. A reader that stops reading (a stalled journald or log shipper, a
    pipe into a pager left open) blocked the event loop in write(2) once the pipe was full:
    the server answered nothing more until someone read. Now only this thread waits; lines
    are held up to `max_bytes`, past that dropped and counted, and once lines go out again a
    line says how many were lost (and symgate_log_lines_dropped_total counts them)."""

    def __init__(self, fd: int, max_bytes: int = HELD_BYTES) -> None:
        self._fd = fd
        self._max_bytes = max_bytes
        self._held: list[bytes] = []
        self._size = 0
        self._dropped = 0
        self._writing = False
        self._thread: threading.Thread | None = None
        self._ready = threading.Condition()
        # The line that reports drops, in the log's format (set by configure()).
        self.notice: Callable[[int], bytes] = lambda n: f"{n} log lines dropped\n".encode()
        # Told of every drop, from any thread (the app's metric).
        self.on_dropped: Callable[[int], None] | None = None
        os.register_at_fork(before=self._ready.acquire, after_in_parent=self._ready.release,
                            after_in_child=self._forked)

    def write(self, data: bytes, lines: int = 1) -> None:
        """Hand `lines` of text to the writer, or drop them if too much is held already."""
        with self._ready:
            if self._size + len(data) > self._max_bytes:
                self._dropped += lines
                dropped = True
            else:
                dropped = False
                self._held.append(data)
                self._size += len(data)
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="stderr lines",
                                                    daemon=True)
                    self._thread.start()
                self._ready.notify()
        if dropped and self.on_dropped is not None:
            self.on_dropped(lines)

    def flush(self, timeout_s: float = _LAST_WRITE_S) -> None:
        """Wait up to `timeout_s` for what is held to be written (a process about to end)."""
        with self._ready:
            self._ready.wait_for(lambda: not (self._held or self._dropped or self._writing)
                                 or self._thread is None, timeout_s)

    def _run(self) -> None:
        while True:
            with self._ready:
                self._ready.wait_for(lambda: bool(self._held or self._dropped))
                data = b"".join(self._held)
                self._held.clear()
                self._size = 0
                dropped, self._dropped = self._dropped, 0
                self._writing = True
            if dropped:  # after the lines held before they were dropped
                data += self.notice(dropped)
            try:
                for piece in _whole_lines(data):
                    while piece:
                        piece = piece[os.write(self._fd, piece):]
            except OSError:
                pass  # a reader gone for good (EPIPE): nowhere left to say anything
            with self._ready:
                self._writing = False
                self._ready.notify_all()

    def _forked(self) -> None:
        # The child has none of the parent's threads, and what was held is the parent's to
        # write; the lock was taken before the fork, so nothing was half done.
        self._ready = threading.Condition()
        self._held, self._size, self._dropped, self._writing = [], 0, 0, False
        self._thread = None


def _whole_lines(data: bytes) -> Iterator[memoryview]:
    """`data` in writes of at most PIPE_BUF bytes that end where a line does. The serving
    processes of `serve --workers N` share one pipe, and only a write that small is atomic:
    larger, two processes' writes to a pipe that is full were spliced mid-line, each line
    at the seam unreadable. (A line longer than PIPE_BUF goes in one write of its own.)"""
    view = memoryview(data)
    start = 0
    while start < len(data):
        end = start + select.PIPE_BUF
        if end < len(data):
            cut = data.rfind(b"\n", start, end)
            end = cut + 1 if cut >= start else (data.find(b"\n", end) + 1 or len(data))
        yield view[start:end]
        start = end


_STDERR: StderrLines | None = None


def stderr_lines() -> StderrLines:
    """This process's one writer of fd 2 (a process has one stderr; every writer of it must
    share one queue, or one could block where another would not)."""
    global _STDERR
    if _STDERR is None:
        _STDERR = StderrLines(2)
    return _STDERR


class StderrHandler(logging.Handler):
    """logging's records, written through stderr_lines(): never blocking the caller."""

    def __init__(self, lines: StderrLines) -> None:
        super().__init__()
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record) + "\n"
        except Exception:
            self.handleError(record)
            return
        self.lines.write(text.encode("utf-8", "backslashreplace"))

    def flush(self) -> None:
        self.lines.flush()


class AccessSink:
    """Access lines gathered in memory and handed to stderr_lines() in batches: one for up to
    `max_bytes` of lines, or `delay_s` after the first line of a batch, rather than a trip
    through the logging module and a write(2) per request, which cost a third of a
    remembered miss's time. What a crash can lose is the last `delay_s` of lines."""

    def __init__(self, lines: StderrLines, *, max_bytes: int = 64 * 1024,
                 delay_s: float = 0.2) -> None:
        self._out = lines
        self._max_bytes = max_bytes
        self._delay_s = delay_s
        self._lines: list[str] = []
        self._size = 0
        self._timer: asyncio.TimerHandle | None = None
        self._second = -1
        self._stamp = ""

    def stamp(self, now: float) -> str:
        """logging's default asctime (local time, milliseconds), the seconds made once."""
        second = int(now)
        if second != self._second:
            self._second = second
            self._stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(second))
        return f"{self._stamp},{int((now - second) * 1000):03d}"

    def write(self, line: str) -> None:
        self._lines.append(line)
        self._size += len(line)
        if self._size >= self._max_bytes:
            self.flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self._delay_s, self.flush)

    def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._lines:
            return
        data = "".join(self._lines).encode(errors="replace")
        count = len(self._lines)
        self._lines.clear()
        self._size = 0
        self._out.write(data, count)


def bind(access_logger: type[AccessLogger], sink: AccessSink) -> type[AccessLogger]:
    """The access logger class, writing to `sink` (aiohttp makes one logger a connection)."""
    return type(access_logger.__name__, (access_logger,), {"sink": sink})


# Statuses whose responses have no body (RFC 9110, 6.4.1): aiohttp's count for them, with no
# Content-Length, is the head's bytes (a 304 was logged with ~300 bytes).
_NO_BODY = frozenset({204, 304})


class AccessLogger(AbstractAccessLogger):
    json_lines = False
    # Where lines go: a batching sink, or (None) the logger given, one record a request.
    sink: AccessSink | None = None

    def log(self, request: BaseRequest, response: StreamResponse, time_s: float) -> None:
        # body_length counts the header bytes too; Content-Length is the body, where known.
        fields_in = request.get(LOG_FIELDS, {})
        if request.method == "HEAD" or response.status in _NO_BODY:
            sent = 0
        elif "sent" in fields_in:  # cut off: what went out, not what was announced
            sent = fields_in["sent"]
        elif response.content_length is not None:
            sent = response.content_length
        else:
            sent = response.body_length
        self.line(request.remote, request.method, request.path, response.status, sent, time_s,
                  fields_in, request.headers.get("User-Agent", ""))

    def line(self, remote: str | None, method: str, path: str, status: int, sent: int,
             time_s: float, fields_in: dict[str, Any], user_agent: str) -> None:
        """One request's line; also proxy.web.fast_hits', whose requests aiohttp never saw."""
        path, user_agent = _clipped(path, MAX_PATH), _clipped(user_agent, MAX_USER_AGENT)
        if not self.json_lines:  # JSON escapes them itself
            path, user_agent = _one_line(path), _one_line(user_agent)
        sink = self.sink
        if not self.json_lines and sink is not None:  # the default, and every hit's: cheap
            extra = " ".join(f"{k}={v}" for k in ("kind", "outcome", "upstream")
                             if (v := fields_in.get(k))) + _why(fields_in)
            sink.write(f'{sink.stamp(time.time())} INFO {self.logger.name}: {remote} '
                       f'"{method} {path}" {status} {sent} {time_s:.3f}s {extra} '
                       f'"{user_agent}"\n')
            return
        fields: dict[str, Any] = {
            "remote": remote, "method": method, "path": path, "status": status, "bytes": sent,
            "duration_s": round(time_s, 6),
            **{k: _unicode(_clipped(v, MAX_ERROR)) for k, v in fields_in.items()
               if k != "sent"},
            "user_agent": user_agent,
        }
        if self.json_lines:
            fields["path"], fields["user_agent"] = _unicode(path), _unicode(user_agent)
        if self.json_lines:
            if sink is None:
                self.logger.info(json.dumps(fields))
                return
            now = time.time()
            sink.write(json.dumps({"ts": _utc_stamp(now), "level": "info",
                                   "logger": self.logger.name, "access": fields}) + "\n")
            return
        extra = " ".join(f"{k}={fields[k]}" for k in ("kind", "outcome", "upstream")
                         if fields.get(k)) + _why(fields)
        self.logger.info('%s "%s %s" %d %d %.3fs %s "%s"', remote, method, path, status, sent,
                         time_s, extra, user_agent)


def _why(fields: dict[str, Any]) -> str:
    """A failed request's reason in a text line (the JSON line's "error"): which upstream
    failed and how, what was wrong with the request. Quoted and escaped as a path is."""
    error = fields.get("error")
    return f' error="{_one_line(_clipped(str(error), MAX_ERROR))}"' if error else ""


# The most of a client's or an upstream's text an access line carries, in characters: each
# may take six in the line (a control character escaped), and a line must stay well within
# what log drivers keep as one record (Docker's 16 KiB, journald's 48 KiB): the rest of a
# longer line becomes a record of its own, whose text the client chose. aiohttp lets a path
# or a header be 8 KB, which made a 58 KB line.
MAX_PATH = 1024
MAX_USER_AGENT = 256
MAX_ERROR = 512


def _clipped(value: Any, limit: int) -> Any:
    """A str of more than `limit` characters cut there, saying how much more there was."""
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]}...({len(value) - limit} more)"
    return value


def _unicode(value: Any) -> Any:
    """`value`, a str as Unicode a JSON line can carry: aiohttp hands on the bytes of a header
    that are not UTF-8 as lone surrogates, which json.dumps writes as "\\udcff", and strict
    parsers (serde_json, as in Vector) refuse such a line (RFC 7493). Such a byte is written
    as the text log writes it, "\\udcff" as text."""
    if isinstance(value, str) and not value.isascii():
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    return value


def _one_line(text: str) -> str:
    """`text` as it can stand between quotes in a line of the text log: a client's quote,
    backslash, newline or other control character escaped, so that it cannot end the line and
    forge another (a path is percent-decoded: %0A is a newline)."""
    if text.isprintable() and '"' not in text and "\\" not in text:
        return text
    return "".join(map(_escaped, text))


def _escaped(c: str) -> str:
    if c == '"':
        return '\\"'
    return c if c.isprintable() and c != "\\" else c.encode("unicode_escape").decode("ascii")


class JsonAccessLogger(AccessLogger):
    json_lines = True


def _utc_stamp(now: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + \
        f".{int((now - int(now)) * 1000):03d}Z"


class JsonFormatter(logging.Formatter):
    """Every log record as one JSON object; access lines keep their own JSON as `access`."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        out: dict[str, Any] = {
            "ts": _utc_stamp(record.created),
            "level": record.levelname.lower(), "logger": record.name,
        }
        if record.name == "symgate.access" and message.startswith("{"):
            out["access"] = json.loads(message)
        else:
            out["message"] = _unicode(message)
        if record.exc_info:
            out["exception"] = _unicode(self.formatException(record.exc_info))
        return json.dumps(out)


class TextFormatter(logging.Formatter):
    """Event records as text lines, whatever their arguments hold: a source path a client
    chose, an upstream's words. A character that is not printable (a C1 control such as CSI,
    an ANSI escape to a terminal that reads them; NEL or U+2028, a line break to many log
    viewers; a byte that is not UTF-8) is escaped in the message, and in a traceback all but
    its line breaks are."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        if not record.message.isprintable():
            record.message = "".join(map(_printable, record.message))
        return super().formatMessage(record)

    def formatException(self, ei: Any) -> str:
        text = super().formatException(ei)
        return "\n".join(line if line.isprintable() else "".join(map(_printable, line))
                         for line in text.split("\n"))


def shown(text: str, limit: int) -> str:
    """`text` as it can be shown anywhere (a page, a line): what is not printable escaped
    (a byte that is not UTF-8, which no response can encode, among it), cut at `limit`."""
    text = _clipped(text, limit)
    return text if text.isprintable() else "".join(map(_printable, text))


def _printable(c: str) -> str:
    return c if c.isprintable() else c.encode("unicode_escape").decode("ascii")


class RepeatFilter(logging.Filter):
    """Lets through `burst` records of one kind (logger, level, message template) per `window_s`
    and drops the rest; the first record let through after a window with drops says how many
    were dropped. A flood of one failure (a full file table, a scanner's garbage) then costs a
    few lines, not megabytes. Access lines, one per request by design, are never dropped."""

    def __init__(self, window_s: float = 10.0, burst: int = 5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.window_s = window_s
        self.burst = burst
        self._clock = clock
        # kind -> [window start, records let through, records dropped]
        self._seen: dict[tuple[str, int, str], list[float]] = {}
        self._lock = threading.Lock()  # handlers run in worker threads too (to_thread)

    def filter(self, record: logging.LogRecord) -> bool:
        # Migrations log one line of one template per revision they run: a short sequence, not
        # a flood, and the last lines say where the schema ended.
        if record.name == "symgate.access" or record.name.startswith("alembic."):
            return True
        kind = (record.name, record.levelno, str(record.msg))
        now = self._clock()
        with self._lock:
            entry = self._seen.get(kind)
            if entry is None or now - entry[0] >= self.window_s:
                dropped = int(entry[2]) if entry is not None else 0
                if len(self._seen) > 10_000:  # bounded however many kinds appear
                    self._seen.clear()
                self._seen[kind] = [now, 1, 0]
                if entry is not None and dropped:
                    record.msg = (f"{record.getMessage()} ({dropped} more like this in the "
                                  f"last {now - entry[0]:.0f} s)")
                    record.args = None
                return True
            if entry[1] < self.burst:
                entry[1] += 1
                return True
            entry[2] += 1
            return False


class OneLineClientErrors(logging.Filter):
    """aiohttp logs a full traceback for every request it cannot parse (garbage, a bad method,
    an oversized header) and for a client that left mid-response: that is the client's doing,
    so it gets one line naming the peer and the reason."""

    def filter(self, record: logging.LogRecord) -> bool:
        from aiohttp.http_exceptions import HttpProcessingError

        if not record.exc_info or record.exc_info[1] is None:
            return True
        error = record.exc_info[1]
        if isinstance(error, HttpProcessingError):
            peer = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
            reason = " ".join(str(error.message or type(error).__name__).split())[:200]
            record.msg, record.args = "bad request from %s: %s", (peer, reason)
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        elif isinstance(error, ConnectionError):
            record.msg = f"{record.getMessage()}: {type(error).__name__}: {error}"
            record.args = None
            record.levelno, record.levelname = logging.INFO, "INFO"
        else:
            return True
        record.exc_info = record.exc_text = None
        return True


def loop_exception_handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """asyncio's default handler logs a traceback per failure; accept() failing for want of
    descriptors (EMFILE, ENFILE) fails once a second per socket for as long as it lasts.
    Errors from the OS get one line; the log's RepeatFilter bounds how many."""
    error = context.get("exception")
    if isinstance(error, ConnectionError) and context.get("message") == _UNRETRIEVED:
        # A connection lost with an answer owed to a request that no longer waits: a query the
        # request's database budget cut short, whose connection was then terminated (asyncpg's
        # "unexpected connection_lost() call"). What an outage does, said with its warnings,
        # not as an error of symgate's.
        logging.getLogger("symgate.loop").warning(
            "a connection was lost with an answer no request waits for: %s", error)
        return
    if isinstance(error, OSError):
        logging.getLogger("symgate.loop").error("%s: %s", context.get("message", "error"),
                                                error)
        return
    loop.default_exception_handler(context)


# asyncio's words for a future whose exception nobody read, said when it is collected.
_UNRETRIEVED = "Future exception was never retrieved"


def configure(json_lines: bool, serving: bool = False) -> None:
    """Event records to stderr, as JSON lines or text. A serving process hands them to
    stderr_lines(), never to wait for a reader. One that does not serve (a command, the
    supervisor of `serve --workers N`, which writes a few lines about its workers) writes
    them as they come, and waits for a reader that stops reading: a test of the supervisor's
    stop signal window holds it there (tests/test_workers.py)."""
    lines = stderr_lines() if serving else None
    handler: logging.Handler = StderrHandler(lines) if lines is not None \
        else logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if json_lines else TextFormatter())

    def notice(dropped: int) -> bytes:
        record = logging.makeLogRecord({
            "name": "symgate.log", "levelno": logging.WARNING, "levelname": "WARNING",
            "msg": "%d log lines dropped: stderr was not read as fast as they came",
            "args": (dropped,)})
        return (handler.format(record) + "\n").encode()

    if lines is not None:
        lines.notice = notice
    handler.addFilter(RepeatFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    # alembic is imported when a migration runs, after this: its import-time chatter ("setup
    # plugin ...", five lines) says nothing to an operator.
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)
    server_log = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, OneLineClientErrors) for f in server_log.filters):
        server_log.addFilter(OneLineClientErrors())
