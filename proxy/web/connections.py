"""Guarding the listening socket against clients that hold connections: a bound on open
connections (past it, a short 503 written without parsing anything), and the file-descriptor
limit that bound is derived from.

The header read timeout has two halves. Between requests on a kept-alive connection it is
aiohttp's keep-alive timer (keepalive_timeout), which runs from the end of a response and closes
the connection only while no complete request head has arrived, however many bytes trickle in.
For the first request, which older aiohttp versions do not time, the guard keeps its own timer
and looks for the blank line that ends the head.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import socket
from collections.abc import Callable
from typing import IO, Protocol

from aiohttp.streams import StreamReader

from proxy.metrics import ProxyMetrics
from proxy.web.file_sends import cork, cut_connection, reset_on_close, send_if_room, send_whole
from proxy.web.grace import unfinished
from proxy.web.send_timeout import SendTimeouts, is_send_timeout, limit_unacknowledged

log = logging.getLogger(__name__)

# Descriptors kept for everything but client sockets: SQL connections, upstream connections,
# local sources, logs, the build workers' pipes.
RESERVED_FDS = 128
# A client being sent a cached file holds its socket and the file: two descriptors. One
# waiting on a miss of a key of its own holds four: its socket, its reader's descriptor of the
# download's temp file, and that download's temp file and flight lock (clients asking for
# distinct build IDs of a slow upstream, each fetch queued for a slot, hold them all at once).
FDS_PER_CONNECTION = 4
# How long a shed connection may linger to let its 503 reach the client before the socket is
# closed (closing with unread request bytes would make the kernel reset it, losing the 503).
SHED_LINGER_S = 1.0
# Past this many shed connections still lingering, new ones are closed at once without a word.
MAX_LINGERING = 64
# How long a quick file send cut at the end of the shutdown grace has to notice, before it is
# cancelled.
_CUT_S = 0.5
# How often a half-closed connection looks whether its answers are all out, to close it: at
# first soon, then less and less often (each wait twice the last, up to the longest). A look
# every 20 ms all along cost a client that half-closed thousands of connections on a slow cold
# fetch a core's time (6,000 of them: 92% of it, against 2% without the half-close).
_ANSWERED_POLL_S = 0.02
_ANSWERED_POLL_MAX_S = 1.0

_BUSY_TEXT = b"too many connections: try again soon\n"
BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\n"
        b"Content-Length: %d\r\nRetry-After: %%d\r\nConnection: close\r\n\r\n"
        % len(_BUSY_TEXT)) + _BUSY_TEXT.replace(b"%", b"%%")
REQUEST_TIMEOUT = (b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\n"
                   b"Connection: close\r\n\r\n")


class QuickFile(Protocol):
    """proxy.web.fast_hits.QuickFile: a head, then a file's first `size` bytes; finish() once
    they went out or the send broke off (`cut`: with what, where known)."""

    head: bytes
    file: IO[bytes]
    size: int
    name: str  # the artifact's, for the log

    def finish(self, cut: BaseException | None = None) -> None: ...


class QuickAnswers(Protocol):
    """proxy.web.fast_hits.FastHits, as a connection sees it."""

    def answer(self, data: bytes, remote: str | None, whole_files: bool
               ) -> bytes | QuickFile | None: ...


def raise_fd_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (a server's descriptors are its
    connections) and return the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:
            log.warning("cannot raise the open files limit from %d to %d: %s", soft, target, e)
    return soft


def default_max_connections(fd_limit: int) -> int:
    return max(16, (fd_limit - RESERVED_FDS) // FDS_PER_CONNECTION)


class ConnectionGuard:
    """A protocol factory for loop.create_server, wrapping aiohttp's: at most `limit` client
    connections are handed to aiohttp; the others get BUSY and are closed."""

    def __init__(self, factory: Callable[[], asyncio.BaseProtocol], limit: int,
                 retry_after_s: int, header_timeout_s: float, send_timeout_s: float = 0.0
                 ) -> None:
        self._factory = factory
        self.limit = limit
        self.header_timeout_s = header_timeout_s
        self.send_timeout_s = send_timeout_s
        self.timed_out = 0
        self.open = 0
        self.lingering = 0
        self.shed = 0
        self._busy = BUSY % retry_after_s
        # Set once the app is up: hits answered before aiohttp parses them (fast_hits.py).
        self.quick: QuickAnswers | None = None
        # Connections aiohttp has not been told of yet (all their requests answered quickly):
        # closed by close_quick() when the server stops, as aiohttp closes its idle ones.
        self._quick_only: set[_Counted] = set()
        # Connections with a quick file send under way, aiohttp's among them: the server lets
        # them finish (finish_sends) rather than aiohttp's drain closing them.
        self._senders: set[_Counted] = set()
        # Set once the app is up: the count and log of clients cut for not reading.
        self.send_timeouts: SendTimeouts | None = None
        self._metrics: ProxyMetrics | None = None

    def watch(self, metrics: ProxyMetrics) -> None:
        """Tell /metrics the connections open, shed and timed out from now on (once the app
        is up): refused before aiohttp, they are in no request count, and an operator whose
        server turns clients away saw nothing of it."""
        self._metrics = metrics
        metrics.open_connections.set(self.open)

    def _opened(self, by: int) -> None:
        self.open += by
        if self._metrics is not None:
            self._metrics.open_connections.set(self.open)

    def close_quick(self) -> None:
        """Close the connections only quick answers were written to: they are idle whenever
        the loop runs (an answer is written whole, at once), but for a file being sent,
        which is closed once sent (finish_sends), aiohttp's connections' too."""
        for conn in [*self._quick_only, *self._senders]:
            conn.close()

    def sending_for_aiohttp(self) -> set[asyncio.BaseProtocol]:
        """aiohttp's protocols of the connections it has whose quick file send is under way:
        idle to aiohttp, which would close them at once when the server stops."""
        return {conn._inner for conn in self._senders if conn._handed}

    async def finish_sends(self, grace_s: float, cut: asyncio.Event) -> None:
        """The files quick connections are sending get `grace_s` to go out (or until `cut` is
        set), as aiohttp's responses under way do when the server stops; then they are cut."""
        sends = [c._sending for c in self._senders if c._sending is not None]
        if not sends:
            return
        late = await unfinished(sends, grace_s, cut)
        if not late:
            return
        # Cut by shutting the sockets down: the sendfile under way then fails at once and
        # asyncio leaves the file's position past what went out, which the access line tells
        # (a cancelled sendfile leaves it where it began).
        for conn in list(self._senders):
            if conn._sending in late:
                conn.cut_send()
        _done, late = await asyncio.wait(late, timeout=_CUT_S)
        for send in late:
            send.cancel()
        await asyncio.gather(*late, return_exceptions=True)

    def __call__(self) -> asyncio.BaseProtocol:
        if self.open >= self.limit:
            self.shed += 1
            if self._metrics is not None:
                self._metrics.shed_connections.inc()
            return _Shed(self)
        self._opened(1)
        return _Counted(self._factory(), self, self.quick)


