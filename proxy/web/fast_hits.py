"""The commonest request of all, answered where it arrives: a plain GET or HEAD of a cached
file whose response is known already (proxy.web.hot_files), as bytes written to the socket.

A profiler's backend asks for the same few hundred build IDs all day. Through aiohttp such a hit
cost ~65 us of CPU, half of it aiohttp's request and response objects, routing, middleware and
the handler's task, for an answer that is the same bytes every time but for the Date header; a
hit answered from the connection's first look at its bytes costs a third of that. It is the
same answer: the same headers (hot_files encodes them once), the same count in
symgate_requests_total, the same hit on the cache index, the same access line.

Only what needs nothing else is taken: one complete request head in one read, GET or HEAD of
/buildid/<id>/debuginfo or /executable over HTTP/1.1, and no header but those that change
nothing in a hit's answer (and an X-DEBUGINFOD-MAXSIZE the file fits), each once, Host among
them, every line in RFC 9110's plain syntax: a head aiohttp's parser would refuse is its to
refuse. Anything else (a tenant's header or token, conditional and range requests, forwarding
headers, Cache-Control, a body, pipelined requests, a head split across reads, a miss, a file
not yet hot) goes to aiohttp as before; proxy.web.connections says when a connection aiohttp
has had gets quick answers again.
"""

from __future__ import annotations

import email.utils
import re
import time

from aiohttp.http import SERVER_SOFTWARE

from proxy.artifacts.scope import SHARED
from proxy.errors import SymgateError
from proxy.keys import ArtifactKey
from proxy.metrics import Served
from proxy.web.logs import AccessLogger
from proxy.web.state import AppState

_REQUEST_LINE = re.compile(
    rb"(GET|HEAD) /buildid/([0-9A-Fa-f]{1,256})/(debuginfo|executable) HTTP/1\.1\r\n")
# Request headers that change nothing in a hit's answer (Connection: only keep-alive), and
# elfutils' size limit, which the answer meets or the usual path refuses.
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
_STATUS = b"HTTP/1.1 200 OK\r\n"


class FastHits:
    def __init__(self, state: AppState, access: AccessLogger | None) -> None:
        self._state = state
        self._access = access
        self._second = -1
        self._tail = b""  # the Date and Server lines, and the blank line: made once a second

    def answer(self, data: bytes, remote: str | None) -> bytes | None:
        """The whole response to `data`, counted and logged; None: aiohttp's to answer."""
        started = time.perf_counter()
        end = data.find(b"\r\n\r\n")
        if end < 0 or end != len(data) - 4 or end > _MAX_HEAD:
            return None  # no whole head, or more than one request, or a body, or a long one
        line = _REQUEST_LINE.match(data)
        if line is None:
            return None
        user_agent, max_size = "", -1
        seen: set[bytes] = set()
        for row in data[line.end(): end].split(b"\r\n") if end > line.end() else ():
            field = _FIELD.fullmatch(row)
            if field is None:
                return None
            name, value = field[1].lower(), field[2].strip(b" \t")
            if name not in _PLAIN or name in seen:
                return None  # another header, or one twice (two Hosts are a 400)
            seen.add(name)
            if name == b"connection" and value.lower() != b"keep-alive":
                return None
            if name == b"user-agent":
                user_agent = value.decode("ascii")
            elif name == b"x-debuginfod-maxsize":
                if not value.isdigit() or len(value) > 19:
                    return None
                max_size = int(value)
        if b"host" not in seen:
            return None  # HTTP/1.1 without Host: aiohttp's 400
        method, kind = line[1].decode(), line[3].decode()
        try:
            key = ArtifactKey.parse(line[2].decode(), kind)
        except SymgateError:
            return None  # the usual path says what is wrong with it
        state = self._state
        hit = state.service.hit_now(_VISIBLE, key)
        if hit is None or 0 <= max_size < hit.record.size:
            return None
        hot = state.hot.get(hit.record.key_hash)
        head_only = method == "HEAD"
        if hot is None or not hot.head or (hot.body is None and not head_only):
            return None
        state.service.cache.touch(hit)
        response = b"".join((_STATUS, hot.head, self._date_and_server()))
        sent = 0
        if not head_only and hot.body is not None:
            response += hot.body
            sent = len(hot.body)
            state.metrics.served_from_cache.inc(sent)
        state.metrics.count_buildid(kind, Served.HIT)
        state.metrics.quick_hits.inc()
        if self._access is not None:
            path = f"/buildid/{line[2].decode()}/{kind}"
            self._access.line(remote, method, path, 200, sent, time.perf_counter() - started,
                              {"kind": kind, "outcome": Served.HIT,
                               "upstream": hit.record.upstream}, user_agent)
        return response

    def _date_and_server(self) -> bytes:
        now = int(time.time())
        if now != self._second:
            self._second = now
            self._tail = (f"Date: {email.utils.formatdate(now, usegmt=True)}\r\n"
                          f"Server: {SERVER_SOFTWARE}\r\n\r\n").encode()
        return self._tail
