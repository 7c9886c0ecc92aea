"""What `tmt serve`'s endpoints share (serve.py's own API, libretranslate.py's): the model with
its batcher (batching.py), the limits, the metrics, the API key and the model card. A request's
lines go through Service.translate: checked against the limits, queued, decoded in a batch with
other requests' lines, and dropped if the client goes away first.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import threading
import time
from pathlib import Path
from typing import Any

import prometheus_client as prom
from starlette.requests import Request

from transformer_mt.common import files
from transformer_mt.common.exits import TmtError
from transformer_mt.config import ServeConfig, apply_overrides, to_dict
from transformer_mt.data import glossary as glossaries
from transformer_mt.runs import checkpoint, metrics, plot
from transformer_mt.serving.batching import Batcher, Job, QueueFull
from transformer_mt.serving.glossary_store import GlossaryStore, StoreError
from transformer_mt.translation.sources import language_token
from transformer_mt.translation.translate import (
    Translator,
    check_engine,
    check_glossary,
    check_options,
    source_ids,
)


class ServeError(Exception):
    """A request the server refuses: its status, its one-line message and extra headers."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}


@dataclasses.dataclass
class Service:
    """What the endpoints share: the model, the batcher, the limits, the metrics, the key."""

    translator: Translator
    cfg: ServeConfig
    batcher: Batcher
    stats: Stats
    api_key: str
    card: dict[str, Any]
    store: GlossaryStore | None = None  # the stored glossaries (POST /v1/glossaries)
    options: dict[tuple[Any, ...], Translator] = dataclasses.field(default_factory=dict)
    inline: dict[str, glossaries.Glossary] = dataclasses.field(default_factory=dict)
    # When a drain (SIGTERM, SIGINT) must have answered what it still holds (time.monotonic()):
    # serve.drain_seconds after the signal, less a margin, so a request cut there is answered
    # 503 before uvicorn would cancel it (a 500 and a traceback). None: not draining.
    drain_deadline: float | None = None

    def start_drain(self) -> None:
        """The server was told to stop: in-flight requests have serve.drain_seconds."""
        if self.drain_deadline is None:
            margin = min(0.5, self.cfg.drain_seconds / 2)
            self.drain_deadline = time.monotonic() + self.cfg.drain_seconds - margin

    def drain_over(self) -> bool:
        return self.drain_deadline is not None and time.monotonic() >= self.drain_deadline

    def translator_for(self, overrides: list[tuple[str, str]]) -> Translator:
        """The served model with this request's decoding options (validated as the CLI's)."""
        key = tuple(overrides)
        if key not in self.options:
            try:
                config = apply_overrides(self.translator.config, overrides)
                check_options(config, overrides)
                check_engine(config, self.translator.device)
                language_token(dataclasses.replace(self.translator, config=config))
            except TmtError as err:
                raise ServeError(422, str(err)) from None
            if len(self.options) >= 64:  # a bounded cache of option sets
                self.options.pop(next(iter(self.options)))
            self.options[key] = dataclasses.replace(self.translator, config=config)
        return self.options[key]

    def glossary_for(self, inline: Any, glossary_id: Any) -> glossaries.Glossary | None:
        """A request's glossary: inline ([[source, target], ...] or TSV text; compiled once per
        content, a bounded cache), or a stored one by its id; None for neither."""
        if inline is not None and glossary_id is not None:
            raise ServeError(422, "glossary and glossary_id: give one")
        if glossary_id is not None:
            if not isinstance(glossary_id, str) or self.store is None:
                raise ServeError(422, "glossary_id: a string naming a stored glossary")
            try:
                return self.store.usable(glossary_id)
            except StoreError as err:
                raise ServeError(err.status, err.message) from None
        if inline is None:
            return None
        key = json.dumps(inline, sort_keys=True)
        if key not in self.inline:
            settings = self.translator.config.glossary
            try:
                if isinstance(inline, str):
                    made = glossaries.parse(inline, "tsv", "glossary", settings.case_sensitive,
                                            settings.max_source_words)  # fmt: skip
                elif isinstance(inline, list):
                    made = glossaries.from_pairs(inline, "glossary", settings.case_sensitive,
                                                 settings.max_source_words)  # fmt: skip
                else:
                    raise TmtError("glossary: [[source, target], ...] or TSV text")
            except TmtError as err:
                raise ServeError(422, str(err)) from None
            if len(self.inline) >= 64:
                self.inline.pop(next(iter(self.inline)))
            self.inline[key] = made
        return self.inline[key]

    async def translate(
        self,
        request: Request,
        lines: list[str],
        translator: Translator,
        prefixes: list[str] | None = None,
        glossary: glossaries.Glossary | None = None,
    ) -> Any:
        """The hypotheses of `lines` (starting with their target `prefixes`, if given), decoded in
        a batch with other requests' lines; `glossary` (else the served model's, if any) obeyed,
        each hypothesis telling which of its line's matches it uses (matches_of says which)."""
        cfg = self.cfg
        if not lines:
            raise ServeError(422, "no text: send at least one sentence")
        if prefixes is not None and len(prefixes) != len(lines):
            raise ServeError(422, f"{len(prefixes)} prefixes for {len(lines)} sentences: give"
                                  " one a sentence (maybe empty)")  # fmt: skip
        if len(lines) > cfg.max_sentences:
            raise ServeError(413, f"{len(lines)} sentences; at most {cfg.max_sentences} a request"
                                  " (serve.max_sentences)")  # fmt: skip
        longest = max(map(len, [*lines, *(prefixes or [])]))
        if longest > cfg.max_chars:
            raise ServeError(413, f"a sentence of {longest} characters; at most {cfg.max_chars}"
                                  " (serve.max_chars)")  # fmt: skip
        decode = translator.config.decode
        sampled = decode.sampling != "none"  # alone: each line's stream follows its index
        rows = decode.nbest if sampled else decode.beam_size
        if rows > cfg.max_beam:
            raise ServeError(422, f"{rows} hypotheses a sentence (beam_size, nbest); at most"
                                  f" {cfg.max_beam} (serve.max_beam)")  # fmt: skip
        # as the model reads them: lone surrogates replaced, cut to its positions (the batch
        # that decodes them warns of a cut line)
        tokens = sum(len(ids) + 1 for ids in source_ids(translator, lines, warn=False))
        key = (id(translator), id(lines) if sampled else None)
        matches = self.matches_of(lines, translator, glossary)
        job = Job(lines=lines, translator=translator, key=key, tokens=tokens, prefixes=prefixes,
                  matches=matches)  # fmt: skip
        try:
            future = self.batcher.submit(job)
        except QueueFull as err:
            raise ServeError(503, f"busy: {err}; retry later", {"Retry-After": "1"}) from None
        waiting = asyncio.wrap_future(future)
        while True:  # a client that has gone costs nothing more: its job is dropped
            done, _ = await asyncio.wait({waiting}, timeout=0.05 if self.drain_deadline else 0.25)
            if done:
                return waiting.result()
            if await request.is_disconnected():
                job.cancelled = True
                raise ServeError(499, "the client closed the request")
            if self.drain_over():  # the server is stopping and the drain's time is up
                job.cancelled = True
                raise ServeError(503, "the server is stopping: this request did not finish"
                                      " within its drain (serve.drain_seconds); retry it",
                                 {"Retry-After": "1"})  # fmt: skip

    def matches_of(
        self, lines: list[str], translator: Translator, glossary: glossaries.Glossary | None
    ) -> list[list[glossaries.Match]] | None:
        """The entries each line matches in the request's glossary, else the served one's."""
        glossary = glossary or translator.glossary
        if glossary is None:
            return None
        try:
            check_glossary(dataclasses.replace(translator, glossary=glossary))
        except TmtError as err:
            raise ServeError(422, str(err)) from None
        return glossary.match_lines(lines)