class _Counted(asyncio.Protocol):
    """aiohttp's protocol, counted and with its first request head timed: every call is passed
    on, but for the requests `quick` answers while aiohttp has seen none on this connection.

    aiohttp is told of the connection when the first request goes to it. (Told at once, its
    keep-alive timer, which runs from the connection's start, would close a connection busy
    with quick answers it never saw.) Until then the connection's idle time between requests is
    timed here, as aiohttp's keep-alive timer would (header_timeout_s), and a head that comes in
    pieces after quick answers is timed as a first one is.

    Once aiohttp has the connection, a request is answered quickly only while aiohttp waits
    for the next one with nothing under way and nothing half-read (_aiohttp_idle): a client's
    kept-alive connection whose first request was a miss still gets quick hits after it, and
    aiohttp's keep-alive timer is then moved on as its own answers move it, and held while a
    big file goes out. A request with a body, or a head in pieces, leaves the connection to
    aiohttp for good."""

    def __init__(self, inner: asyncio.BaseProtocol, guard: ConnectionGuard,
                 quick: QuickAnswers | None = None) -> None:
        self._inner = inner
        self._guard: ConnectionGuard | None = guard
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._tail = b""  # the last bytes seen, for a blank line split across reads
        self._head_bytes = 0
        self._quick = quick
        self._remote: str | None = None
        self._answered = False  # whether `quick` answered a request here
        self._idle: asyncio.TimerHandle | None = None  # after its answers, until a next request
        self._paused = False  # the client is not reading: no more answers written past aiohttp
        self._handed = False  # whether aiohttp has been told of the connection
        # Whatever aiohttp was given was whole request heads without a body: once it waits
        # for the next request, it holds nothing of this connection's bytes.
        self._clean = True
        # The body of the latest request that had one, as aiohttp reads it (its StreamReader;
        # None where aiohttp's private queue is not there to find it: then a half-close after
        # a body closes the connection, as aiohttp would).
        self._last_body: StreamReader | None = None
        # A big file's quick answer going out (reading paused meanwhile), and whether the
        # connection is to close once it has (the server stopping).
        self._sending: asyncio.Task[None] | None = None
        self._close_after_send = False
        # Its file sent as the server stops, its end sent too: what comes in is dropped.
        self._draining = False
        # After the client's half-close: until aiohttp has answered what it sent, and how long
        # the next look waits.
        self._answering: asyncio.TimerHandle | None = None
        self._answering_wait = _ANSWERED_POLL_S

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        sock = transport.get_extra_info("socket")
        if self._guard is not None and sock is not None:
            limit_unacknowledged(sock, self._guard.send_timeout_s)
        self._time_head()
        if self._quick is None:
            self._hand_over()
            return
        self._remote = self._peer()
        if self._guard is not None:
            self._guard._quick_only.add(self)

    def _peer(self) -> str | None:
        peer = self._transport.get_extra_info("peername") if self._transport else None
        return str(peer[0]) if isinstance(peer, tuple) and peer else None

    def _hand_over(self) -> None:
        if self._handed or self._transport is None:
            return
        self._handed = True
        if self._guard is not None:
            self._guard._quick_only.discard(self)
        self._inner.connection_made(self._transport)
        if self._paused:
            self._inner.pause_writing()

    def close(self) -> None:
        if self._sending is not None:
            self._close_after_send = True
        elif self._transport is not None and not self._handed:
            self._transport.close()

    def _time_head(self) -> None:
        if self._guard is not None and self._guard.header_timeout_s > 0:
            self._tail, self._head_bytes = b"", 0
            self._timer = asyncio.get_running_loop().call_later(
                self._guard.header_timeout_s, self._head_too_slow)

    def data_received(self, data: bytes) -> None:
        if self._draining:
            return
        if self._timer is not None:
            seen = self._tail + data
            self._head_bytes += len(data)
            # aiohttp answers 400 to a head past its own limits: the timer is then not needed.
            if b"\r\n\r\n" in seen or b"\n\n" in seen or self._head_bytes > 1 << 17:
                self._stop_timer()
            else:
                self._tail = seen[-3:]
        quick = self._quick
        if quick is not None and (not self._handed or (self._clean
                                                       and _aiohttp_idle(self._inner))):
            if self._idle is not None:
                self._idle.cancel()
                self._idle = None
            transport = self._transport
            # A big file where aiohttp was never told of the connection, or where its keep-alive
            # timer, blind to the send, can be held until the file is out (_hold_keep_alive).
            whole_files = not self._handed or _keep_alive_holdable(self._inner)
            if not self._paused and transport is not None and not transport.is_closing() \
                    and (answer := quick.answer(data, self._remote, whole_files)) is not None:
                if isinstance(answer, bytes):
                    transport.write(answer)
                    self._answered_quickly()
                else:
                    self._send_file(transport, answer)
                return
        if not self._handed:
            self._hand_over()
            if self._answered and self._timer is None and b"\r\n\r\n" not in data \
                    and b"\n\n" not in data:
                self._time_head()  # aiohttp times heads only after its own answers
                self._head_bytes, self._tail = len(data), data[-3:]
        if self._clean and not _bodiless_heads(data):
            self._clean = False
        self._inner.data_received(data)  # type: ignore[attr-defined]
        if not self._clean:
            # The latest request's body: only it can lack its end (aiohttp parses the next
            # request once a body is whole), and it may have left aiohttp's queue by the time
            # the client's half-close comes.
            messages = getattr(self._inner, "_messages", None)
            if messages:
                self._last_body = messages[-1][1]

    def _answered_quickly(self) -> None:
        self._answered = True
        if self._handed:
            _keep_alive_from_now(self._inner)
        elif self._guard is not None and self._guard.header_timeout_s > 0:
            self._idle = asyncio.get_running_loop().call_later(
                self._guard.header_timeout_s, self._idle_too_long)

    def _send_file(self, transport: asyncio.Transport, answer: QuickFile) -> None:
        """The head, then the file: sent here where the socket's buffer has room for it all
        (file_sends.send_if_room), else (or for what it did not take) by a task of its own."""
        cork(transport.get_extra_info("socket"))  # uncorked once the last byte is out
        transport.write(answer.head)
        if transport.is_closing():  # the head's write failed: the client is gone
            answer.finish()
            return
        try:
            sent = send_if_room(transport, answer.file, answer.size, answer.name)
        except OSError as e:  # the client, or a file shorter than its entry (ShortFile)
            self._send_failed(e)
            answer.finish(e)
            cut_connection(transport)  # a reset, as errors.cut_off cuts
            return
        if sent == answer.size:
            answer.finish()
            self._answered_quickly()
            return
        # Nothing more is read (a next request) until the file is out.
        transport.pause_reading()
        if self._handed:
            _hold_keep_alive(self._inner)  # set going again by _answered_quickly
        self._sending = send = asyncio.ensure_future(self._send(transport, answer, sent))
        if self._guard is not None:
            self._guard._senders.add(self)
        # A send cancelled before its first step never runs its own `finally`.
        send.add_done_callback(lambda _: self._sent(send, answer))

    def _send_failed(self, error: BaseException) -> None:
        if is_send_timeout(error) and self._guard is not None \
                and self._guard.send_timeouts is not None:
            self._guard.send_timeouts.note(self._remote)

    async def _send(self, transport: asyncio.Transport, answer: QuickFile, offset: int) -> None:
        """The file after its head and its first `offset` bytes, as web.artifacts._SentFile
        sends it; a send that breaks off (the client left, or was cut for not reading) closes
        the connection, since no next answer can follow a short body."""
        sent = False
        cut: BaseException | None = None
        try:
            # No fallback: asyncio's swaps the transport's protocol for its own while it
            # writes, and a connection lost then would never reach this one (the guard's
            # count). A cache file always takes sendfile(2); its failure is the client's.
            await send_whole(transport, answer.file, answer.size, answer.name, fallback=False,
                             offset=offset)
            sent = True
        # OSError: the client, or a file shorter than its entry (ShortFile); RuntimeError:
        # the transport closed meanwhile.
        except (OSError, RuntimeError) as e:
            self._send_failed(e)
            cut = e
        finally:
            self._sent(asyncio.current_task(), answer, cut)
            if not sent:
                cut_connection(transport)  # a reset, as errors.cut_off cuts
        if self._close_after_send:
            if not transport.is_closing():
                self._end_after_file(transport)
        elif not transport.is_closing():
            transport.resume_reading()
            self._answered_quickly()

    def _end_after_file(self, transport: asyncio.Transport) -> None:
        """The server stops: the file is out, the connection ends. Its end is sent after the
        file's last byte, and what the client sent meanwhile (a next request, which reading,
        paused for the send, left in the socket) is read and dropped until the client closes,
        or for SHED_LINGER_S: a socket closed with unread bytes is reset, and the file's tail
        still in the buffers is lost. (aiohttp reads such a request before it closes.)"""
        self._draining = True
        if transport.can_write_eof():
            transport.write_eof()
        else:
            transport.close()
            return
        transport.resume_reading()
        self._idle = asyncio.get_running_loop().call_later(SHED_LINGER_S, self._idle_too_long)

    def _sent(self, send: asyncio.Future[None] | None, answer: QuickFile,
              cut: BaseException | None = None) -> None:
        """The send is over, whichever way: its file let go, counted and logged, once."""
        if self._sending is send:
            self._sending = None
            if self._guard is not None:
                self._guard._senders.discard(self)
        answer.finish(cut)

    def cut_send(self) -> None:
        """End the file being sent: the server stops and its grace is over."""
        sock = self._transport.get_extra_info("socket") if self._transport else None
        # Closed with a reset, as errors.cut_off cuts: the FIN the shutdown queues behind
        # the unsent bytes never goes, and libcurl sees a receive error, not a partial file
        # that elfutils' client keeps as a miss for ten minutes.
        reset_on_close(sock)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _idle_too_long(self) -> None:
        self._idle = None
        if self._transport is not None:
            self._transport.close()

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _head_too_slow(self) -> None:
        self._timer = None
        if self._guard is not None:
            self._guard.timed_out += 1
            if self._guard._metrics is not None:
                self._guard._metrics.header_timeouts.inc()
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(REQUEST_TIMEOUT)
            self._transport.close()

    def eof_received(self) -> bool | None:
        if not self._handed or self._draining:
            return None  # all its requests answered: close
        if _aiohttp_idle(self._inner) or (not self._clean and (
                self._last_body is None or not self._last_body.is_eof())):
            # Nothing under way (or a body cut short: that client is gone): close.
            return self._inner.eof_received()  # type: ignore[attr-defined,no-any-return]
        # The client has sent all it will and waits for its answers: a half-close after its
        # request (and its whole body, an upload's or a profile's), as `nc -N` and some
        # HTTP/1.0 clients do. aiohttp's protocol has the transport closed at once, answers
        # under way and all, and the client got nothing where debuginfod and nginx answer it.
        # The connection stays open to write them and is closed once aiohttp has nothing left
        # to answer.
        self._close_when_answered()
        return True

    def _close_when_answered(self) -> None:
        self._answering = None
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        if _aiohttp_idle(self._inner):
            transport.close()
        else:
            wait = self._answering_wait
            self._answering_wait = min(wait * 2, _ANSWERED_POLL_MAX_S)
            self._answering = asyncio.get_running_loop().call_later(
                wait, self._close_when_answered)

    def pause_writing(self) -> None:
        self._paused = True
        if self._handed:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._paused = False
        if self._handed:
            self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        if self._answering is not None:
            self._answering.cancel()
            self._answering = None
        if self._sending is not None:
            self._sending.cancel()
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        if self._guard is not None:
            self._guard._opened(-1)
            self._guard._quick_only.discard(self)
            self._guard._senders.discard(self)
            if is_send_timeout(exc) and self._guard.send_timeouts is not None:
                self._guard.send_timeouts.note(self._peer())
            self._guard = None
        if self._handed:
            self._inner.connection_lost(exc)


