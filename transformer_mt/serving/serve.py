"""`tmt serve`: one loaded model behind HTTP: tmt's API, the LibreTranslate API that existing
clients speak, a page for people, health, a model card and Prometheus metrics.

    POST /v1/translate   {"text": "..." | [...], beam_size, length_penalty, nbest, sampling,
                         temperature, seed, target_lang, glossary | glossary_id,
                         glossary_mode} -> {"translations": [...], "model", "seconds",
                         "terms" (with a glossary)}
    POST /v1/glossaries  DeepL's: {name, source_lang, target_lang, entries, entries_format}
                         -> {"glossary_id", ...}; GET /v1/glossaries, GET .../{id},
                         GET .../{id}/entries (TSV), DELETE .../{id}
    POST /translate      LibreTranslate: q, source, target, format, alternatives, api_key
    GET  /languages      LibreTranslate: [{"code", "name", "targets"}]
    GET  /health         {"status": "ok"}: the model is loaded
    GET  /v1/model       the model card       GET /v1/curves.png  the run's training curves
    GET  /metrics        Prometheus text      GET /                the page (page.html)

Requests are decoded by batching.py's one worker, the sentences of concurrent requests together.
Every error is a JSON body of one message, {"error": "..."}, with a 4xx status (5xx for a fault
of the server), and the log gets one line, never a traceback. Bodies, sentences per request,
characters per sentence and the queue are bounded (serve.*); a full queue answers 503 with
Retry-After. With an API key, every endpoint but /health and the page itself needs
`Authorization: Bearer KEY` (or, for LibreTranslate clients, `api_key`); the key is never logged.
It binds 127.0.0.1 unless told otherwise; SIGTERM or SIGINT stops accepting, lets what is in
flight finish (serve.drain_seconds) and exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import json
import logging
import math
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Sequence
from importlib import resources
from typing import Any

import prometheus_client as prom
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException

from transformer_mt.common.exits import SIGNAL_POLL_S, TmtError
from transformer_mt.config import ServeConfig, apply_overrides
from transformer_mt.network.alignment import pharaoh
from transformer_mt.serving import libretranslate
from transformer_mt.serving.batching import Batcher
from transformer_mt.serving.gate import Gate
from transformer_mt.serving.glossary_store import GlossaryStore, StoreError
from transformer_mt.serving.service import (
    ServeError,
    Service,
    Stats,
    curves,
    model_card,
    served_checkpoint,
    terms_of,
)
from transformer_mt.translation.translate import Translator, detokenize

logger = logging.getLogger("tmt.serve")


class TranslateRequest(BaseModel):
    """POST /v1/translate: the text and this request's decoding options (the CLI's rules)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    text: str | list[str]
    prefix: str | list[str] | None = None  # target prefixes, in the shape of text
    alignment: str | None = None  # "subword" or "word": Pharaoh pairs with each translation
    beam_size: int | None = None
    length_penalty: float | None = None
    nbest: int | None = None
    sampling: str | None = None
    temperature: float | None = None
    seed: int | None = None
    target_lang: str | None = None  # a multi-target model's target language (>>xxx<< first)
    # A glossary for this request: [[source, target], ...] or TSV text, or a stored one's id.
    glossary: list[Any] | str | None = None
    glossary_id: str | None = None
    glossary_mode: str | None = None  # strict, check, hint or auto (glossary.mode)


# --- the application ---------------------------------------------------------------------------


def glossary_store(translator: Translator, cfg: ServeConfig) -> GlossaryStore:
    """The stored glossaries of a server of `translator` (serve.glossary_dir), not yet opened."""
    config = translator.config
    pair = (config.data.src_lang, config.decode.target_lang or config.data.tgt_lang)
    return GlossaryStore(cfg, config.glossary, pair)


