"""POST /symbolize/otlp: an OpenTelemetry ExportProfilesServiceRequest (protobuf) in, the same
request out with native frames' functions, lines and inline frames filled in, by the pipeline
that symbolizes pprof profiles (symbolize.otlp converts between the two)."""

from __future__ import annotations

from aiohttp import web

from proxy.web.symbolize import Format, symbolize_as
from symbolize import otlp
from symbolize.pipeline import Limits, Symbolized, SymbolProvider, Work, symbolize_profile

OTLP_TYPES = ("application/x-protobuf", "application/octet-stream", "")


async def _run(body: bytes, provider: SymbolProvider, limits: Limits, work: Work
               ) -> tuple[bytes, Symbolized]:
    # In a worker, as a pprof profile's decoding is: protobuf parses a request in C, holding
    # the GIL, and in a thread of this process a 32 KiB gzip of 32 MiB of empty stacks held
    # the event loop 2 s and took 0.5 GB of the server (256 MiB, the default limit: 16 s,
    # 4 GB). The conversions' Python loops over the request's tables go there with it.
    pprof = await work.run(otlp.pprof_of, body, limits.max_profile_locations)
    done = await symbolize_profile(pprof, provider, limits, work)
    if done.body is pprof:  # nothing filled in: the request's own bytes
        return body, done
    answer = await work.run(otlp.filled, body, bytes(done.body))
    return (body if answer is None else answer), done


OTLP = Format(OTLP_TYPES, "application/x-protobuf",
              "an OTLP ExportProfilesServiceRequest as application/x-protobuf (OTLP/JSON is "
              "not taken)", _run)


async def symbolize_otlp(request: web.Request) -> web.StreamResponse:
    response = await symbolize_as(request, OTLP)
    # As the client accepts: OTLP/HTTP's gzip. (An OTLP answer is converted back to bytes,
    # never a mapped view sent by symbolize_as itself.)
    response.enable_compression()
    return response