def _bodiless_heads(data: bytes) -> bool:
    """Whether `data` is whole GET or HEAD request heads and nothing else (no body)."""
    if not data.endswith(b"\r\n\r\n"):
        return False
    for head in data[:-4].split(b"\r\n\r\n"):
        lower = head.lower()
        if not head.startswith((b"GET ", b"HEAD ")) or b"\r\ncontent-length:" in lower \
                or b"\r\ntransfer-encoding:" in lower or b"\r\nupgrade:" in lower:
            return False
    return True


def _aiohttp_idle(inner: asyncio.BaseProtocol) -> bool:
    """Whether aiohttp's request handler waits for a next request, nothing parsed and not yet
    handled, no answer under way, and the connection kept alive. These are private attributes
    of aiohttp's RequestHandler (web_protocol.py, the same from 3.9 to 3.14): one that is
    missing reads as busy, and the connection then stays aiohttp's as before."""
    waiter = getattr(inner, "_waiter", None)
    return (isinstance(waiter, asyncio.Future) and not waiter.done()
            and getattr(inner, "_request_in_progress", True) is False
            and not getattr(inner, "_messages", True)
            and getattr(inner, "_force_close", True) is False
            and getattr(inner, "_keepalive", False) is True
            and isinstance(getattr(inner, "_next_keepalive_close_time", None), float)
            and isinstance(getattr(inner, "_keepalive_timeout", None), (int, float)))


