"""GET and HEAD /buildid/...: parse the request, ask the artifact service, send the file.

A hit is sent with sendfile from the cache; a miss is streamed from the download under way.
Failures are raised: the error edge (proxy/web/errors.py) answers them.
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import math
import os
import pathlib
import weakref
from typing import IO, Any

from aiohttp import HttpVersion11, web
from aiohttp.abc import AbstractStreamWriter
from multidict import CIMultiDict

from proxy.artifacts.flight import FlightFailed
from proxy.artifacts.index import CachedArtifact
from proxy.artifacts.scope import RequestScope
from proxy.artifacts.service import Hit, Streaming
from proxy.errors import InvalidRequest, OutOfResources, TooLarge, out_of_descriptors
from proxy.headers import UPLOAD_SHA256, decimal
from proxy.keys import ArtifactKey, Kind, is_text, source_path_of
from proxy.metrics import Served
from proxy.sources.base import Hop
from proxy.web.errors import CountedWhenSent, cut_off
from proxy.web.file_sends import ShortFile, cork, send_file, send_part
from proxy.web.hot_files import (
    artifact_headers,
    etag,
    is_commit,
    private_to_asker,
    record_headers,
)
from proxy.web.logs import annotate
from proxy.web.send_timeout import is_send_timeout
from proxy.web.state import STATE, AppState

log = logging.getLogger(__name__)
def _max_size(request: web.Request) -> int | None:
    raw = request.headers.get("X-DEBUGINFOD-MAXSIZE")
    if raw is None:
        return None
    if (limit := decimal(raw)) is None:
        raise InvalidRequest("invalid X-DEBUGINFOD-MAXSIZE: not a number")
    # 0 is no limit, as elfutils' debuginfod reads it (and its client, from DEBUGINFOD_MAXSIZE).
    return limit or None


def _check_size(size: int | None, max_size: int | None) -> None:
    if max_size is not None and size is not None and size > max_size:
        raise TooLarge(f"file is {size} bytes, larger than X-DEBUGINFOD-MAXSIZE {max_size}")


def hop_of(request: web.Request, via_name: str, limit: int) -> tuple[Hop, bool]:
    """What to tell upstream of the way this request came, and whether it may go upstream:
    not past `limit` forwarding hops (elfutils' --forwarded-ttl-limit), and never when it has
    passed this server already (a loop of caches, which would wait on its own fetch)."""
    headers = request.headers
    if "X-Forwarded-For" not in headers and "Via" not in headers:
        return Hop(request.remote or "unknown", f"1.1 {via_name}",
                   headers.get("User-Agent", "")), limit > 0
    # Each as all its lines, joined (RFC 9110 5.3): a proxy may add a line of its own
    # (HAProxy's forwardfor does) rather than append to the one there.
    incoming = ",".join(headers.getall("X-Forwarded-For", []))
    hops = [h.strip() for h in incoming.split(",") if h.strip()]
    via = [v.strip() for v in ",".join(request.headers.getall("Via", [])).split(",")
           if v.strip()]
    looped = any(v.split()[-1] == via_name for v in via if v.split())
    hop = Hop(", ".join([*hops, request.remote or "unknown"]),
              ", ".join([*via, f"1.1 {via_name}"]), headers.get("User-Agent", ""))
    return hop, len(hops) < limit and not looped


def _detail(request: web.Request) -> str:
    """The source path or section name the request names.

    The router's is decoded as UTF-8, and leaves a percent-encoded byte that is not UTF-8 as
    it came (`%E9`), the same text as an encoded percent sign followed by `E9` gives: such a
    path or name is decoded from the request's own bytes instead (source_path_of). A section
    name asked so was looked for as the text `%E9`, and its cut kept under that name: a
    section named so, and the one named by the byte, would be one."""
    m = request.match_info
    detail = m.get("detail", "")
    if m["kind"] not in ("source", "section") or "%" not in detail:
        return detail
    # The target's path as sent, percent-encoding and all: the URL's, whose path the router
    # matched (raw_path is the whole target, a scheme and host first in absolute form).
    path = source_path_of(request.rel_url.raw_path.encode())
    if path.startswith("//"):  # a base URL's final slash (proxy.web.app.add_routes)
        path = path[1:]
    prefix = f"/buildid/{m['build_id']}/source" if m["kind"] == "source" \
        else f"/buildid/{m['build_id']}/section/"
    return path[len(prefix):] if path.startswith(prefix) and not is_text(path) else detail


async def malformed(request: web.Request) -> web.StreamResponse:
    annotate(request, endpoint="buildid", kind="invalid")
    raise InvalidRequest("invalid path: /buildid/BUILD_ID/ then debuginfo, executable, "
                         "source/PATH or section/NAME")


async def buildid(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    m = request.match_info
    kind = m["kind"] if m["kind"] in _KINDS else "invalid"
    annotate(request, endpoint="buildid", kind=kind)
    key = ArtifactKey.parse(m["build_id"], m["kind"], _detail(request))
    max_size = _max_size(request)
    hop, may_fetch = hop_of(request, state.via_name, state.config.server.forwarded_ttl_limit)
    tenant = state.tenancy.tenant_of(request)
    req = state.tenancy.scope(tenant, hop, may_fetch)
    if tenant:
        annotate(request, tenant=tenant, scope=req.scope or None)
    only_if_cached = any("only-if-cached" in line.lower()
                         for line in request.headers.getall("Cache-Control", []))
    asked_again = False
    for _ in range(_VANISHED_RETRIES):
        result = await state.service.find(key, req, cache_only=only_if_cached,
                                          check_file=False)
        if not isinstance(result, Hit):
            try:
                _check_size(result.meta.size, max_size)
                await _until_start(request, result, max_size)
            except BaseException:
                result.reader.close()
                raise
            if not asked_again and result.flight.error is not None and result.flight.lied:
                # Nothing sent yet: the other upstreams are asked first now, as the client's
                # own retry would find, which elfutils' client does not make.
                result.reader.close()
                asked_again = True
                continue
            break
        _check_size(result.artifact.record.size, max_size)
        annotate(request, outcome=Served.MISS if result.fetched else Served.HIT,
                 upstream=result.artifact.record.upstream)
        kh = result.artifact.record.key_hash
        # Read for conditional requests too, which FileResponse answers: its file is then
        # known to be the hit's commit (describes) with no read of it.
        hot = (state.hot.get(kh, result.artifact.record.fetched_at)
               or state.hot.load(kh, result.artifact))
        whole = not any(name in request.headers for name in _CONDITIONAL)
        if hot is not None and whole:
            if request.method == "HEAD":
                return web.Response(headers=_shown(hot.headers, result.artifact, req, request))
            if hot.body is not None:
                state.metrics.served_from_cache.inc(len(hot.body))
                return web.Response(body=hot.body,
                                    headers=_shown(hot.headers, result.artifact, req, request))
        try:
            fd = os.open(result.artifact.path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            # Evicted by another process, or deleted: find it again (fetched anew).
            await state.service.vanished(result.artifact)
            continue
        except OSError as e:
            if (full := out_of_descriptors(e)) is not None:
                raise full from e
            raise
        same = hot.describes(fd) if hot is not None else is_commit(fd, result.artifact)
        if same is None:
            try:
                same = await state.service.cache.still_current(result.artifact.record)
            except BaseException:
                os.close(fd)
                raise
            if same:
                hot = state.hot.read(kh, result.artifact, fd, vouched=True)
        if same is False:
            # Not the hit's commit: another process put another there (an upload over a
            # download, an upload deleted and made again), which this one's index is not told
            # of yet and its row tells, or the file was damaged. Sent, it would be a body that
            # is not the file its headers describe: forgotten, and found again (or fetched
            # anew).
            os.close(fd)
            log.warning("cached %s is not the file its index entry describes (replaced by "
                        "another process, or changed on disk); looking it up again",
                        result.artifact.record.key)
            await state.service.cache.vanished(result.artifact.record)
            continue
        if hot is not None and whole and request.method == "GET":
            return _SentFile(state, key, result.artifact, fd,
                             _shown(hot.headers, result.artifact, req, request))
        return _LeasedFileResponse(state, key, result.artifact, fd,
                                   _shown(record_headers(result.artifact.record),
                                          result.artifact, req, request))
    else:
        raise OutOfResources("the cached file kept disappearing while being sent; retry")
    try:
        annotate(request, outcome=Served.MISS, upstream=result.meta.upstream)
        return await _send_streaming(request, state, key, result)
    finally:
        result.reader.close()


_KINDS = frozenset(str(k) for k in Kind)
# Times a hit whose file another process evicts in between is looked up again.
_VANISHED_RETRIES = 3
# Headers that make a response depend on the file's state (304, 206, 412): FileResponse's.
# Looked up in the request's headers, which compare names without regard to case.
_CONDITIONAL = ("If-None-Match", "If-Modified-Since", "If-Match", "If-Unmodified-Since",
                "If-Range", "Range")
# Those _without_foreign_range may change before FileResponse reads them.
_DATED = ("If-Modified-Since", "If-Unmodified-Since", "Range")


def _shown(headers: dict[str, str], artifact: CachedArtifact, req: RequestScope,
           request: web.BaseRequest) -> dict[str, str]:
    """A hit's headers as this request may see them (hot_files.private_to_asker), and an
    upload's sha256 (UPLOAD_SHA256) only to the scope it was uploaded to. `symgate upload`
    skips a file whose sha256 that header gives; a tenant seeing the shared scope's upload of
    the same bytes was told its own was there, and had none (gone with the shared one's
    DELETE)."""
    if UPLOAD_SHA256 in headers and artifact.scope != req.tenant:
        headers = {k: v for k, v in headers.items() if k != UPLOAD_SHA256}
    # The hit's own headers where nothing is added: no copy on the way of every hit.
    private = private_to_asker(request)
    return {**headers, **private} if private else headers


def _note_send_timeout(state: AppState, request: web.BaseRequest, error: OSError) -> None:
    """A sendfile(2) the kernel's send timeout ended (proxy.web.send_timeout): the error went
    to the sendfile, which had the socket, so the connection's end does not tell it. Raised
    on as the lost connection it is, which aiohttp ends quietly (an ETIMEDOUT it would log as
    an unhandled exception)."""
    if is_send_timeout(error):
        state.send_timeouts.note(request.remote)
        raise ConnectionResetError("the client took none of the bytes sent to it for "
                                   "server.send_timeout_s") from error


def _count_cut(state: AppState, request: web.BaseRequest, file: IO[Any], offset: int) -> None:
    """A cached file's response that ended before its last byte (the client left, or was cut
    for not reading): its access line and the served bytes tell what went out, not the
    Content-Length. asyncio's sendfile leaves the file's position past the bytes it sent,
    whichever way it ends."""
    try:
        sent = max(0, file.tell() - offset)
    except (OSError, ValueError):  # closed already: nothing more is known
        return
    annotate(request, sent=sent)
    state.metrics.served_from_cache.inc(sent)


class _SentFile(CountedWhenSent, web.StreamResponse):
    """A whole cached file, its headers known (proxy.web.hot_files), sent with sendfile(2)
    from the descriptor opened when the hit was found: none of FileResponse's trips to the
    thread pool to open, stat and close it. Ranges and conditional requests go to
    _LeasedFileResponse, which knows them."""

    def __init__(self, state: AppState, key: ArtifactKey, artifact: CachedArtifact, fd: int,
                 headers: dict[str, str]) -> None:
        super().__init__(headers=headers)
        self._symgate = state
        self._key = key
        self._scope = artifact.scope
        self._size = artifact.record.size
        # Unbuffered: sendfile(2) reads it, never Python (a buffer costs a seek and an ioctl).
        self._file = open(fd, "rb", buffering=0)  # noqa: SIM115 (closed after prepare)

    async def prepare(self, request: web.BaseRequest) -> AbstractStreamWriter | None:
        sock = request.transport.get_extra_info("socket") if request.transport else None
        cork(sock)  # the head goes with the file's first bytes (file_sends)
        cut: BaseException | None = None
        try:
            with self._symgate.service.cache.lease(self._scope, self._key):
                writer = await super().prepare(request)
                transport = request.transport
                if transport is None:
                    raise ConnectionResetError("Connection lost")
                await send_file(transport, self._file, self._size, self._key.id)
                await super().write_eof()
        except BaseException as e:
            cut = e
            _count_cut(self._symgate, request, self._file, 0)
            if isinstance(e, OSError):
                _note_send_timeout(self._symgate, request, e)
            raise
        finally:
            cork(sock, on=False)  # unless the send was reached, which uncorked it already
            self._file.close()
            self.sent(request, cut)
        self._symgate.metrics.served_from_cache.inc(self._size)
        return writer


class _LeasedFileResponse(CountedWhenSent, web.FileResponse):
    """A FileResponse of a file already open, holding the cache lease while aiohttp sends it.

    aiohttp prepares a FileResponse itself once the handler returns, so the lease has to live
    here rather than in the handler. It stats and opens the file by path, in a thread, by
    then: given /proc/self/fd/N of the descriptor opened when the hit was found, it finds that
    same file, even if another process has evicted (unlinked) it in between, and its open is
    that descriptor (_HeldPath).
    """

    def __init__(self, state: AppState, key: ArtifactKey, artifact: CachedArtifact,
                 fd: int, headers: dict[str, str]) -> None:
        rec = artifact.record
        super().__init__(f"/proc/self/fd/{fd}", headers=headers)
        self._path = _HeldPath(self._path)
        self._symgate = state
        self._key = key
        self._scope = artifact.scope
        self._size = rec.size
        self._fd = fd
        # Closed when the response is done with it, whatever becomes of the response.
        self._fd_closer = weakref.finalize(self, os.close, fd)

    async def _sendfile(self, request: web.BaseRequest, fobj: IO[Any], offset: int,
                        count: int) -> AbstractStreamWriter:
        """FileResponse's send of the body (the file, or the range asked), after its head,
        with file_sends.send_part: aiohttp's own ends the response however few bytes went,
        and keeps the connection."""
        try:
            if os.fstat(fobj.fileno()).st_size != self._size:
                # Changed on disk since the handler found it whole (an operator, a bad disk),
                # before FileResponse read its size: the head would tell the damaged file's,
                # and the body look whole. No head is sent; the connection ends.
                log.warning("cached %s changed on disk while its hit was answered; its "
                            "response was cut", self._key.id)
                raise ShortFile("cached file changed on disk")
            writer = await super(web.FileResponse, self).prepare(request)
            transport = request.transport
            if writer is None or transport is None:
                raise ConnectionResetError("Connection lost")
            await send_part(transport, fobj, offset, count, self._key.id)
            await super(web.FileResponse, self).write_eof()
            return writer
        except BaseException:
            _count_cut(self._symgate, request, fobj, offset)
            raise

    async def prepare(self, request: web.BaseRequest) -> AbstractStreamWriter | None:
        asked = request
        request = _without_foreign_range(request, self._fd)
        cut: BaseException | None = None
        try:
            with self._symgate.service.cache.lease(self._scope, self._key):
                writer = await super().prepare(request)
        except BaseException as e:
            cut = e
            if isinstance(e, OSError):
                _note_send_timeout(self._symgate, request, e)
            raise
        finally:
            self._fd_closer()
            self.sent(asked, cut)
        if request.method != "HEAD":
            self._symgate.metrics.served_from_cache.inc(self.content_length or 0)
        return writer


class _HeldPath(pathlib.PosixPath):
    """/proc/self/fd/N, opened as descriptor N itself, which the file object leaves open
    (_LeasedFileResponse closes it). FileResponse stats its path, then opens it: a second
    descriptor, and one that failed for want of one (EMFILE) was its 404, for a file that
    is cached (an elfutils client keeps a 404 for ten minutes)."""

    def open(self, mode: str = "r", buffering: int = -1, encoding: str | None = None,
             errors: str | None = None, newline: str | None = None) -> Any:
        return open(int(self.name), mode, buffering, encoding, errors, newline, closefd=False)


def _without_foreign_range(request: web.BaseRequest, fd: int) -> web.BaseRequest:
    """`request` as FileResponse is to answer it for the file on `fd`.

    Without a Range FileResponse would refuse with 416 though it is no fault of the client's:
    one of a unit other than bytes, which a server must ignore (RFC 9110, 14.2), or of
    several ranges, which it may ignore (FileResponse serves one only), and answer with the
    whole file, as debuginfod does for any Range; nor one whose If-Range does not name the
    file (_if_range_holds). With its dates compared to the second (_dates_to_the_second)."""
    if not any(name in request.headers for name in _DATED):
        return request  # nothing to judge: no stat of the file
    st = os.fstat(fd)  # the file FileResponse sends, and whose ETag and date it tells
    headers = _dates_to_the_second(request, st.st_mtime)
    asked = request.headers.get("Range")
    if asked is not None and not (asked.lstrip()[:6].lower() == "bytes=" and "," not in asked
                                  and _if_range_holds(request, st)):
        headers = headers if headers is not None else request.headers.copy()
        del headers["Range"]
    elif asked is not None and "If-Range" in request.headers:
        # It holds (checked above, to the second): FileResponse, which compares a date with
        # the file's own time to the nanosecond, must not judge it again.
        headers = headers if headers is not None else request.headers.copy()
        del headers["If-Range"]
    return request if headers is None else request.clone(headers=headers)


def _dates_to_the_second(request: web.BaseRequest, mtime: float) -> CIMultiDict[str] | None:
    """The request's If-Modified-Since and If-Unmodified-Since made to compare with the
    file's time to the second, as its Last-Modified tells it (None: nothing to change).

    A file whose upstream gave no date (and an upload) keeps the time it was written, to the
    nanosecond: that keeps FileResponse's ETag (time and size) another for each file a key
    has had, however soon one replaces the other. FileResponse compares a client's dates
    with that time, so the very date it was told made the file look changed a fraction of a
    second later: 200 for a 304, 412 for a 200. A date at or after the file's second is
    given as the file's own time, rounded up."""
    headers = None
    second = math.floor(mtime)
    for name, when in (("If-Modified-Since", request.if_modified_since),
                       ("If-Unmodified-Since", request.if_unmodified_since)):
        if when is not None and second <= when.timestamp() < mtime:
            headers = headers if headers is not None else request.headers.copy()
            headers[name] = email.utils.formatdate(math.ceil(mtime), usegmt=True)
    return headers