def terms_of(
    lines: list[str], matches: list[list[glossaries.Match]] | None, hyps: list[Any]
) -> list[list[dict[str, Any]]] | None:
    """The "terms" of an answer: per line, its glossary report (glossary.report's fields)."""
    if matches is None:
        return None
    return [
        glossaries.report(i + 1, line, found, h[0].terms if h else None)["terms"]
        for i, (line, found, h) in enumerate(zip(lines, matches, hyps, strict=True))
    ]


class Stats:
    """The Prometheus metrics of one app (its own registry: several apps may live in a process)."""

    def __init__(self) -> None:
        prom.disable_created_metrics()  # the *_created series only double the output
        self.registry = prom.CollectorRegistry()
        kw = {"registry": self.registry}
        self.requests = prom.Counter(
            "tmt_requests", "Requests by endpoint and status", ["endpoint", "status"], **kw
        )
        self.errors = prom.Counter("tmt_request_errors", "4xx and 5xx answers", ["endpoint"], **kw)
        self.latency = prom.Histogram("tmt_request_seconds", "Latency", ["endpoint"], **kw)
        self.batch = prom.Histogram(
            "tmt_batch_sentences", "Sentences decoded together",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024), **kw,
        )  # fmt: skip
        self.batch_seconds = prom.Histogram("tmt_batch_seconds", "Decoding time of a batch", **kw)
        self.queue = prom.Gauge("tmt_queue_sentences", "Sentences waiting to be decoded", **kw)
        self.lines = prom.Counter("tmt_translated_lines", "Lines translated", **kw)
        self.rate = prom.Gauge("tmt_lines_per_second", "Lines translated, last 30 s", **kw)
        self.rate.set_function(self._lines_per_second)
        self._recent: list[tuple[float, int]] = []
        self._lock = threading.Lock()

    def observe_batch(self, sentences: int, seconds: float) -> None:
        self.batch.observe(sentences)
        self.batch_seconds.observe(seconds)
        self.lines.inc(sentences)
        with self._lock:
            self._recent.append((time.monotonic(), sentences))

    def queued(self, sentences: int) -> None:
        self.queue.set(sentences)

    def _lines_per_second(self) -> float:
        now = time.monotonic()
        with self._lock:
            self._recent = [(t, n) for t, n in self._recent if now - t <= 30.0]
            return sum(n for _, n in self._recent) / 30.0