def _keep_alive_from_now(inner: asyncio.BaseProtocol) -> None:
    """Move aiohttp's keep-alive deadline on, as its own answers do: its timer, when it fires
    early, waits for the new one; one held for a big file's send (_hold_keep_alive) is set
    going again, as aiohttp sets it after a response."""
    loop = asyncio.get_running_loop()
    close_time = loop.time() + getattr(inner, "_keepalive_timeout", 0)
    inner._next_keepalive_close_time = close_time  # type: ignore[attr-defined]
    if _keep_alive_holdable(inner) and inner._keepalive_handle is None:  # type: ignore[attr-defined]
        inner._keepalive_handle = loop.call_at(  # type: ignore[attr-defined]
            close_time, inner._process_keepalive)  # type: ignore[attr-defined]


def _keep_alive_holdable(inner: asyncio.BaseProtocol) -> bool:
    """Whether aiohttp's keep-alive timer is one _hold_keep_alive knows how to hold: its handle
    and the method it calls (private to RequestHandler, the same from 3.9 to 3.14)."""
    return hasattr(inner, "_keepalive_handle") and callable(
        getattr(inner, "_process_keepalive", None))


def _hold_keep_alive(inner: asyncio.BaseProtocol) -> None:
    """Stop aiohttp's keep-alive timer while a big file goes out on its idle connection: it
    would close the connection in the middle of the send, which it does not see."""
    handle = inner._keepalive_handle  # type: ignore[attr-defined]
    if handle is not None:
        handle.cancel()
        inner._keepalive_handle = None  # type: ignore[attr-defined]


class _Shed(asyncio.Protocol):
    """Answers BUSY without reading the request, then closes: the client learns at once to come
    back later instead of waiting in a queue that a flood keeps full."""

    def __init__(self, guard: ConnectionGuard) -> None:
        self._guard = guard
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._counted = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        if self._guard.lingering >= MAX_LINGERING:
            transport.abort()
            return
        transport.write(self._guard._busy)
        if transport.can_write_eof():
            transport.write_eof()
        self._guard.lingering += 1
        self._counted = True
        self._timer = asyncio.get_running_loop().call_later(SHED_LINGER_S, transport.abort)

    def data_received(self, data: bytes) -> None:
        pass  # never parsed: that is the point

    def eof_received(self) -> bool:
        return False  # the client has read its answer and gone: close

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._counted:
            self._guard.lingering -= 1
            self._counted = False
