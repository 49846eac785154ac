"""GET /metadata?key=file|glob|buildid&value=...: elfutils 0.192's metadata query, answered
from symgate's catalogue merged with its upstreams' (proxy.artifacts.catalogue)."""

from __future__ import annotations

from aiohttp import web

from proxy.artifacts.catalogue import MetadataQuery
from proxy.errors import InvalidRequest
from proxy.web.artifacts import hop_of
from proxy.web.logs import annotate
from proxy.web.state import STATE


async def metadata(request: web.Request) -> web.Response:
    state = request.app[STATE]
    annotate(request, endpoint="metadata")
    if len(request.query.getall("key", [])) > 1 or len(request.query.getall("value", [])) > 1:
        raise InvalidRequest("one key and one value, please")
    query = MetadataQuery.parse(request.query.get("key"), request.query.get("value"))
    annotate(request, kind=query.key)
    hop, may_fetch = hop_of(request, state.via_name, state.config.server.forwarded_ttl_limit)
    tenant = state.tenancy.tenant_of(request)
    answer = await state.catalogue.find(query, state.tenancy.scope(tenant, hop, may_fetch))
    annotate(request, outcome="ok" if answer.complete else "incomplete")
    return web.json_response(answer.as_json())