def check_key(header: str, api_key: str, in_body: Any = None) -> None:
    """Refuse (401) a request without the server's API key: `Authorization: Bearer KEY` (or the
    body's). Compared in constant time; never logged."""
    if not api_key:
        return
    given = header[7:] if header.lower().startswith("bearer ") else in_body
    if not isinstance(given, str) or not hmac.compare_digest(given.encode(), api_key.encode()):
        why = "Invalid API key" if given else "an API key is required: Authorization: Bearer KEY"
        raise ServeError(401, why, {"WWW-Authenticate": "Bearer"})


def model_card(translator: Translator) -> dict[str, Any]:
    """What the page and /v1/model show: languages, size, where it came from, its scores."""
    cfg, scores, scored = translator.config, {}, None
    if translator.path is not None:
        scores, scored = checkpoint.scores(translator.path), str(translator.path)
    if not scores and translator.run_dir is not None:
        last = _last_validation(translator.run_dir)
        if last:
            step = last.pop("step")
            scores, scored = last, f"the run's last validation, at step {step}"
    return {
        "model": translator.origin,
        "languages": {"source": cfg.data.src_lang, "target": cfg.data.tgt_lang},
        "parameters": translator.parameters,
        "weights": list(translator.weights) or None,  # an ensemble's, in the order of its models
        "step": translator.step,
        "run": str(translator.run_dir) if translator.run_dir else None,
        "validation": {"scores": scores, "of": scored} if scores else None,
        "decode": to_dict(cfg)["decode"],
        "device": str(translator.device),
        "curves": translator.run_dir is not None,
        "tmt_version": checkpoint.TMT_VERSION,
    }


def _last_validation(run_dir: Path) -> dict[str, Any]:
    """The newest record of metrics.jsonl with validation BLEU or chrF, and its step."""
    try:
        lines = metrics.read_log(run_dir / metrics.METRICS_FILE)
    except (TmtError, OSError):
        return {}
    for line in reversed(lines):
        with contextlib.suppress(ValueError, TypeError, AttributeError, RecursionError):
            record = json.loads(line)
            found = {k: record[k] for k in ("val_bleu", "val_chrf") if k in record}
            if found:
                return {**found, "step": record.get("step")}
    return {}


def served_checkpoint(translator: Translator) -> str:
    """SHA-256 of the served checkpoint's manifest (its files' checksums, its step): what ties a
    run directory's curves to the model served, "" for a model of no run."""
    if translator.run_dir is None or translator.path is None:
        return ""
    try:
        return files.sha256_plain(translator.path / files.MANIFEST_FILE, follow_links=True)
    except OSError:
        return ""


def curves(translator: Translator, served: str) -> bytes:
    """The curves of the served model's run, while its run directory still holds that model
    (`served`: served_checkpoint at the start): a run directory replaced since holds another
    run's curves."""
    if translator.run_dir is None:
        raise ServeError(404, "the model did not come from a run directory: no curves")
    if not served or served_checkpoint(translator) != served:
        raise ServeError(
            404, f"{translator.run_dir} no longer holds the served model (its checkpoint"
            f" {translator.path} changed or is gone): no curves",
        )  # fmt: skip
    try:
        return plot.render_curves([translator.run_dir], "png")[0]
    except plot.NoMatplotlib:
        extra = "pip install 'transformer_mt[plot]'"
        raise ServeError(404, f"drawing curves needs matplotlib ({extra})") from None
    except TmtError as err:
        raise ServeError(404, str(err)) from None
