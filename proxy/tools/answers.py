"""What a server that is not always a symgate answered, as one line of a client's report."""

from __future__ import annotations

import asyncio
import os

import aiohttp

# Of an error's body, what is read and shown: a page that never ends is not waited for.
_SAID_BYTES = 4096
_SAID_CHARS = 200
_SAID_WAIT_S = 5.0


async def said(r: aiohttp.ClientResponse) -> str:
    """A status's explanation, as one line: where a redirect led, when to retry, and the start
    of the body (not always a symgate's, nor text, nor ever ending)."""
    parts = []
    if r.status in (301, 302, 303, 307, 308):
        parts.append(f"a redirect to {r.headers.get('Location', 'nowhere')}, not followed: "
                     "give that URL as --server if it is a symgate")
    if retry := r.headers.get("Retry-After"):
        parts.append(f"Retry-After: {one_line(retry)[:40]}")
    try:
        async with asyncio.timeout(_SAID_WAIT_S):
            text = (await r.content.read(_SAID_BYTES)).decode(errors="replace")
    except (aiohttp.ClientError, OSError, TimeoutError):
        text = ""  # the status says enough; a body that does not come is not waited for
    if r.content_type == "text/html":
        text = "an HTML page"
    if text := one_line(text):
        parts.append(text[:_SAID_CHARS])
    return ": " + "; ".join(parts) if parts else ""


def not_from_symgate(r: aiohttp.ClientResponse, expected: str) -> str:
    """A success status whose answer is not `expected` (what a symgate sends there), as one
    line: another service's catch-all 200, a login page a proxy put in the way."""
    return (f"{r.status} but not {expected} (Content-Type: "
            f"{r.headers.get('Content-Type', 'none')}): is --server a symgate's URL?")


def one_line(text: str) -> str:
    return " ".join(text.split())


def failure(e: BaseException) -> str:
    """A request that got no answer, as one line an operator acts on: "cannot connect:
    connection refused", not aiohttp's bare class name (ClientConnectorError) nor asyncio's
    "Connect call failed ('127.0.0.1', 9)"."""
    if isinstance(e, aiohttp.ClientConnectorError):
        return f"cannot connect: {os_reason(e.os_error)}"
    if isinstance(e, TimeoutError):
        return "timed out"
    if isinstance(e, aiohttp.ServerDisconnectedError):
        return "the server closed the connection before answering"
    if isinstance(e, aiohttp.ClientPayloadError):
        return "the answer was cut short (the connection closed before its end)"
    # Their text ends with the request's URL, which names the artifact: prefetch's summary,
    # which groups failures by their text, listed each artifact's as a failure of its own.
    if isinstance(e, aiohttp.TooManyRedirects):
        return "too many redirects"
    if isinstance(e, aiohttp.ClientResponseError):
        return one_line(f"a malformed answer: {e.message}")[:_SAID_CHARS]
    return one_line(f"{type(e).__name__}: {e}")[:_SAID_CHARS]


def os_reason(e: OSError) -> str:
    """"connection refused", not asyncio's "Connect call failed ('127.0.0.1', 9)"."""
    if isinstance(e, ConnectionError) and e.errno:
        return os.strerror(e.errno).lower()
    return e.strerror or str(e) or type(e).__name__  # some TLS failures say nothing else
