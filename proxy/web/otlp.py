"""POST /symbolize/otlp: an OpenTelemetry ExportProfilesServiceRequest (protobuf) in, the same
request out with native frames' functions, lines and inline frames filled in, by the pipeline
that symbolizes pprof profiles (symbolize.otlp converts between the two)."""

from __future__ import annotations

import asyncio

from aiohttp import web

from proxy.web.symbolize import Format, symbolize_as
from symbolize import otlp
from symbolize.pipeline import Limits, Symbolized, SymbolProvider, Work, symbolize_profile

OTLP_TYPES = ("application/x-protobuf", "application/octet-stream", "")


async def _run(body: bytes, provider: SymbolProvider, limits: Limits, work: Work
               ) -> tuple[bytes, Symbolized]:
    # The conversions are Python loops over the request's tables: off the event loop.
    converted = await asyncio.to_thread(otlp.decode, body, limits.max_profile_locations)
    done = await symbolize_profile(converted.pprof, provider, limits, work)
    if done.body is converted.pprof:  # nothing filled in: the request's own bytes
        return body, done

    def back() -> bytes:
        if not otlp.from_pprof(converted.request, done.body):
            # A fallback's names taken away and given again (still no debug info): the
            # request as it came, not one with the pprof's build-ID strings appended.
            return body
        return converted.request.SerializeToString()

    return await asyncio.to_thread(back), done


OTLP = Format(OTLP_TYPES, "application/x-protobuf",
              "an OTLP ExportProfilesServiceRequest as application/x-protobuf (OTLP/JSON is "
              "not taken)", _run)


async def symbolize_otlp(request: web.Request) -> web.StreamResponse:
    response = await symbolize_as(request, OTLP)
    # As the client accepts: OTLP/HTTP's gzip. (An OTLP answer is converted back to bytes,
    # never a mapped view sent by symbolize_as itself.)
    response.enable_compression()
    return response
