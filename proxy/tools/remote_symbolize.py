"""`symgate symbolize --server`: a profile POSTed to a symgate's /symbolize.

The URL is the operator's and may be wrong: another service, a proxy's error page, a server
that hangs or trickles. Whatever answered is judged before anything is written: only a
symgate's /symbolize answer (its X-Symgate-Symbolize header, a profile that decodes) is
output, every other outcome one line naming the server and what it did.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import aiohttp

from proxy import __version__
from proxy.tools.answers import not_from_symgate, one_line, os_reason, said
from symbolize.pprof.codec import ProfileError, decode


class RemoteError(Exception):
    """What went wrong with --server, as one line."""


async def symbolize_remote(server: str, url: str, body: bytes, headers: Mapping[str, str],
                           timeout_s: float, max_bytes: int) -> tuple[bytes, dict[str, str]]:
    """The symbolized profile and the X-Symgate-* headers of its answer.

    `timeout_s` bounds the whole exchange: urllib's timeout was per socket read, so a server
    that trickled its answer held the command for ever. Redirects are not followed: urllib
    followed one by sending a GET (the profile dropped) with the bearer token to the host it
    named, and wrote whatever page that gave as the output."""
    try:
        async with asyncio.timeout(timeout_s), aiohttp.ClientSession(
                headers={"User-Agent": f"symgate-symbolize/{__version__}"},
            trust_env=True) as session, \
                session.post(url, data=body, headers=dict(headers),
                             allow_redirects=False) as r:
            if r.status != 200:
                raise RemoteError(f"{server} answered {r.status}{await said(r)}")
            if "X-Symgate-Symbolize" not in r.headers:
                raise RemoteError(f"{server} answered "
                                  + not_from_symgate(r, "as a symgate's /symbolize"))
            out = await _read_at_most(r, max_bytes, server)
            summary = {k: v for k, v in r.headers.items() if k.startswith("X-Symgate-")}
    except TimeoutError:
        raise RemoteError(f"{server}: no whole answer within --timeout {timeout_s:g} s") \
            from None
    except aiohttp.ClientConnectorError as e:
        raise RemoteError(f"cannot reach {server}: {os_reason(e.os_error)}") from None
    except (aiohttp.InvalidURL, aiohttp.NonHttpUrlClientError):
        # urllib's ValueError for it was a traceback
        raise RemoteError(f"--server {server}: not an http:// or https:// URL") from None
    except aiohttp.ClientPayloadError:
        raise RemoteError(f"{server}: the answer was cut short (the connection closed "
                          "before its end)") from None
    except aiohttp.ClientResponseError as e:  # aiohttp's parser: no HTTP answered
        what = one_line(e.message.replace("\\n", "\n")).split(":")[0]
        raise RemoteError(f"{server}: no HTTP answer ({what})") from None
    except (aiohttp.ClientError, OSError, ValueError) as e:
        raise RemoteError(f"{server}: {one_line(str(e)) or type(e).__name__}") from None
    try:
        decode(out, max_bytes)
    except ProfileError as e:
        raise RemoteError(f"{server} answered 200 with what is no profile: {e}") from None
    return out, summary


async def _read_at_most(r: aiohttp.ClientResponse, limit: int, server: str) -> bytes:
    chunks: list[bytes] = []
    size = 0
    async for chunk in r.content.iter_chunked(1 << 20):
        size += len(chunk)
        if size > limit:
            raise RemoteError(f"{server} answered more than {limit} bytes: no profile is so big")
        chunks.append(chunk)
    return b"".join(chunks)