def _if_range_holds(request: web.BaseRequest, st: os.stat_result) -> bool:
    """Whether a Range may be served as asked: no If-Range, or one naming the file of `st`.
    FileResponse reads If-Range as a date only: an entity tag (what a browser resuming a
    download sends) or a value that is neither, and the range was served whatever file the
    client had its first part of, a splice of two files once the key's file changed (an
    upload replacing a download, a purge and a fetch anew). RFC 9110 13.1.5: a validator
    that does not match, weak tags included, is the whole file (200)."""
    validator = request.headers.get("If-Range")
    if validator is None:
        return True
    validator = validator.strip()
    if validator.startswith('"'):
        return validator == etag(st)
    # A date matches only when it is the file's Last-Modified exactly (RFC 9110 13.1.5):
    # FileResponse takes any date at or after the file's, and a file replaced by an older
    # one (a purge and a fetch anew from an upstream that dates it earlier) would have the
    # rest of it spliced onto the first part of the newer. A weak tag or junk never matches.
    # The file's second either way (Last-Modified rounds up, as FileResponse's; a date told
    # before rounded down).
    when = None if validator.startswith("W/") else request.if_range
    return when is not None and when.timestamp() in (math.floor(st.st_mtime),
                                                     math.ceil(st.st_mtime))


