"""PUT and DELETE /buildid/ID/debuginfo|executable: a site's own debug files, uploaded with a
tenant's or an admin's bearer token (proxy.artifacts.uploads keeps them)."""

from __future__ import annotations

import posixpath
import time
from collections.abc import AsyncIterator

from aiohttp import HttpVersion11, web

from proxy.errors import PayloadTooLarge, SymgateError
from proxy.headers import printable
from proxy.keys import ArtifactKey
from proxy.sources.debuginfod import IMA_SIGNATURE, MAX_IMA_SIGNATURE
from proxy.web.content_encoding import coding_of, inflated
from proxy.web.errors import refuse_before_handler
from proxy.web.logs import annotate
from proxy.web.state import STATE

CHUNK = 256 * 1024


async def expect_continue(request: web.Request) -> web.StreamResponse | None:
    """`Expect: 100-continue` (curl sends it for any upload past a KiB): say what will be
    refused anyway (a malformed build ID, no token, too large) before the client sends the
    body, not after."""
    state = request.app[STATE]
    started = time.perf_counter()
    try:
        _key(request)
        state.tenancy.uploader(request)
        coding_of(request)
        limit = state.config.upload.max_file_bytes
        if request.content_length is not None and request.content_length > limit:
            raise PayloadTooLarge(f"{request.content_length} bytes; uploads are at most "
                                  f"{limit} (upload.max_file_bytes)")
    except SymgateError as e:
        return refuse_before_handler(request, e, started)
    if request.version == HttpVersion11 \
            and request.headers.get("Expect", "").lower() == "100-continue":
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # what aiohttp's own handler does: no body sent yet
        return None
    raise web.HTTPExpectationFailed(text=f"unknown Expect: {request.headers.get('Expect')}")


def _key(request: web.Request) -> ArtifactKey:
    m = request.match_info
    annotate(request, endpoint="upload", kind=m["kind"])
    return ArtifactKey.parse(m["build_id"], m["kind"])


async def put(request: web.Request) -> web.Response:
    state = request.app[STATE]
    key = _key(request)
    scope = state.tenancy.uploader(request)
    if scope:
        annotate(request, tenant=scope)
    # What clients are told the file is called (X-DEBUGINFOD-FILE): a base name, never a path.
    named = printable(request.headers.get("X-DEBUGINFOD-FILE"), 255)
    filename = posixpath.basename(named or "") or key.default_filename
    done = await state.uploads.put(
        scope, key, _body(request), request.content_length, filename,
        printable(request.headers.get(IMA_SIGNATURE), MAX_IMA_SIGNATURE))
    annotate(request, outcome="uploaded" if done.created else "unchanged")
    return web.json_response(
        {"build_id": key.build_id, "kind": str(key.kind), "size": done.size,
         "sha256": done.sha256, "scope": scope, "created": done.created},
        status=201 if done.created else 200)


def _body(request: web.Request) -> AsyncIterator[bytes]:
    """The file, inflated where it was sent compressed: a piece at a time in a thread, and
    only as far as the upload takes it (it stops past upload.max_file_bytes), so a bomb costs
    no more than the largest file it may be."""
    chunks = request.content.iter_chunked(CHUNK)
    wbits = coding_of(request)
    return chunks if wbits is None else inflated(chunks, wbits)


async def delete(request: web.Request) -> web.Response:
    state = request.app[STATE]
    key = _key(request)
    scope = state.tenancy.uploader(request)
    await state.uploads.delete(scope, key)
    annotate(request, outcome="deleted")
    return web.Response(status=204)