def create_app(
    translator: Translator,
    cfg: ServeConfig,
    api_key: str = "",
    decoder_thread: bool = True,
    store: GlossaryStore | None = None,
) -> FastAPI:
    """The FastAPI application serving `translator`. The batcher opens and stops with the app;
    it decodes on a thread of its own, or (decoder_thread=False) on whichever thread calls
    app.state.service.batcher.run(). `store`: the stored glossaries, opened by the caller; by
    default the app opens serve.glossary_dir's as it starts."""
    stats = Stats()
    batcher = Batcher(
        cfg.max_tokens, cfg.max_wait_ms / 1000.0, cfg.max_queue, stats, cfg.gap_ms / 1000.0
    )
    own_store = store is None
    store = store or glossary_store(translator, cfg)
    service = Service(translator, cfg, batcher, stats, api_key, model_card(translator), store)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if own_store:
            store.open()
        if decoder_thread:
            batcher.start()
        else:
            batcher.open()
        yield
        batcher.stop(timeout=5.0)  # after the drain: what was in flight is answered
        if own_store:
            store.close()

    app = FastAPI(title="tmt", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service
    _add_errors(app)
    _add_endpoints(app, service)
    libretranslate.add_endpoints(app, service)
    return Gate(app, service)  # type: ignore[return-value]  (an ASGI application)


def _add_endpoints(app: FastAPI, service: Service) -> None:
    translator = service.translator
    served = served_checkpoint(translator)  # the curves are of this checkpoint's run only

    @app.api_route("/health", methods=["GET", "HEAD"])  # monitors probe with HEAD
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/model")
    async def model() -> dict[str, Any]:
        return service.card

    @app.get("/v1/curves.png")
    async def training_curves() -> Response:  # drawn away from the event loop (a second or so)
        drawn = await asyncio.to_thread(curves, translator, served)
        return Response(drawn, media_type="image/png")

    @app.get("/metrics")
    async def prometheus() -> Response:
        body = prom.generate_latest(service.stats.registry)
        return Response(body, media_type=prom.CONTENT_TYPE_LATEST)

    page_html = resources.files("transformer_mt.serving").joinpath("page.html").read_text()

    @app.get("/", response_class=HTMLResponse)
    async def page() -> HTMLResponse:
        return HTMLResponse(page_html)

    @app.post("/v1/translate")
    async def v1_translate(body: TranslateRequest, request: Request) -> dict[str, Any]:
        return await _translate(service, body, request)

    _add_glossary_endpoints(app, service)


async def _translate(service: Service, body: TranslateRequest, request: Request) -> dict[str, Any]:
    """POST /v1/translate: the request's lines with its options (and glossary), as translate
    would write them."""
    start = time.monotonic()
    lines = [body.text] if isinstance(body.text, str) else body.text
    prefixes = [body.prefix] if isinstance(body.prefix, str) else body.prefix
    if prefixes is not None and isinstance(body.text, str) != isinstance(body.prefix, str):
        raise ServeError(422, "prefix: a string for a text string, a list for a list")
    glossary = service.glossary_for(body.glossary, body.glossary_id)
    not_decoding = {"text", "prefix", "glossary", "glossary_id", "glossary_mode"}
    options = body.model_dump(exclude=not_decoding, exclude_none=True)
    overrides = [(f"decode.{k}={v}", f"{k}={v!r}") for k, v in options.items()]
    if body.glossary_mode is not None:
        overrides.append((f"glossary.mode={body.glossary_mode}",
                          f"glossary_mode={body.glossary_mode!r}"))  # fmt: skip
    chosen = service.translator_for(overrides)
    hyps = await service.translate(request, lines, chosen, prefixes, glossary)
    texts = [detokenize(chosen, [h.tokens for h in line]) for line in hyps]  # best first
    answer: dict[str, Any] = {
        "translations": [line[0] if line else "" for line in texts],
        "model": service.translator.origin,
    }
    terms = terms_of(lines, service.matches_of(lines, chosen, glossary), hyps)
    if terms is not None:
        answer["terms"] = terms
    aligned = chosen.config.decode.alignment != "none"
    if aligned:
        answer["alignments"] = [pharaoh(line[0].alignment or ()) if line else "" for line in hyps]
    if chosen.config.decode.nbest > 1:
        answer["nbest"] = [
            [{"translation": t, "score": round(h.score, 4)}
             | ({"alignment": pharaoh(h.alignment or ())} if aligned else {})
             for h, t in zip(line, line_texts, strict=True)]
            for line, line_texts in zip(hyps, texts, strict=True)
        ]  # fmt: skip
    answer["seconds"] = round(time.monotonic() - start, 4)
    return answer


def _add_glossary_endpoints(app: FastAPI, service: Service) -> None:
    """DeepL's glossary API over the server's store (glossary_store.py)."""
    store = service.store
    assert store is not None

    def refused(err: StoreError) -> ServeError:
        return ServeError(err.status, err.message)

    @app.post("/v1/glossaries", status_code=201)
    async def create(request: Request) -> dict[str, Any]:
        try:
            body = json.loads(await request.body())
        except (ValueError, RecursionError):
            raise ServeError(400, "the body is not valid JSON") from None
        try:  # parsing and a write of up to serve.max_glossary_bytes: off the event loop
            return await asyncio.to_thread(store.create, body)
        except StoreError as err:
            raise refused(err) from None

    @app.get("/v1/glossaries")
    async def listing() -> dict[str, Any]:
        return {"glossaries": store.list()}

    @app.get("/v1/glossaries/{glossary_id}")
    async def one(glossary_id: str) -> dict[str, Any]:
        try:
            return store.get(glossary_id).info()
        except StoreError as err:
            raise refused(err) from None

    @app.get("/v1/glossaries/{glossary_id}/entries")
    async def entries(glossary_id: str) -> Response:
        try:
            text = store.entries(glossary_id)
        except StoreError as err:
            raise refused(err) from None
        return Response(text, media_type="text/tab-separated-values; charset=utf-8")

    @app.delete("/v1/glossaries/{glossary_id}", status_code=204)
    async def delete(glossary_id: str) -> Response:
        try:
            await asyncio.to_thread(store.delete, glossary_id)
        except StoreError as err:
            raise refused(err) from None
        return Response(status_code=204)


# --- errors, access, limits --------------------------------------------------------------------


def _add_errors(app: FastAPI) -> None:
    """Refusals and validation errors as {"error": one message}."""

    def answer(status: int, message: str, headers: Any = None) -> JSONResponse:
        return JSONResponse({"error": message}, status_code=status, headers=headers)

    @app.exception_handler(ServeError)
    async def refused(request: Request, err: ServeError) -> JSONResponse:
        return answer(err.status, err.message, err.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {}
        if first.get("type") == "json_invalid":
            return answer(400, "the body is not valid JSON")
        if tuple(first.get("loc", ())) == ("body",):
            return answer(400, "the body is not a JSON object (Content-Type: application/json)")
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or "body"
        problem = first.get("msg", "invalid").replace("Extra inputs are not permitted",
                                                      "unknown field")  # fmt: skip
        return answer(422, f"{where}: {problem}")

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> JSONResponse:
        return answer(err.status_code, str(err.detail), getattr(err, "headers", None))


# --- running it --------------------------------------------------------------------------------


HEADER_BYTES = 16 * 1024  # a request's line and headers: h11's default, named


def _http_protocol(header_seconds: float) -> type:
    """uvicorn's HTTP/1.1 (h11) with the bound it lacks: a request's headers have
    `header_seconds` to come whole from their first byte (or from the connection's start), else
    408 and the connection is closed; a client that trickles headers (slowloris) or connects and
    says nothing holds no connection for ever. The body has its own bound (Gate._body)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeout(H11Protocol):  # type: ignore[misc]
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self.headers_timer = self.loop.call_later(header_seconds, self.headers_late)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            waiting = self.conn.their_state is h11.IDLE and bool(self.conn.trailing_data[0])
            if not waiting and self.conn.their_state is not h11.IDLE:  # the headers came
                self._disarm()
            elif waiting and self.headers_timer is None:  # a next request has begun
                self.headers_timer = self.loop.call_later(header_seconds, self.headers_late)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _disarm(self) -> None:
            if self.headers_timer is not None:
                self.headers_timer.cancel()
                self.headers_timer = None

        def send_400_response(self, msg: str) -> None:
            """A request h11 cannot read (a request line and headers past HEADER_BYTES, or no
            request at all): uvicorn answered in text/plain; every answer of this server is
            JSON."""
            self._answer(b"400 Bad Request", f"{msg.rstrip('.')} (malformed, or its headers"
                         f" over {HEADER_BYTES // 1024} KiB)")  # fmt: skip

        def _answer(self, status: bytes, error: str) -> None:
            """`status` with {"error": error}, then the connection closed."""
            body = json.dumps({"error": error}).encode()
            self.transport.write(
                b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\n"
                + b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body) + body
            )  # fmt: skip
            self.transport.close()

        def headers_late(self) -> None:
            self.headers_timer = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            if self.conn.trailing_data[0]:  # headers begun, never finished: say why
                logger.info("a request's headers did not come within %g s: closed", header_seconds)
                self._answer(b"408 Request Timeout", "the request headers did not come whole"
                             f" within serve.header_seconds ({header_seconds:g} s)")  # fmt: skip
            self.transport.close()

    return HeaderTimeout


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (port 0: any free one), or one line saying why it cannot be."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as err:
        why = f"not an address to listen on ({err.strerror})"
        raise TmtError(f"{host}: {why}", param="host") from None
    # IPPROTO_TCP named: asyncio turns Nagle off (TCP_NODELAY) only on sockets that say they are
    # TCP; with Nagle on, every answer waited ~40 ms for the client's delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)  # connections wait in the backlog until uvicorn takes them
    except OSError as err:
        sock.close()
        why = "in use" if err.errno == errno.EADDRINUSE else (err.strerror or str(err))
        raise TmtError(f"{port}: {why} on {host}; choose another port", param="port") from None
    return sock


def settings(translator: Translator, overrides: Sequence[str | tuple[str, str]]) -> ServeConfig:
    """This tmt's serve.* defaults with the serve.* items of `overrides`, not those saved in the
    checkpoint: where and how a model is served is not part of the model."""
    serving = [o for o in overrides if (o if isinstance(o, str) else o[0]).startswith("serve.")]
    fresh = dataclasses.replace(translator.config, serve=ServeConfig())
    return apply_overrides(fresh, serving).serve


def serve(
    translator: Translator, overrides: Sequence[str | tuple[str, str]] = (), api_key: str = ""
) -> None:
    """Serve `translator` at serve.host:serve.port until SIGTERM or SIGINT, then drain. The model
    is decoded on this thread (the one that loaded it: batching.py says why), HTTP on another.

    The serve.* settings are this tmt's (settings)."""
    cfg = settings(translator, overrides)
    decode = translator.config.decode
    rows = decode.nbest if decode.sampling != "none" else decode.beam_size
    if rows > cfg.max_beam:
        raise TmtError(f"decode.beam_size {decode.beam_size}, decode.nbest {decode.nbest}: more"
                       f" than serve.max_beam ({cfg.max_beam}) hypotheses a sentence")  # fmt: skip
    store = glossary_store(translator, cfg)
    store.open()  # the directory made and held, a killed write's staging swept
    try:
        _run(translator, cfg, api_key, store)
    finally:
        store.close()


def _run(translator: Translator, cfg: ServeConfig, api_key: str, store: GlossaryStore) -> None:
    """serve's server: HTTP on a thread, the model decoded on this one, until a signal."""
    sock = bind(cfg.host, cfg.port)
    host, port = sock.getsockname()[:2]
    app = create_app(translator, cfg, api_key, decoder_thread=False, store=store)
    config = uvicorn.Config(
        app, log_config=None, access_log=False, lifespan="on",
        http=_http_protocol(cfg.header_seconds), h11_max_incomplete_event_size=HEADER_BYTES,
        timeout_graceful_shutdown=max(1, math.ceil(cfg.drain_seconds)),
    )  # fmt: skip
    logging.getLogger("uvicorn.error").setLevel(logging.WARNING)
    server = uvicorn.Server(config)  # on a thread: uvicorn leaves the signals to us
    batcher = app.state.service.batcher
    batcher.open()  # requests may queue before the worker below starts

    def http() -> None:
        try:
            server.run(sockets=[sock])
        finally:
            batcher.stop()  # whatever ended the server ends the worker

    # SIGTERM or SIGINT: uvicorn stops accepting and drains (a second one: at once), exit 0; what
    # is still in flight at serve.drain_seconds is answered 503 (Service.start_drain).
    service = app.state.service

    def stop(sig: int, frame: Any) -> None:
        service.start_drain()
        server.handle_exit(sig, frame)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    http_thread = threading.Thread(target=http, name="tmt-http")
    http_thread.start()
    where = f"[{host}]" if ":" in host else host
    logger.info("serving %s on http://%s:%d%s", translator.origin, where, port,
                " (API key required)" if api_key else "")  # fmt: skip
    batcher.run()
    while http_thread.is_alive():  # a timed wait, for a second signal (exits.SIGNAL_POLL_S)
        http_thread.join(SIGNAL_POLL_S)
    logger.info("stopped")