async def _until_start(request: web.Request, streaming: Streaming,
                       max_size: int | None) -> None:
    """Until the response can start (its status line rests on what came by then)."""
    flight = streaming.flight
    if streaming.meta.size is None and max_size is not None:
        # No size said: the client's X-DEBUGINFOD-MAXSIZE is judged by the bytes, before the
        # status line (a 406, which elfutils' client asks for, not a file past its limit):
        # once more than it allows came, or all of them.
        await flight.wait_past(max_size)
        _check_size(flight.received, max_size)
    if request.method == "HEAD" or (streaming.meta.size is None
                                    and request.version < HttpVersion11):
        # Wait for the verdict. A HEAD's status and headers are its whole answer: a 200
        # before it told of a file the cache may yet reject (another build ID), with the size
        # its upstream announced, which a liar's is not; elfutils' debuginfod, too, answers
        # once it has fetched the file. An HTTP/1.0 client (a proxy's default upstream
        # protocol: nginx's) has no chunked encoding, so a body without a Content-Length
        # ends where the connection does, and a cut would look whole.
        await flight.wait_finished()
    else:
        await flight.wait_streamable()


async def _send_streaming(
    request: web.Request, state: AppState, key: ArtifactKey, streaming: Streaming
) -> web.StreamResponse:
    """Once the response can start (_until_start, which the caller awaited)."""
    meta = streaming.meta
    flight = streaming.flight
    size = meta.size
    if flight.error is not None:
        raise flight.error
    if size is None and flight.succeeded:
        size = flight.received
    headers = {**artifact_headers(size, meta.filename or key.default_filename, meta.archive,
                                  meta.ima_signature), **private_to_asker(request)}
    if meta.last_modified:
        headers["Last-Modified"] = meta.last_modified
    response = web.StreamResponse(headers=headers)
    if size is not None:
        response.content_length = size
    sent = 0
    try:
        # In the try: a client that left while the download got going fails here, at the
        # status line's write, and must get its access line as one that leaves later does.
        await response.prepare(request)
        if request.method == "HEAD":
            await response.write_eof()
            return response
        async for chunk in streaming.reader.chunks():
            # Counted once handed over: a write cut short (the server stopping) may already
            # have put it on the wire, which its client then has.
            sent += len(chunk)
            await response.write(chunk)
        await response.write_eof()
    except ConnectionError as e:
        # The client left; the download goes on for its other clients and the cache. Raised
        # on, the response would get no access line (aiohttp logs none for a handler that
        # fails after its status line): it is answered here as cut off, with the bytes sent.
        cut_off(request, str(e) or type(e).__name__, sent)
        return response
    except asyncio.CancelledError:
        # The server stopping, past its grace (proxy.web.app._drain): the response is cut.
        # Raised on, it would get no access line and no count, as if it had never been;
        # answered here as cut off, aiohttp logs it with the bytes that went out.
        cut_off(request, "the server stopped", sent)
        if (task := asyncio.current_task()) is not None:
            task.uncancel()  # taken in: what runs on (aiohttp's logging) is not cancelled
        return response
    except FlightFailed as e:
        state.metrics.aborted_responses.inc()
        log.warning("cutting off %s after %d bytes: %s", request.path, sent, e)
        # The access log tells the bytes that went out, not the Content-Length announced.
        cut_off(request, e.error.reason, sent)
        return response
    finally:
        state.metrics.served_from_upstream.inc(sent)
    # The body's bytes: with no Content-Length (an upstream's size unknown) aiohttp's count
    # would add the head and the chunked framing.
    annotate(request, sent=sent)
    return response
