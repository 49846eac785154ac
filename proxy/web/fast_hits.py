"""The commonest requests of all, answered where they arrive: a plain GET or HEAD of a cached
file whose response is known already (proxy.web.hot_files), or of a key every upstream is
remembered not to have, as bytes written to the socket; a GET of a file too big to keep in
memory as its head, then the file with sendfile(2) (QuickFile, sent by the connection).

A profiler's backend asks for the same few hundred build IDs all day, and for the same build
IDs nobody has (stripped vendor binaries, JIT maps). Through aiohttp such a request cost ~65 us
of CPU, half of it aiohttp's request and response objects, routing, middleware and the
handler's task, for an answer that is the same bytes every time but for the Date header; one
answered from the connection's first look at its bytes costs a third of that. It is the same
answer: the same headers (hot_files encodes a hit's once, errors.error_response makes the
404's), the same count in symgate_requests_total, the same hit on the cache index, the same
access line, and a remembered 404 on the status page's recent misses. A 4.2 MB hit, whose
sendfile aiohttp's objects wrapped in a third of the process's time, went from 0.86-0.90x
nginx's rate (one worker each) to 0.94-1.0x (bench/proxy_bench.py, and interleaved A/B runs).

Only what needs nothing else is taken: one complete request head in one read, GET or HEAD of
/buildid/<id>/debuginfo or /executable over HTTP/1.1, or over HTTP/1.0 with keep-alive (ab's,
and older clients'; answered as aiohttp answers it, in HTTP/1.0 with `Connection: keep-alive`),
and no header but those that change nothing in the answer (and an X-DEBUGINFOD-MAXSIZE a hit
fits), each once, Host among them in HTTP/1.1, every line in RFC 9110's plain syntax: a head
aiohttp's parser would refuse is its to refuse. Anything else (a tenant's header or token,
conditional and range requests, forwarding headers, Cache-Control, a body, pipelined requests,
a head split across reads, a miss that memory alone cannot tell, a hit whose file another
process replaced) goes to aiohttp as before; proxy.web.connections says when a connection
aiohttp has had gets quick answers again (a big file's too, aiohttp's keep-alive timer held
while it goes out).
"""

from __future__ import annotations

import email.utils
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

from aiohttp.http import SERVER_SOFTWARE

from proxy.artifacts.index import CachedArtifact
from proxy.artifacts.scope import SHARED
from proxy.errors import RememberedNotFound, SymgateError
from proxy.keys import ArtifactKey
from proxy.metrics import ABORTED, Served
from proxy.sources.base import Hop
from proxy.web.errors import cut_reason, error_response
from proxy.web.hot_files import HotFile, hot_file
from proxy.web.logs import AccessLogger
from proxy.web.state import AppState

_REQUEST_LINE = re.compile(
    rb"(GET|HEAD) /buildid/([0-9A-Fa-f]{1,256})/(debuginfo|executable) HTTP/1\.([01])\r\n")
# Request headers that change nothing in the answer (Connection: only keep-alive), and
# elfutils' size limit, which a hit meets or the usual path refuses.
_PLAIN = frozenset({b"host", b"user-agent", b"accept", b"accept-encoding", b"connection",
                    b"x-debuginfod-maxsize"})
# A header line as RFC 9110 writes it: a token, a colon, a value of visible ASCII, spaces and
# tabs (its outer whitespace stripped after). A line that is anything else (a bare CR or LF,
# NUL or another control, obs-text) is aiohttp's parser's to judge, and mostly refuse:
# answered here, it would be a 200 that the same head otherwise never gets. One class for the
# whole value: no backtracking, however long a line of whitespace.
_FIELD = re.compile(rb"([!#$%&'*+.^_`|~0-9A-Za-z-]+):([\t\x20-\x7e]*)")
# aiohttp's longest request line and header line (max_line_size, max_field_size): a head past
# it, whatever its lines, is left to aiohttp, which says 400 where one is too long.
_MAX_HEAD = 8190
_VISIBLE = (SHARED,)  # a request without X-Scope-OrgID or a token: no tenant (web.tenancy)
# An HTTP/1.0 client is answered in its version, and told its connection stays (aiohttp's
# words, after Server).
_KEPT_ALIVE_1_0 = b"Connection: keep-alive\r\n"
_STATUS = {200: b" 200 OK\r\n", 404: b" 404 Not Found\r\n"}


