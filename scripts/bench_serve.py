"""tmt serve under load: 1, 4, 16 and 64 concurrent clients, each sending single test_2016_flickr
sentences to POST /v1/translate, against offline `Translator.translate` of the same sentences in
the same run.

    python scripts/bench_serve.py --model runs/demo/average --beam 4

First, in this process: the sentences translated all at once (offline batched lines/s) and one at
a time (a bare single-sentence call's latency). Then `tmt serve` in a child process on a free
127.0.0.1 port with the same threads, and for each level of concurrency every sentence sent once,
as its own request, by that many clients (asyncio, HTTP/1.1 keep-alive; bounded by --max-seconds
per level). Each answer must be 200 and equal the offline translation of its sentence. Printed per
level: lines/s, latency p50/p95/p99, the mean batch the server decoded, failures, and the ratios
the goals name. The last line is one JSON
object. Run it on a quiet machine: another busy process changes every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEST = REPO / "transformer_mt" / "multi30k" / "test_2016_flickr.de.gz"


def isa() -> str:
    """The widest x86 vector extension this CPU has (what decides the fastest engine)."""
    try:
        flags = set(
            re.search(r"^flags\s*:(.*)$", Path("/proc/cpuinfo").read_text(), re.M)[1].split()
        )
    except (OSError, TypeError):
        return platform.machine()
    return "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else platform.machine()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def offline(model: str, sentences: list[str], beam: int, threads: int, levels: list[int]) -> dict:
    """Batched lines/s and single-call latencies of the Translator in this process, and lines/s
    in consecutive batches of each level's size: the most a server can do with that many
    one-sentence requests in flight."""
    import torch

    from transformer_mt.translation import translate

    torch.set_num_threads(threads)
    translator = translate.load_translator(model, [f"decode.beam_size={beam}"])
    translate.translate_text(translator, sentences[:8])  # warm up
    start = time.perf_counter()
    outputs = translate.translate_text(translator, sentences)
    batched = time.perf_counter() - start
    single = []
    for sentence in sentences:
        start = time.perf_counter()
        translate.translate_text(translator, [sentence])
        single.append(time.perf_counter() - start)
    in_batches_of = {1: len(sentences) / sum(single)}
    for size in (n for n in levels if n > 1):
        start = time.perf_counter()
        for first in range(0, len(sentences), size):
            translate.translate_text(translator, sentences[first : first + size])
        in_batches_of[size] = len(sentences) / (time.perf_counter() - start)
    return {
        "outputs": outputs,
        "batched_s": batched,
        "single_s": single,
        "in_batches_of": in_batches_of,
    }


class Server:
    """`tmt serve` on a free loopback port, its stderr read until it says where it listens."""

    def __init__(self, model: str, beam: int, threads: int, overrides: list[str]) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        command = [sys.executable, "-m", "transformer_mt", "serve", "-m", model,
                   "--beam", str(beam), "--port", "0", "--host", "127.0.0.1",
                   *(a for o in overrides for a in ("--set", o))]  # fmt: skip
        self.process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
        self.url, self.log, ready = "", [], threading.Event()

        def read() -> None:
            for line in self.process.stderr:
                self.log.append(line)
                found = re.search(r"serving .* on (http://127\.0\.0\.1:\d+)", line)
                if found:
                    self.url = found.group(1)
                    ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(120):
            self.stop()
            sys.exit("tmt serve did not start:\n" + "".join(self.log))

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(10)


def batches(url: str) -> tuple[float, float]:
    """Decoding calls so far and the sentences they decoded (the server's /metrics)."""
    import httpx

    text = httpx.get(url + "/metrics", timeout=30).text
    found = dict(re.findall(r"^tmt_batch_sentences_(count|sum) (\S+)$", text, re.M))
    return float(found["count"]), float(found["sum"])


class Connection:
    """One keep-alive HTTP/1.1 connection, spoken by hand: httpx's client spent 3 ms of CPU a
    request here, and on 2 cores a load generator that heavy measures itself, not the server."""

    def __init__(self, url: str) -> None:
        self.host, self.port = url.removeprefix("http://").split(":")
        self.reader: asyncio.StreamReader | None = None

    async def post(self, path: str, payload: dict) -> tuple[int, dict]:
        if self.reader is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, int(self.port))
        body = json.dumps(payload).encode()
        self.writer.write(
            f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        head = await self.reader.readuntil(b"\r\n\r\n")
        length = int(re.search(rb"(?i)content-length: *(\d+)", head)[1])
        return int(head.split(b" ", 2)[1]), json.loads(await self.reader.readexactly(length))

    def close(self) -> None:
        if self.reader is not None:
            self.writer.close()


async def load(url: str, sentences: list[str], expected: list[str], clients: int,
               max_seconds: float) -> dict:  # fmt: skip
    """Every sentence once, by `clients` concurrent clients; latencies of the answers."""
    todo = list(range(len(sentences)))
    latencies: list[float] = []
    failed, answered, different = [], 0, 0
    deadline = time.perf_counter() + max_seconds

    async def client() -> None:
        nonlocal answered, different
        connection = Connection(url)
        try:
            while todo and time.perf_counter() < deadline:
                index = todo.pop(0)
                start = time.perf_counter()
                try:
                    status, answer = await asyncio.wait_for(
                        connection.post("/v1/translate", {"text": [sentences[index]]}), 120
                    )
                except (OSError, asyncio.IncompleteReadError, TimeoutError, ValueError) as err:
                    failed.append(f"{type(err).__name__}: {err}")
                    connection.close()
                    connection = Connection(url)
                    continue
                latencies.append(time.perf_counter() - start)
                if status != 200:
                    failed.append(f"{status}: {str(answer)[:200]}")
                    continue
                answered += 1
                different += answer["translations"] != [expected[index]]
        finally:
            connection.close()

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    wall = time.perf_counter() - start
    return {
        "clients": clients, "sent": len(sentences) - len(todo), "answered": answered,
        "unsent": len(todo), "failed": len(failed), "different": different,
        "lines_per_s": answered / wall,
        "p50_ms": 1000 * percentile(latencies, 50), "p95_ms": 1000 * percentile(latencies, 95),
        "p99_ms": 1000 * percentile(latencies, 99), "first_failures": failed[:3],
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="runs/demo/average")
    parser.add_argument("--sentences", type=int, default=400)
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--server-threads", type=int, default=0, help="0: as --threads")
    parser.add_argument("--levels", default="1,4,16,64")
    parser.add_argument("--max-seconds", type=float, default=300, help="per level")
    parser.add_argument("--set", action="append", default=[], help="serve.KEY=V for the server")
    args = parser.parse_args()
    with gzip.open(TEST, "rt", encoding="utf-8") as lines:
        sentences = [
            line.rstrip("\n") for _, line in zip(range(args.sentences), lines, strict=False)
        ]
    levels = [int(n) for n in args.levels.split(",")]
    alone = offline(args.model, sentences, args.beam, args.threads, levels)
    offline_rate = len(sentences) / alone["batched_s"]
    bare_p50 = 1000 * statistics.median(alone["single_s"])
    print(f"machine: {isa()}, {args.threads} threads; model {args.model}, beam {args.beam},"
          f" {len(sentences)} test_2016_flickr sentences; server --set {args.set}")  # fmt: skip
    print(f"offline Translator.translate, all at once: {offline_rate:.1f} lines/s")
    print(f"offline Translator.translate([sentence]), one at a time: p50 {bare_p50:.1f} ms,"
          f" {len(sentences) / sum(alone['single_s']):.1f} lines/s")  # fmt: skip
    server = Server(args.model, args.beam, args.server_threads or args.threads, args.set)
    results = []
    try:
        for clients in levels:
            calls, decoded = batches(server.url)
            level = asyncio.run(load(server.url, sentences, alone["outputs"], clients,
                                     args.max_seconds))  # fmt: skip
            calls_after, decoded_after = batches(server.url)
            level["mean_batch"] = (decoded_after - decoded) / max(1.0, calls_after - calls)
            level["over_offline"] = level["lines_per_s"] / offline_rate
            level["offline_same_batch"] = alone["in_batches_of"][clients]
            level["over_same_batch"] = level["lines_per_s"] / alone["in_batches_of"][clients]
            level["p50_over_bare"] = level["p50_ms"] / bare_p50
            results.append(level)
            print(f"{clients:3d} clients: {level['lines_per_s']:6.1f} lines/s"
                  f" ({level['over_offline']:.2f}x offline batched,"
                  f" {level['over_same_batch']:.2f}x offline in batches of {clients})"
                  f"  p50 {level['p50_ms']:7.1f} ms"
                  f" ({level['p50_over_bare']:.2f}x bare call)  p95 {level['p95_ms']:7.1f} ms"
                  f"  p99 {level['p99_ms']:7.1f} ms  mean batch {level['mean_batch']:.1f}"
                  f"  answered {level['answered']}/{len(sentences)},"
                  f" failed {level['failed']}, unlike offline {level['different']}")  # fmt: skip
    finally:
        code = server.stop()
    tracebacks = sum("Traceback" in line for line in server.log)
    print(f"server exit code {code} after SIGTERM; tracebacks in its log: {tracebacks}")
    print(json.dumps({
        "machine": isa(), "threads": args.threads, "beam": args.beam, "model": args.model,
        "sentences": len(sentences), "server_set": args.set,
        "offline_lines_per_s": round(offline_rate, 2),
        "bare_p50_ms": round(bare_p50, 2), "server_exit": code, "tracebacks": tracebacks,
        "levels": [{k: round(v, 3) if isinstance(v, float) else v for k, v in level.items()}
                   for level in results],
    }))  # fmt: skip


if __name__ == "__main__":
    from transformer_mt.common.exits import run_script

    run_script(main)
