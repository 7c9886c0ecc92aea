"""The outermost layer of `tmt serve` (ASGI, around the FastAPI app): the body limit (413), the
API key (401), the access log and the request metrics, one line and a 500 for a fault of the
server, and one line and a 503 for a request a drain cut short, never a traceback.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from fastapi import FastAPI

from transformer_mt.common.exits import first_line
from transformer_mt.serving.service import ServeError, Service, check_key

logger = logging.getLogger("tmt.serve")

# What needs no API key: the page asks for the key; LibreTranslate's server asks none for its
# languages and settings (its clients send a key there, or none).
PUBLIC = ("/health", "/", "/favicon.ico", "/languages", "/frontend/settings")
KEY_IN_BODY = ("/translate",)  # LibreTranslate clients send api_key in the body or the query


class Gate:
    """The outermost ASGI layer: the body limit (413, by Content-Length or as the body streams
    in: the body is read here, bounded, and handed on whole), the API key (401), the access log
    and the request metrics, and one line and a 500 for a fault of the server, never a
    traceback."""

    def __init__(self, app: FastAPI, service: Service) -> None:
        self.app, self.service, self.limit = app, service, service.cfg.max_body_bytes
        self.state = app.state
        # A stored glossary's body: its entries (serve.max_glossary_bytes) as JSON escapes them.
        cfg = service.cfg
        self.glossary_limit = max(cfg.max_body_bytes, 6 * cfg.max_glossary_bytes + 65536)

    def limit_key(self, limit: int) -> str:
        if limit == self.limit:
            return "serve.max_body_bytes"
        return "a stored glossary's body: 6 × serve.max_glossary_bytes + 64 KiB"

    def limit_of(self, scope: dict[str, Any]) -> int:
        if scope["path"] == "/v1/glossaries" and scope["method"] == "POST":
            return self.glossary_limit
        return self.limit

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status = time.monotonic(), [0]

        async def watched(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        read = [False]  # the whole body was read (or refused while it came)
        try:
            self._admit(scope)
            body = await self._body(receive, self.limit_of(scope))
            read[0] = True
            replayed = [False]

            async def replay() -> dict[str, Any]:  # the body once, then the client's own events
                if replayed[0]:
                    return await receive()
                replayed[0] = True
                return {"type": "http.request", "body": body, "more_body": False}

            await self.app(scope, replay, watched)
        except ServeError as err:
            if not status[0]:
                if not read[0] and err.status in (401, 413):
                    await self._discard(scope, receive)
                await _send_error(watched, err.status, err.message, err.headers)
        except Exception as err:
            logger.error("%s %s: %s: %s", scope["method"], scope["path"], type(err).__name__,
                         first_line(err))  # fmt: skip
            if not status[0]:
                await _send_error(watched, 500, f"the server failed ({type(err).__name__})")
        except asyncio.CancelledError:
            if self.service.drain_deadline is None:
                raise
            # The drain ran out of time (uvicorn cancels what is still running): a 503 and one
            # line, as a request cut at serve.drain_seconds gets, never a 500 and a traceback.
            logger.warning("%s %s: cut by the drain (serve.drain_seconds)", scope["method"],
                           scope["path"])  # fmt: skip
            if not status[0]:
                await _send_error(watched, 503, "the server is stopping: this request did not"
                                  " finish within its drain (serve.drain_seconds); retry it",
                                  {"Retry-After": "1"})  # fmt: skip
        self._account(scope, status[0], time.monotonic() - start)

    async def _discard(self, scope: dict[str, Any], receive: Any) -> None:
        """Read and drop what is left of a refused request's body, within bounds (64 MiB or 16
        times serve.max_body_bytes, serve.body_seconds), before answering: an answer sent
        while the body still comes makes the connection close with unread bytes, a reset that
        a client sending its whole body before it reads (Python's http.client, requests) gets
        instead of the answer (nginx's lingering close, for the same reason). A client that
        waits for 100 Continue has sent nothing: it gets the answer at once."""
        headers = dict(scope.get("headers", ()))
        if headers.get(b"expect", b"").lower() == b"100-continue":
            return
        deadline = time.monotonic() + self.service.cfg.body_seconds
        left = max(64 << 20, 16 * self.limit_of(scope))
        while left > 0:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                return
            left -= len(message.get("body", b""))
            if message["type"] != "http.request" or not message.get("more_body", False):
                return

    async def _body(self, receive: Any, limit: int) -> bytes:
        """The whole request body, refused (413) as soon as it passes the limit, and (408) when
        it has not all come within serve.body_seconds: a client that promises more bytes than it
        sends holds no connection for ever."""
        chunks, size, more = [], 0, True
        deadline = time.monotonic() + self.service.cfg.body_seconds
        while more:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:  # TimeoutError itself only from Python 3.11
                raise ServeError(408, "the body did not come within serve.body_seconds") from None
            if message["type"] == "http.disconnect":
                raise ServeError(499, "the client closed the request")
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                raise ServeError(413, f"a body over {limit} bytes ({self.limit_key(limit)})")
            more = message.get("more_body", False)
        return b"".join(chunks)

    def _admit(self, scope: dict[str, Any]) -> None:
        headers = dict(scope.get("headers", ()))
        length, limit = headers.get(b"content-length", b"0"), self.limit_of(scope)
        if not length.isdigit() or int(length) > limit:
            what = f"a body of {int(length)} bytes" if length.isdigit() else "a bad Content-Length"
            raise ServeError(413, f"{what}; at most {limit} ({self.limit_key(limit)})")
        if scope["path"] not in PUBLIC and scope["path"] not in KEY_IN_BODY:
            check_key(headers.get(b"authorization", b"").decode("latin-1"), self.service.api_key)

    def _account(self, scope: dict[str, Any], status: int, seconds: float) -> None:
        route = getattr(scope.get("route"), "path", "other")  # a bounded set of labels
        stats = self.service.stats
        stats.requests.labels(route, str(status)).inc()
        stats.latency.labels(route).observe(seconds)
        if status >= 400:
            stats.errors.labels(route).inc()
        # The path only: a query string could carry a key.
        logger.info("%s %s %d %.1f ms", scope["method"], scope["path"], status, 1000 * seconds)


async def _send_error(send: Any, status: int, message: str, headers: Any = None) -> None:
    raw = [(b"content-type", b"application/json")]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": json.dumps({"error": message}).encode()})