class FastHits:
    def __init__(self, state: AppState, access: AccessLogger | None) -> None:
        self._state = state
        self._access = access
        self._second = -1
        self._date_server = b""  # the Date and Server lines: made once a second
        # What a plain request may see and ask (web.tenancy): no tenant, the shared sources;
        # and whether it may go upstream at all (web.artifacts.hop_of, with no hop before).
        self._plain = state.tenancy.scope(
            "", Hop(), state.config.server.forwarded_ttl_limit > 0)
        # A site whose requests that name no tenant need a token ([tenants.""] with tokens):
        # every request is the tenancy's to judge (a 401 without it), none answered here.
        self._open = state.tenancy.anonymous_allowed
        missing = RememberedNotFound()
        self._missing_reason = missing.reason
        # The usual path's answer, made by the same function: its status and header lines.
        answer = error_response(missing, "", state.config.server.retry_after_s, artifact=True)
        assert isinstance(answer.body, bytes)
        self._missing = hot_file({**answer.headers, "Content-Length": str(len(answer.body))},
                                 answer.body)
        self._missing_code = answer.status
        assert _STATUS[answer.status] == f" {answer.status} {answer.reason}\r\n".encode()

    def answer(self, data: bytes, remote: str | None, whole_files: bool
               ) -> bytes | QuickFile | None:
        """The whole response to `data`, counted and logged; or, for a GET of a file too big
        to keep in memory (where `whole_files`), its head and the file that the connection
        sends after it; None: aiohttp's to answer."""
        started = time.perf_counter()
        if not self._open:
            return None
        req = _plain_request(data)
        if req is None:
            return None
        found = self._hit(req, whole_files) or self._remembered_miss(req)
        if found is None:
            return None
        code, hot, fields, file = found
        outcome = fields["outcome"]
        state = self._state
        response = self._response(req.one_zero, code, hot)
        (state.metrics.quick_hits if outcome is Served.HIT else state.metrics.quick_misses).inc()
        if file is not None:  # in requests_total once sent or cut off (errors.CountedWhenSent)
            return self._file_answer(req, remote, response, file, fields, started)
        state.metrics.count_buildid(req.kind, outcome)
        sent = 0
        if not req.head_only and hot.body is not None:
            response += hot.body
            sent = len(hot.body)
            if outcome is Served.HIT:
                state.metrics.served_from_cache.inc(sent)
        if self._access is not None:
            self._access.line(remote, req.method, f"/buildid/{req.build_id}/{req.kind}", code,
                              sent, time.perf_counter() - started, fields, req.user_agent)
        return response

    def _hit(self, req: _Request, whole_files: bool) -> _Found | None:
        """A hit whose answer is in memory, touched in the cache index; for a GET of a file
        too big to keep there, with its file opened now, while the index says it is there."""
        state = self._state
        hit = state.service.hit_now(_VISIBLE, req.key)
        if hit is None or 0 <= req.max_size < hit.record.size:
            return None
        # The first hit since the commit (a download's, or another process's) reads the
        # file's headers here, as aiohttp's path would: a client's first request would
        # otherwise go to aiohttp, and with it every big file after on that connection.
        kh = hit.record.key_hash
        hot = state.hot.get(kh, hit.record.fetched_at) or state.hot.load(kh, hit)
        if hot is None or not hot.head:
            return None
        file = None
        if hot.body is None and not req.head_only:
            if not whole_files:
                return None
            try:
                fd = os.open(hit.path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                return None  # evicted by another process: aiohttp's path looks again
            if not hot.describes(fd):  # replaced by another process: aiohttp's path finds
                os.close(fd)           # the new commit
                return None
            file = _OpenedFile(fd, hit)
        state.service.cache.touch(hit)
        return 200, hot, {"endpoint": "buildid", "kind": req.kind, "outcome": Served.HIT,
                          "upstream": hit.record.upstream}, file

    def _file_answer(self, req: _Request, remote: str | None, head: bytes, file: _OpenedFile,
                     fields: dict[str, Any], started: float) -> QuickFile:
        """What aiohttp's path (web.artifacts._SentFile) does around the same sendfile: the
        cache's lease held until the last byte is out, then the bytes that went out counted
        and logged."""
        state = self._state
        lease = state.service.cache.lease(file.artifact.scope, req.key)
        lease.__enter__()

        def finish(sent: int, cut: BaseException | None) -> None:
            lease.__exit__(None, None, None)
            state.metrics.served_from_cache.inc(sent)
            told = fields
            if sent < file.artifact.record.size:  # the client left, or the server stopped
                # What ended it, in the words aiohttp's path logs (errors.CountedWhenSent):
                # a client cut for not reading, one that reset, a file cut short on disk.
                why = cut_reason(cut) if cut is not None \
                    else "the connection ended before the file's last byte"
                told = {**fields, "outcome": ABORTED, "error": why}
                state.metrics.count_buildid(req.kind, ABORTED)
            else:
                state.metrics.count_buildid(req.kind, Served.HIT)
            if self._access is not None:
                self._access.line(remote, req.method, f"/buildid/{req.build_id}/{req.kind}",
                                  200, sent, time.perf_counter() - started, told,
                                  req.user_agent)

        # Unbuffered: sendfile(2) reads it, never Python (a buffer costs a seek and an ioctl).
        return QuickFile(head, open(file.fd, "rb", buffering=0),  # closed by finish()
                         file.artifact.record.size, req.key.id, finish)

    def _remembered_miss(self, req: _Request) -> _Found | None:
        """A miss memory alone says is remembered, put on the status page as aiohttp's are."""
        state = self._state
        if not state.service.remembered_now(self._plain, req.key):
            return None
        outcome, reason = Served.NEGATIVE_HIT, self._missing_reason
        state.recent_misses.add(f"{req.build_id}/{req.kind}", outcome, reason)
        return self._missing_code, self._missing, {"endpoint": "buildid", "kind": req.kind,
                                                   "outcome": outcome, "error": reason}, None

    def _response(self, one_zero: bool, code: int, hot: HotFile) -> bytes:
        """The status line and headers, as aiohttp writes them: the request's version, the
        answer's own lines, Date and Server, and for HTTP/1.0 its keep-alive."""
        now = int(time.time())
        if now != self._second:
            self._second = now
            self._date_server = (f"Date: {email.utils.formatdate(now, usegmt=True)}\r\n"
                                 f"Server: {SERVER_SOFTWARE}\r\n").encode()
        return b"".join((b"HTTP/1.0" if one_zero else b"HTTP/1.1", _STATUS[code], hot.head,
                         self._date_server, _KEPT_ALIVE_1_0 if one_zero else b"", b"\r\n"))


@dataclass(slots=True)  # not frozen: its __init__ would cost 2.4 us a request, not 0.5
class _Request:
    method: str
    build_id: str  # as the request wrote it
    kind: str
    key: ArtifactKey
    one_zero: bool  # HTTP/1.0 (with keep-alive), else HTTP/1.1
    user_agent: str
    max_size: int  # X-DEBUGINFOD-MAXSIZE, -1 for none

    @property
    def head_only(self) -> bool:
        return self.method == "HEAD"


@dataclass(frozen=True, slots=True)
class _OpenedFile:
    fd: int  # opened when the hit was found
    artifact: CachedArtifact


# A status code, the answer's own header lines, its access-log fields, and for a GET of a file
# too big to keep in memory, that file.
_Found = tuple[int, HotFile, dict[str, Any], _OpenedFile | None]


class QuickFile:
    """A quick hit of a file too big to keep in memory: `head` is written at once, then `file`
    (`size` bytes from its start) with sendfile(2), by the connection (proxy.web.connections);
    finish() once that is over, however it ended: the file's position tells what went out,
    and `cut` what ended it short, where that is known."""

    __slots__ = ("_finish", "file", "head", "name", "size")

    def __init__(self, head: bytes, file: IO[bytes], size: int, name: str,
                 finish: Callable[[int, BaseException | None], None]) -> None:
        self.head, self.file, self.size, self.name = head, file, size, name
        self._finish: Callable[[int, BaseException | None], None] | None = finish

    def finish(self, cut: BaseException | None = None) -> None:
        """Once, however often called."""
        finish, self._finish = self._finish, None
        if finish is None:
            return
        try:
            sent = self.file.tell()  # asyncio's sendfile leaves it past what it sent
        except (OSError, ValueError):
            sent = 0
        self.file.close()
        finish(sent, cut)


def _plain_request(data: bytes) -> _Request | None:
    """`data` as a plain request (see the module docstring), or None: aiohttp's to parse."""
    end = data.find(b"\r\n\r\n")
    if end < 0 or end != len(data) - 4 or end > _MAX_HEAD:
        return None  # no whole head, or more than one request, or a body, or a long one
    line = _REQUEST_LINE.match(data)
    if line is None:
        return None
    user_agent, max_size, keep_alive = "", -1, False
    seen: set[bytes] = set()
    for row in data[line.end(): end].split(b"\r\n") if end > line.end() else ():
        field = _FIELD.fullmatch(row)
        if field is None:
            return None
        name, value = field[1].lower(), field[2].strip(b" \t")
        if name not in _PLAIN or name in seen:
            return None  # another header, or one twice (two Hosts are a 400)
        seen.add(name)
        if name == b"connection":
            if value.lower() != b"keep-alive":
                return None
            keep_alive = True
        elif name == b"user-agent":
            user_agent = value.decode("ascii")
        elif name == b"x-debuginfod-maxsize":
            if not value.isdigit() or len(value) > 19:
                return None
            max_size = int(value) or -1  # 0: no limit (artifacts._max_size)
    one_zero = line[4] == b"0"
    if one_zero and not keep_alive:
        return None  # HTTP/1.0 closes after its answer: aiohttp's to do
    if not one_zero and b"host" not in seen:
        return None  # HTTP/1.1 without Host: aiohttp's 400
    build_id, kind = line[2].decode(), line[3].decode()
    try:
        key = ArtifactKey.parse(build_id, kind)
    except SymgateError:
        return None  # the usual path says what is wrong with it
    return _Request(line[1].decode(), build_id, kind, key, one_zero, user_agent, max_size)
