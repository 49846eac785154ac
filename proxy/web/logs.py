"""Access and event logs: text for people, or JSON lines for log pipelines.

Handlers put what they learned (outcome, upstream, artifact kind) on the request under
LOG_FIELDS; the access logger adds status, bytes and duration and writes one line a request.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from aiohttp.web import BaseRequest, StreamResponse

LOG_FIELDS: web.RequestKey[dict[str, Any]] = web.RequestKey("symgate.log", dict)


def annotate(request: BaseRequest, **fields: Any) -> None:
    """Add fields to this request's access-log line."""
    request.setdefault(LOG_FIELDS, {}).update(fields)


class AccessLogger(AbstractAccessLogger):
    json_lines = False

    def log(self, request: BaseRequest, response: StreamResponse, time_s: float) -> None:
        # body_length counts the header bytes too; Content-Length is the body, where known.
        if request.method == "HEAD":
            sent = 0
        elif response.content_length is not None:
            sent = response.content_length
        else:
            sent = response.body_length
        fields: dict[str, Any] = {
            "remote": request.remote, "method": request.method, "path": request.path,
            "status": response.status, "bytes": sent,
            "duration_s": round(time_s, 6), **request.get(LOG_FIELDS, {}),
            "user_agent": request.headers.get("User-Agent", ""),
        }
        if self.json_lines:
            self.logger.info(json.dumps(fields))
            return
        extra = " ".join(f"{k}={fields[k]}" for k in ("kind", "outcome", "upstream")
                         if fields.get(k))
        self.logger.info('%s "%s %s" %d %d %.3fs %s "%s"', fields["remote"], request.method,
                         request.path, response.status, sent, time_s, extra,
                         fields["user_agent"])


class JsonAccessLogger(AccessLogger):
    json_lines = True


class JsonFormatter(logging.Formatter):
    """Every log record as one JSON object; access lines keep their own JSON as `access`."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                  + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(), "logger": record.name,
        }
        if record.name == "symgate.access" and message.startswith("{"):
            out["access"] = json.loads(message)
        else:
            out["message"] = message
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)


def configure(json_lines: bool) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if json_lines else logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
