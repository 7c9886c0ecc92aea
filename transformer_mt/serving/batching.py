"""Dynamic batching for `tmt serve`: the sentences of all waiting requests are decoded together by
one worker, the only thread that touches the model (no threads racing inside torch). `tmt serve`
runs the worker on the main thread, the one that loaded the model, and the HTTP server in another:
torch's OpenMP threads belong to the thread that started them, and a second thread running torch
gets a second team on the same cores, which made single-sentence decoding 2.4x slower on 2 cores
(docs/benchmarks.md).

A request is a Job: its lines, the Translator with its decoding options applied, and a Future the
worker completes. The worker takes the oldest job, then every job already waiting, then waits for
more (the clients of the last batch; or, after an idle spell, whoever keeps coming within
serve.gap_ms), up to serve.max_tokens source tokens and at most serve.max_wait_ms (_gather says
why), and decodes each group of jobs with the same options as one call of
translate_lines (which sorts by length and batches by tokens). A line's hypotheses do not depend
on the lines it is batched with (tests/test_translate.py), so batching changes speed, not output.
Sampled jobs are decoded on their own: their random streams follow each line's index in its own
request. The queue is bounded in sentences: a request beyond it is refused (QueueFull), and a
cancelled job (its client has gone) is dropped unless its batch has already started.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from transformer_mt.common.exits import SIGNAL_POLL_S, first_line
from transformer_mt.network.search import Hypothesis
from transformer_mt.translation.translate import Translator, translate_lines

logger = logging.getLogger(__name__)


class QueueFull(Exception):
    """The queue holds serve.max_queue sentences already: the caller should come back later."""


@dataclass
class Job:
    lines: list[str]
    translator: Translator  # the served model with this request's decoding options
    key: tuple[Any, ...]  # jobs with the same key may share a decoding call
    tokens: int  # source tokens (what max_tokens counts)
    prefixes: list[str] | None = None  # a target prefix for each line, if any
    matches: list[list[Any]] | None = None  # the glossary entries each line matched, if any
    arrived: float = field(default_factory=time.monotonic)
    result: concurrent.futures.Future[list[list[Hypothesis]]] = field(
        default_factory=concurrent.futures.Future
    )
    cancelled: bool = False  # the client has gone: drop the job if it has not started


class Batcher:
    """The queue of jobs and the worker that decodes them: `run` on the calling thread until
    `stop` (or `start`: a thread of its own), `submit` from any thread."""

    def __init__(
        self, max_tokens: int, max_wait_s: float, max_queue: int, metrics: Any, gap_s: float = 0.0
    ) -> None:
        self.max_tokens, self.max_wait_s, self.max_queue = max_tokens, max_wait_s, max_queue
        self.gap_s = gap_s
        self._answered = 0  # jobs in the last batch: under load, their clients come back
        self._answered_at = 0.0  # when their results were set (a client may be back before
        # the worker is: a job that came after this is one of them)
        self.metrics = metrics  # observe_batch(sentences, seconds), queued(sentences)
        self._jobs: collections.deque[Job] = collections.deque()
        self._queued = 0  # sentences in _jobs
        self._ready = threading.Condition()
        self._running = False
        self._thread: threading.Thread | None = None

    def open(self) -> None:
        """Accept jobs (before the worker runs: they wait for it)."""
        with self._ready:
            self._running = True

    def start(self) -> None:
        """Accept jobs and decode them on a thread of this batcher's own."""
        self.open()
        self._thread = threading.Thread(target=self.run, name="tmt-decoder", daemon=True)
        self._thread.start()

    def run(self) -> None:
        """Decode jobs on this thread until `stop`."""
        while True:
            jobs = self._gather()
            if jobs is None:
                return
            groups: dict[tuple[Any, ...], list[Job]] = {}
            for job in jobs:  # a client may have gone while its job waited for company
                if not job.cancelled:
                    groups.setdefault(job.key, []).append(job)
            for group in groups.values():
                self._decode(group)

    def stop(self, timeout: float | None = None) -> None:
        """Stop taking jobs; the batch being decoded finishes, jobs still queued are failed."""
        with self._ready:
            self._running = False
            self._ready.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        with self._ready:
            while self._jobs:
                self._fail(self._jobs.popleft(), RuntimeError("the server is stopping"))

    def submit(self, job: Job) -> concurrent.futures.Future[list[list[Hypothesis]]]:
        with self._ready:
            if not self._running:
                raise QueueFull("the server is stopping")
            if self._queued + len(job.lines) > self.max_queue:
                raise QueueFull(f"{self._queued} sentences are waiting (serve.max_queue)")
            self._jobs.append(job)
            self._queued += len(job.lines)
            self.metrics.queued(self._queued)
            self._ready.notify()
        return job.result

    def _gather(self) -> list[Job] | None:
        """The next batch (None once stopped): the oldest job and every job waiting, then more,
        until max_tokens source tokens, and at the latest max_wait after the worker became free
        or the oldest job came, whichever is later.

        Right after a batch it waits for as many new jobs as that batch answered, then goes:
        clients that get their answers send again a few ms later, and without waiting for them
        they form a second, smaller batch behind the jobs that waited (measured: 16 clients
        alternated batches of 11 and 5; 64 clients, batches of 64 and of 1). So one client
        sending request after request waits for nothing. After an idle spell longer than
        max_wait it waits for more only while they keep coming, each within `gap`."""
        free = time.monotonic()
        with self._ready:
            while self._running and not self._jobs:
                self._ready.wait(SIGNAL_POLL_S)  # tmt serve runs this on its main thread
            if not self._running:
                return None
            # The clients the last batch answered may come back, unless the worker has been idle
            # longer than max_wait since: then the load has gone, and a lone request waits gap.
            expected = self._answered if self._jobs[0].arrived - free <= self.max_wait_s else 0
            jobs: list[Job] = []
            tokens, came = 0, 0
            newest = max(free, self._jobs[0].arrived)
            deadline = newest + self.max_wait_s
            while self._running:
                while self._jobs and (not jobs or tokens + self._jobs[0].tokens <= self.max_tokens):
                    job = self._take()
                    came += job.arrived >= self._answered_at
                    newest = max(newest, job.arrived)
                    if not job.cancelled:
                        jobs.append(job)
                        tokens += job.tokens
                if came < expected:
                    until = deadline  # the clients the last batch answered are not all back
                elif expected:
                    break  # they are: whoever else comes is the next batch's
                else:
                    until = min(deadline, newest + self.gap_s)
                left = until - time.monotonic()
                if tokens >= self.max_tokens or left <= 0 or (self._jobs and jobs):
                    break
                self._ready.wait(left)
            self._answered = len(jobs)
            self.metrics.queued(self._queued)
            return jobs

    def _take(self) -> Job:
        job = self._jobs.popleft()
        self._queued -= len(job.lines)
        return job

    def _decode(self, jobs: list[Job]) -> None:
        """One decoding call for jobs that share their options; each gets its own lines' results."""
        lines = [line for job in jobs for line in job.lines]
        prefixes = None
        if any(job.prefixes for job in jobs):
            prefixes = [p for job in jobs for p in job.prefixes or [""] * len(job.lines)]
        matches = None  # jobs with glossaries and without share the batch: per line
        if any(job.matches is not None for job in jobs):
            matches = [m for job in jobs for m in job.matches or [[]] * len(job.lines)]
        start = time.monotonic()
        try:
            translator = jobs[0].translator  # an answer carries scores with n-best lists only
            nbest = translator.config.decode.nbest if translator is not None else 1
            # Warnings name a line by its place in its own request, not in this batch.
            lines_at = [i for job in jobs for i in range(len(job.lines))]
            results = translate_lines(translator, lines, prefixes=prefixes, matches=matches,
                                      scores=nbest > 1, lines_at=lines_at)  # fmt: skip
        except Exception as err:
            logger.error(
                "decoding %d lines failed: %s: %s", len(lines), type(err).__name__, first_line(err)
            )
            for job in jobs:
                self._fail(job, err)
            return
        self.metrics.observe_batch(len(lines), time.monotonic() - start)
        self._answered_at = time.monotonic()
        first = 0
        for job in jobs:
            if not job.result.done():
                job.result.set_result(results[first : first + len(job.lines)])
            first += len(job.lines)

    @staticmethod
    def _fail(job: Job, err: BaseException) -> None:
        if not job.result.done():
            job.result.set_exception(err)
