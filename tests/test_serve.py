"""tmt serve through a real uvicorn on an ephemeral 127.0.0.1 port: the endpoints, outputs equal to
tmt translate's, dynamic batching, limits and bad input, the API key, a drain on SIGTERM."""

from __future__ import annotations

import atexit
import concurrent.futures
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import cli_processes
import httpx
import pytest
from conftest import multi30k_sentences

from transformer_mt.network import alignment
from transformer_mt.translation import translate
from transformer_mt.translation.decoding import translate_lines

REPO = Path(__file__).resolve().parent.parent
SOURCES = multi30k_sentences(16)
SERVER_EXIT_S = 75  # serve.drain_seconds' default (30 s), and room for a slow, busy machine


class Server:
    """`tmt serve` in a child process on port 0; its log collected, stopped at the end."""

    def __init__(self, model: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.scratch = None
        if not any(arg.startswith("serve.glossary_dir=") for arg in args):
            # One server holds a glossary directory: each test server a directory of its own.
            self.scratch = tempfile.mkdtemp(prefix="tmt-glossaries-")
            args = (*args, "--set", f"serve.glossary_dir={self.scratch}")
        command = ["serve", "-m", str(model), "--port", "0", *args]
        # PYTHONFAULTHANDLER: a server that outlives its drain prints its threads' stacks on
        # SIGABRT (stop), so that a hang says where it is.
        self.process = cli_processes.popen(
            command, env={**os.environ, "PYTHONFAULTHANDLER": "1", **(env or {})},
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.log: list[str] = []
        ready = threading.Event()
        self.url = ""

        def read() -> None:
            for line in self.process.stderr:
                self.log.append(line)
                found = re.search(r"serving .* on (http://[\d.]+:\d+)", line)
                if found:
                    self.url = found.group(1)
                    ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(90):
            self.stop()
            raise AssertionError("the server did not start:\n" + "".join(self.log))
        self.client = httpx.Client(base_url=self.url, timeout=60)
        atexit.register(self.stop)  # a test that fails before its stop leaves no server running

    def stop(self) -> int:
        """SIGTERM, then the server's exit status. The wait outlasts the server's own bound (its
        drain, serve.drain_seconds: 30 s by default; a 30-second wait once killed a server the
        ensemble test had just used); past it the server prints where its threads are
        (SIGABRT) and the test fails with its log."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(SERVER_EXIT_S)
        except subprocess.TimeoutExpired:
            self.process.send_signal(signal.SIGABRT)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
            time.sleep(0.5)  # the reader thread's last lines
            raise AssertionError(
                f"the server did not exit within {SERVER_EXIT_S} s of SIGTERM:\n"
                + "".join(self.log[-120:])
            ) from None
        finally:
            if self.scratch:
                shutil.rmtree(self.scratch, ignore_errors=True)

    def batches(self) -> float:
        """Decoding calls so far (the count of the batch-size histogram)."""
        text = self.client.get("/metrics").text
        return float(re.search(r"^tmt_batch_sentences_count (\S+)$", text, re.M).group(1))


@pytest.fixture(scope="module")
def server(multi30k_run: Path) -> Iterator[Server]:
    started = Server(
        multi30k_run,
        "--set", "serve.max_wait_ms=300", "--set", "serve.gap_ms=100", "--set", "serve.max_sentences=20",
        "--set", "serve.max_chars=300", "--set", "serve.max_body_bytes=20000",
        "--set", "serve.max_queue=30", "--set", "serve.body_seconds=2",
    )  # fmt: skip
    yield started
    assert started.stop() == 0
    assert not any("Traceback" in line for line in started.log), "".join(started.log)


@pytest.fixture(scope="module")
def expected(multi30k_run: Path) -> list[str]:
    """What tmt translate writes for SOURCES: real sentences, not all alike (else comparing them
    would prove nothing)."""
    outputs = translate.translate_text(translate.load_translator(multi30k_run), SOURCES)
    assert all(outputs) and len(set(outputs)) > len(outputs) // 2, outputs
    return outputs


def test_the_endpoints_answer_and_translate_as_tmt_translate_does(
    server: Server, multi30k_run: Path, expected: list[str]
) -> None:
    assert server.url.startswith("http://127.0.0.1:")  # loopback unless told otherwise
    assert server.client.get("/health").json() == {"status": "ok"}
    card = server.client.get("/v1/model").json()
    assert card["languages"] == {"source": "de", "target": "en"} and card["parameters"] > 0
    assert card["step"] == 300 and card["run"] == str(multi30k_run)
    answer = server.client.post("/v1/translate", json={"text": SOURCES}).json()
    assert answer["translations"] == expected
    one = server.client.post("/v1/translate", json={"text": SOURCES[0]}).json()
    assert one["translations"] == expected[:1]
    nbest = server.client.post("/v1/translate", json={"text": SOURCES[:2], "nbest": 2}).json()
    assert [len(rows) for rows in nbest["nbest"]] == [2, 2]
    assert nbest["nbest"][0][0]["score"] >= nbest["nbest"][0][1]["score"]
    sampled = {"text": SOURCES[:3], "sampling": "topk:5", "seed": 3}
    first, again = (server.client.post("/v1/translate", json=sampled).json() for _ in range(2))
    assert first["translations"] == again["translations"]  # a seed fixes the samples
    assert server.client.get("/").text.startswith("<!doctype html>")
    gaps = server.client.post("/v1/translate", json={"text": ["", SOURCES[0]], "nbest": 2}).json()
    assert gaps["translations"] == ["", expected[0]] and gaps["nbest"][0] == []
    assert gaps["nbest"][1][0]["translation"] == expected[0]
    assert "tmt_requests_total" in server.client.get("/metrics").text


def test_prefixes_and_alignments_are_served_as_tmt_translate_gives_them(
    server: Server, multi30k_run: Path
) -> None:
    prefixes = ["Zebra", "", "Two men", ""]
    model = translate.load_translator(multi30k_run)
    expected = model.translate(SOURCES[:4], prefix=prefixes)
    assert expected[0].startswith("Zebra") and expected[2].startswith("Two men")
    body = {"text": SOURCES[:4], "prefix": prefixes}
    assert server.client.post("/v1/translate", json=body).json()["translations"] == expected
    one = server.client.post("/v1/translate", json={"text": SOURCES[0], "prefix": "Zebra"})
    assert one.json()["translations"] == expected[:1]
    aligned = translate.load_translator(multi30k_run, ["decode.alignment=word"])
    pairs = [h[0].alignment for h in translate.translate_lines(aligned, SOURCES[:2])]
    body = {"text": SOURCES[:2], "alignment": "word", "nbest": 2}
    answer = server.client.post("/v1/translate", json=body).json()
    assert answer["alignments"] == [alignment.pharaoh(p) for p in pairs]
    assert answer["nbest"][0][0]["alignment"] == answer["alignments"][0]
    for bad, named in [
        ({"text": SOURCES[0], "alignment": "phrase"}, "decode.alignment"),
        ({"text": SOURCES[:2], "prefix": ["A"]}, "1 prefixes for 2 sentences"),
        ({"text": SOURCES[:2], "prefix": "A"}, "prefix: a string for a text string"),
        ({"text": SOURCES[0], "prefix": ["A" * 301]}, "prefix: a string for a text string"),
        ({"text": [SOURCES[0]], "prefix": ["A" * 301]}, "at most 300"),
    ]:
        answer = server.client.post("/v1/translate", json=bad)
        assert answer.status_code in (413, 422) and named in answer.json()["error"], answer.text


def test_the_libretranslate_api_answers_its_clients(
    server: Server, multi30k_run: Path, expected: list[str]
) -> None:
    client = server.client
    assert client.get("/languages").json()[0] == {"code": "de", "name": "German", "targets": ["en"]}
    single = client.post("/translate", json={"q": SOURCES[0], "source": "de", "target": "en"})
    assert single.json() == {"translatedText": expected[0]}
    form = client.post("/translate", data={"q": SOURCES[1], "source": "auto", "target": "en"})
    assert form.json() == {
        "translatedText": expected[1],
        "detectedLanguage": {"confidence": 100.0, "language": "de"},
    }
    listed = client.post("/translate", json={"q": SOURCES[:3], "source": "de", "target": "en",
                                             "format": "text", "api_key": ""}).json()  # fmt: skip
    assert listed == {"translatedText": expected[:3]}
    options = client.post("/translate", json={"q": SOURCES[0], "source": "de", "target": "en",
                                              "alternatives": 2}).json()  # fmt: skip
    # alternatives=2 widens the beam to 3 (the fixture decodes with 2), whose best may differ from
    # beam 2's: the answer is tmt translate's 3-best list at beam 3, best first
    wider = translate.load_translator(multi30k_run, ["decode.beam_size=3", "decode.nbest=3"])
    (three_best,) = translate_lines(wider, SOURCES[:1])
    assert len(three_best) == 3 and len(options["alternatives"]) == 2
    assert [options["translatedText"], *options["alternatives"]] == translate.detokenize(
        wider, [h.tokens for h in three_best]
    )
    markup = client.post("/translate", json={
        "q": f"<p class='x'>{SOURCES[0]} <b>{SOURCES[1]}</b></p>", "source": "de", "target": "en",
        "format": "html"}).json()["translatedText"]  # fmt: skip
    assert markup == f"<p class='x'>{expected[0]} <b>{expected[1]}</b></p>"
    documents = client.post("/translate", json={
        "q": [f"<!-- kept --><i>{SOURCES[2]}</i>", f"<p>{SOURCES[3]}</p>"], "source": "de",
        "target": "en", "format": "html"}).json()["translatedText"]  # fmt: skip
    assert documents == [f"<!-- kept --><i>{expected[2]}</i>", f"<p>{expected[3]}</p>"]
    # the texts of all documents count against serve.max_sentences (20) together
    many = client.post("/translate", json={"q": ["<b>a</b> <i>b</i> c"] * 7, "source": "de",
                                           "target": "en", "format": "html"})  # fmt: skip
    assert many.status_code == 413 and "serve.max_sentences" in many.json()["error"]
    for body, message in [
        ({"q": "x", "source": "de", "target": "fr"}, "fr is not supported"),
        ({"q": "x", "source": "en", "target": "de"}, "German (de) is not available"),
        ({"source": "de", "target": "en"}, "missing q parameter"),
        ({"q": "x", "source": "de", "target": "en", "format": "pdf"}, "pdf format is not"),
    ]:
        refused = client.post("/translate", json=body)
        assert refused.status_code == 400 and message in refused.json()["error"], refused.text


def test_concurrent_requests_are_decoded_together_with_the_same_outputs(
    server: Server, expected: list[str]
) -> None:
    before = server.batches()
    with concurrent.futures.ThreadPoolExecutor(len(SOURCES)) as pool:
        answers = list(pool.map(
            lambda s: server.client.post("/v1/translate", json={"text": [s]}).json(), SOURCES
        ))  # fmt: skip
    assert [a["translations"][0] for a in answers] == expected
    batches = server.batches() - before
    assert 1 <= batches <= len(SOURCES) // 4, batches  # 16 requests in a few decoding calls


def test_bad_requests_are_a_4xx_with_one_message(server: Server) -> None:
    client = server.client
    cases = [
        (client.post("/v1/translate", content=b"{bad", headers={"content-type": "application/json"}), 400, "not valid JSON"),
        (client.post("/v1/translate", content=b"text=x"), 400, "not a JSON object"),
        (client.post("/v1/translate", json={"text": 5}), 422, "text"),
        (client.post("/v1/translate", json={"text": ["a"], "beam_size": "5"}), 422, "beam_size"),
        (client.post("/v1/translate", json={"text": []}), 422, "no text"),
        (client.post("/v1/translate", json={"text": ["a"], "colour": 1}), 422, "colour: unknown field"),
        (client.post("/v1/translate", json={"text": ["a"], "beam_size": 0}), 422, "decode.beam_size = 0"),
        (client.post("/v1/translate", json={"text": ["a"] * 21}), 413, "serve.max_sentences"),
        (client.post("/v1/translate", json={"text": ["a" * 301]}), 413, "serve.max_chars"),
        (client.post("/v1/translate", json={"text": ["a"] * 20000}), 413, "serve.max_body_bytes"),
        (client.post("/v1/translate", content=iter([b'{"text": ["' + b"a" * 30000 + b'"]}'])), 413, "serve.max_body_bytes"),
        (client.post("/v1/translate", json={"text": ["a"], "beam_size": 10**30}), 422, "serve.max_beam"),
        (client.post("/v1/translate", json={"text": ["a"], "beam_size": 17}), 422, "serve.max_beam"),
        (client.post("/translate", json={"q": "a", "source": "de", "target": "en",
                                         "alternatives": 10**6}), 422, "serve.max_beam"),
        (client.get("/nowhere"), 404, "Not Found"),
        (client.get("/v1/translate"), 405, "Method Not Allowed"),
    ]  # fmt: skip
    for response, status, message in cases:
        assert response.status_code == status, (message, response.text)
        error = response.json()["error"]
        assert message in error and "\n" not in error and "Traceback" not in error, error
    assert server.client.get("/health").status_code == 200  # still standing
    # lone surrogates (valid JSON escapes, no UTF-8) are read as the model reads them
    lone = client.post("/v1/translate", content=b'{"text": ["ein \\ud800 Hund"]}',
                       headers={"content-type": "application/json"})  # fmt: skip
    assert lone.status_code == 200 and len(lone.json()["translations"]) == 1
    # a body that never comes whole holds its connection serve.body_seconds, then 408
    with socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])), 10) as raw:
        raw.sendall(b"POST /v1/translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                    b"\r\nContent-Length: 100\r\n\r\n{\"text\":")  # fmt: skip
        answer = b""
        while not answer.endswith(b"0\r\n\r\n") and (part := raw.recv(4096)):
            answer += part  # the head and the chunked body may come apart
    assert answer.startswith(b"HTTP/1.1 408") and b"serve.body_seconds" in answer


def test_the_queue_is_bounded_and_a_request_beyond_it_is_503_with_retry_after(
    trained_run: Path,
) -> None:
    from transformer_mt.serving.batching import Batcher, Job, QueueFull

    class Quiet:
        def queued(self, n: int) -> None: ...

    batcher = Batcher(max_tokens=100, max_wait_s=0.0, max_queue=3, metrics=Quiet())
    batcher._running = True  # no worker: what is queued stays queued
    batcher.submit(Job(lines=["a", "b"], translator=None, key=(), tokens=4))  # type: ignore[arg-type]
    with pytest.raises(QueueFull, match="2 sentences are waiting"):
        batcher.submit(Job(lines=["c", "d"], translator=None, key=(), tokens=4))  # type: ignore[arg-type]
    tight = Server(trained_run, "--set", "serve.max_queue=2")
    try:
        refused = tight.client.post("/v1/translate", json={"text": ["kalo", "mi", "nu"]})
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert "serve.max_queue" in refused.json()["error"]
        assert tight.client.post("/v1/translate", json={"text": ["kalo", "mi"]}).status_code == 200
    finally:
        assert tight.stop() == 0


def test_an_api_key_guards_every_endpoint_but_health_and_is_never_logged(
    trained_run: Path,
) -> None:
    key = "s3cret-key-4711"
    guarded = Server(trained_run, env={"TMT_API_KEY": key})
    try:
        client = guarded.client
        assert client.get("/health").status_code == 200
        for path in ("/v1/model", "/metrics"):
            assert client.get(path).status_code == 401
            wrong = client.get(path, headers={"Authorization": "Bearer nope"})
            assert wrong.status_code == 401 and wrong.json() == {"error": "Invalid API key"}
            assert client.get(path, headers={"Authorization": f"Bearer {key}"}).status_code == 200
        body = {"q": SOURCES[0], "source": "de", "target": "en"}
        assert client.post("/translate", json=body).status_code == 401
        assert client.post("/translate", json={**body, "api_key": key}).status_code == 200
        assert (
            client.post(f"/translate?api_key={key}", json={**body, "api_key": key}).status_code
            == 200
        )
        # As LibreTranslate's own server, for the placements its clients use (P29): the key in
        # the query string alone, or a form body; no key asked for the languages (its Python
        # client sends a GET with the key in a form body, older ones a POST) or the settings.
        assert client.post(f"/translate?api_key={key}", json=body).status_code == 200
        assert client.post("/translate", data={**body, "api_key": key}).status_code == 200
        assert client.post("/translate?api_key=nope", data=body).status_code == 401
        for answer in (client.request("GET", "/languages", data={"api_key": key}),
                       client.post("/languages", data={"api_key": key}), client.get("/languages"),
                       client.post("/languages")):  # fmt: skip
            assert answer.status_code == 200 and answer.json()[0]["code"] == "de"
        settings = client.get("/frontend/settings").json()
        assert settings["keyRequired"] is True and settings["language"]["target"]["code"] == "en"
    finally:
        assert guarded.stop() == 0
    assert "API key required" in "".join(guarded.log)
    assert key not in "".join(guarded.log)


def raw_exchange(url: str, request: bytes) -> bytes:
    """Send `request` whole on a fresh connection, then read the answer until the server closes
    or has answered (a read bounded at 60 s: the step that could hang)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(request)
        answer = b""
        while b'"}' not in answer.partition(b"\r\n\r\n")[2]:  # the JSON answer's end
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
    return answer


def test_slow_headers_a_refused_body_and_probes_get_their_answer(
    trained_run: Path, tmp_path: Path
) -> None:
    run_copy = tmp_path / "run"
    shutil.copytree(trained_run, run_copy)
    server = Server(run_copy, "--beam", "2", "--set", "serve.header_seconds=1",
                    "--set", "serve.max_body_bytes=20000")  # fmt: skip
    try:
        # Slowloris (P27): headers begun and never finished get a 408 and the connection ends.
        answer = raw_exchange(server.url, b"POST /v1/translate HTTP/1.1\r\nHost: x\r\n")
        assert answer.startswith(b"HTTP/1.1 408") and b"serve.header_seconds" in answer
        # Headers past h11's 16 KiB, or a request line it cannot read: a 400 in JSON, as every
        # answer (uvicorn's own was text/plain "Invalid HTTP request received.").
        for request in (b"POST /v1/translate HTTP/1.1\r\nHost: x\r\nX-Big: " + b"x" * 65536,
                        b"NOT HTTP AT ALL\r\n\r\n"):  # fmt: skip
            answer = raw_exchange(server.url, request)
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head, answer
            assert "malformed, or its headers over 16 KiB" in json.loads(body)["error"]
        # A client that sends its whole body before it reads gets the 413, not a reset (P28).
        body = b"q=" + b"a" * 3_000_000
        request = (b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/"
                   b"x-www-form-urlencoded\r\nContent-Length: %d\r\n\r\n" % len(body))  # fmt: skip
        answer = raw_exchange(server.url, request + body)
        assert answer.startswith(b"HTTP/1.1 413") and b"serve.max_body_bytes" in answer
        # Monitors probe with HEAD.
        assert server.client.head("/health").status_code == 200
        # Sampling draws nbest samples whatever the beam (P21); options it would not read are
        # a 422 naming them.
        sampled = {"text": SOURCES[:2], "sampling": "topk:5", "nbest": 4, "seed": 1}
        answer = server.client.post("/v1/translate", json=sampled)
        assert answer.status_code == 200 and [len(r) for r in answer.json()["nbest"]] == [4, 4]
        for bad, named in [
            ({"temperature": 0.5}, "temperature=0.5: applies to sampling only"),
            ({"seed": 1}, "seed=1: applies to sampling only"),
            ({"sampling": "full", "beam_size": 3}, "not used while sampling"),
        ]:
            answer = server.client.post("/v1/translate", json={"text": "kalo", **bad})
            assert answer.status_code == 422 and named in answer.json()["error"], answer.text
        # Curves are of the served model's run only: a run directory replaced since holds
        # another run's (P30).
        assert server.client.get("/v1/curves.png").status_code == 200
        shutil.rmtree(run_copy / "checkpoints")
        answer = server.client.get("/v1/curves.png")
        assert answer.status_code == 404 and "no longer holds the served model" in answer.text
    finally:
        assert server.stop() == 0
    assert not any("Traceback" in line for line in server.log), "".join(server.log)


def test_sigterm_lets_the_request_in_flight_finish_and_exits_0(trained_run: Path) -> None:
    draining = Server(trained_run, "--set", "serve.max_wait_ms=2000", "--set", "serve.gap_ms=2000")
    answers: list[httpx.Response] = []
    request = threading.Thread(target=lambda: answers.append(
        draining.client.post("/v1/translate", json={"text": SOURCES[:2]})))  # fmt: skip
    request.start()
    time.sleep(0.5)  # the request waits in the batcher
    draining.process.send_signal(signal.SIGTERM)
    request.join(30)
    assert draining.process.wait(30) == 0
    assert answers and answers[0].status_code == 200 and len(answers[0].json()["translations"]) == 2
    with pytest.raises(httpx.ConnectError):
        httpx.get(draining.url + "/health", timeout=5)


# The main thread waits idle (tmt serve's decoder for a request; tmt translate for stdin's next
# line) while a signal arrives. The kernel may hand a process's signal to any thread that does
# not block it: here the main thread blocks it, so another thread takes it, as one did when a
# test's server ignored SIGTERM for 75 s. Python runs the handler on the main thread only: its
# wait must wake for it.
_SIGNAL_ELSEWHERE = """
import signal, sys, threading, time
signal.pthread_sigmask(signal.SIG_UNBLOCK, {{signal.{signal}}})  # a test runner may block it
elsewhere = threading.Thread(target=time.sleep, args=(600,), daemon=True)
elsewhere.start()  # a thread that takes the signal: started before the main thread blocks it
{setup}
signal.pthread_sigmask(signal.SIG_BLOCK, {{signal.{signal}}})
print("waiting", flush=True)
{wait}
print("stopped", flush=True)
"""
_IDLE_WAITS = {
    "serve's idle decoder": (
        "SIGTERM",
        "from transformer_mt.serving.batching import Batcher\n"
        "class Quiet:\n"
        "    def queued(self, n): pass\n"
        "batcher = Batcher(max_tokens=100, max_wait_s=0.01, max_queue=10, metrics=Quiet())\n"
        "batcher.open()\n"
        "signal.signal(signal.SIGTERM, lambda *_: batcher.stop())",
        "batcher.run()",
    ),
    "translate waiting for a line": (
        "SIGINT",
        "from transformer_mt.common import textio\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)  # a test runner may ignore it\n"
        "def lines():\n"
        "    time.sleep(600)  # stdin that sends nothing\n"
        "    yield 'never'",
        "try:\n    next(textio.waiting_chunks(lines(), 4))\nexcept KeyboardInterrupt:\n    pass",
    ),
}


@pytest.mark.parametrize("idle", list(_IDLE_WAITS))
def test_a_signal_another_thread_takes_still_ends_the_main_thread_s_wait(idle: str) -> None:
    name, setup, wait = _IDLE_WAITS[idle]
    script = _SIGNAL_ELSEWHERE.format(setup=setup, signal=name, wait=wait)
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                               cwd=REPO)  # fmt: skip
    try:
        assert process.stdout is not None and process.stdout.readline() == "waiting\n"
        time.sleep(0.3)  # in its wait
        process.send_signal(getattr(signal, name))
        out, _ = process.communicate(timeout=30)  # was: no end (the wait had no timeout)
    finally:
        process.kill()
    assert process.returncode == 0 and out == "stopped\n"


def test_a_port_in_use_is_one_line_and_exit_2(trained_run: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "transformer_mt", "serve", "-m", str(trained_run),
             "--port", str(port)], capture_output=True, text=True, cwd=REPO, timeout=120,
        )  # fmt: skip
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("tmt: error:")]
    assert errors == [f"tmt: error: --port {port}: in use on 127.0.0.1; choose another port"]


def test_a_request_whose_client_has_gone_is_never_decoded(trained_run: Path) -> None:
    waiting = Server(trained_run, "--set", "serve.max_wait_ms=3000", "--set", "serve.gap_ms=3000")
    try:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
            waiting.client.post("/v1/translate", json={"text": ["kalo mi"]}, timeout=0.5)
        time.sleep(4)  # past the batcher's wait: the job would have been decoded by now
        assert waiting.batches() == 0
        assert waiting.client.post("/v1/translate", json={"text": "kalo"}).status_code == 200
        assert waiting.batches() == 1
    finally:
        assert waiting.stop() == 0


def test_a_client_that_has_gone_costs_nothing(
    trained_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformer_mt.serving import batching

    decoded: list[str] = []
    monkeypatch.setattr(batching, "translate_lines",
                        lambda translator, lines, prefixes=None, matches=None, **_: decoded.extend(lines) or [[] for _ in lines])  # fmt: skip

    class Quiet:
        def queued(self, n: int) -> None: ...

        def observe_batch(self, sentences: int, seconds: float) -> None: ...

    batcher = batching.Batcher(
        max_tokens=100, max_wait_s=0.2, max_queue=10, metrics=Quiet(), gap_s=0.2
    )
    gone = batching.Job(lines=["gone"], translator=None, key=(), tokens=2)  # type: ignore[arg-type]
    kept = batching.Job(lines=["kept"], translator=None, key=(), tokens=2)  # type: ignore[arg-type]
    batcher.start()
    try:
        batcher.submit(gone)
        gone.cancelled = True  # its client disconnected while it waited
        batcher.submit(kept).result(timeout=10)
    finally:
        batcher.stop(timeout=5)
    assert decoded == ["kept"]


def test_a_missing_serve_extra_is_one_line_and_exit_2(trained_run: Path) -> None:
    without_fastapi = (
        "import sys; sys.modules['fastapi'] = None; from transformer_mt.cli import main;"
        " sys.argv = ['tmt', 'serve', '-m', sys.argv[1]]; main()"
    )
    result = subprocess.run([sys.executable, "-c", without_fastapi, str(trained_run)],
                            capture_output=True, text=True, cwd=REPO, timeout=60)  # fmt: skip
    assert result.returncode == 2
    assert result.stderr == (
        "tmt: error: tmt serve needs the serve extra (fastapi is missing):"
        " pip install 'transformer_mt[serve]'\n"
    )


def test_the_batcher_gathers_a_burst_and_lets_a_lone_request_go(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from transformer_mt.serving import batching

    calls: list[list[str]] = []
    monkeypatch.setattr(batching, "translate_lines",
                        lambda translator, lines, prefixes=None, matches=None, **_: calls.append(lines) or [[] for _ in lines])  # fmt: skip

    class Quiet:
        def queued(self, n: int) -> None: ...

        def observe_batch(self, sentences: int, seconds: float) -> None: ...

    def job(line: str) -> batching.Job:
        return batching.Job(lines=[line], translator=None, key=(), tokens=2)  # type: ignore[arg-type]

    # a burst (one every 20 ms, each within gap_s of the last) is one decoding call
    batcher = batching.Batcher(max_tokens=100, max_wait_s=1.0, max_queue=10, metrics=Quiet(),
                               gap_s=0.5)  # fmt: skip
    batcher.start()
    try:
        futures = []
        for line in "abcde":
            futures.append(batcher.submit(job(line)))
            time.sleep(0.02)
        for future in futures:
            future.result(timeout=10)
        assert calls == [list("abcde")]
        # once the burst has gone (idle longer than max_wait_s), a lone request waits gap_s,
        # not max_wait_s for the burst's clients to come back
        time.sleep(1.5)
        batcher.gap_s = 0.01
        batcher.submit(job("f")).result(timeout=0.9)
        assert calls[-1] == ["f"]
    finally:
        batcher.stop(timeout=5)


def test_serve_settings_are_this_tmts_and_sets_not_the_checkpoints(trained_run: Path) -> None:
    import dataclasses

    from transformer_mt.serving import serve

    loaded = translate.load_translator(trained_run)
    saved = dataclasses.replace(  # a model whose run was trained with serve.max_sentences=1
        loaded, config=dataclasses.replace(
            loaded.config, serve=dataclasses.replace(loaded.config.serve, max_sentences=1)
        ),
    )  # fmt: skip
    default = type(loaded.config.serve)().max_sentences
    assert serve.settings(saved, []).max_sentences == default != 1
    assert serve.settings(saved, ["decode.beam_size=2"]).max_sentences == default
    assert serve.settings(saved, ["serve.max_sentences=1"]).max_sentences == 1


# slow: make test keeps its promise with ::test_serve_settings_are_this_tmts_and_sets_not_the_checkpoints
# (the settings a server takes) and the limit's 413 with ::test_bad_requests_are_a_4xx_with_one_message
@pytest.mark.slow
def test_serve_settings_come_from_this_tmt_and_set_not_from_the_checkpoint(
    tiny_cfg, tmp_path: Path
) -> None:
    """Where and how a model is served is not part of the model: a run trained with
    serve.max_sentences=1 is served with the default limit unless --set says otherwise."""
    import dataclasses

    from transformer_mt.training.train import train

    train(dataclasses.replace(
        tiny_cfg, serve=dataclasses.replace(tiny_cfg.serve, max_sentences=1),
        train=dataclasses.replace(tiny_cfg.train, out_dir=str(tmp_path / "run"), max_steps=2),
    ))  # fmt: skip
    served = Server(tmp_path / "run")
    try:
        assert served.client.post("/v1/translate", json={"text": ["a", "b"]}).status_code == 200
    finally:
        assert served.stop() == 0
    limited = Server(tmp_path / "run", "--set", "serve.max_sentences=1")
    try:
        refused = limited.client.post("/v1/translate", json={"text": ["a", "b"]})
        assert refused.status_code == 413 and "serve.max_sentences" in refused.json()["error"]
    finally:
        assert limited.stop() == 0


def test_an_error_is_logged_as_its_first_line() -> None:
    from transformer_mt.common.exits import first_line

    assert first_line(RuntimeError("out of memory\nframe #0: at::...\nframe #1")) == "out of memory"
    assert first_line(RuntimeError("  ")) == "RuntimeError"


# slow: make test keeps its promise with test_engine.py (the engine equals tmt) and
# ::test_the_endpoints_answer_and_translate_as_tmt_translate_does
@pytest.mark.slow
def test_the_ctranslate2_engine_serves_tmts_greedy_output(
    multi30k_run: Path, tmp_path: Path
) -> None:
    pytest.importorskip("ctranslate2")
    run_dir = tmp_path / "run"  # the export is made beside the model: in a copy of the run
    shutil.copytree(multi30k_run, run_dir, symlinks=True)
    greedy = translate.load_translator(run_dir, ["decode.beam_size=1"])
    expected = translate.translate_text(greedy, SOURCES)
    served = Server(run_dir, "--engine", "ctranslate2", "--beam", "1")
    try:
        card = served.client.get("/v1/model").json()
        assert card["decode"]["engine"] == "ctranslate2" and card["parameters"] > 0
        answer = served.client.post("/v1/translate", json={"text": SOURCES}).json()
        assert answer["translations"] == expected
        nbest = served.client.post("/v1/translate", json={"text": SOURCES[:2], "beam_size": 4,
                                                          "nbest": 2}).json()  # fmt: skip
        assert [len(rows) for rows in nbest["nbest"]] == [2, 2]
        refused = served.client.post("/v1/translate", json={"text": SOURCES[:1],
                                                            "sampling": "topk:5"})  # fmt: skip
        assert refused.status_code == 422 and "decode.engine=ctranslate2" in refused.json()["error"]
    finally:
        assert served.stop() == 0
    assert not any("Traceback" in line for line in served.log), "".join(served.log)


# slow: make test keeps its promise with test_ensemble.py (in this process) and
# ::test_the_endpoints_answer_and_translate_as_tmt_translate_does
@pytest.mark.slow
def test_an_ensemble_is_served_as_tmt_translate_decodes_it(multi30k_run: Path) -> None:
    paths = sorted((multi30k_run / "checkpoints").glob("step_*"))[-2:]
    lines = [*SOURCES[:4], ""]
    pair = translate.load_ensemble(paths, weights=[0.6, 0.4])
    expected = translate.translate_text(pair, lines)
    assert all(expected[:4]) and expected[4] == ""
    served = Server(paths[0], "-m", str(paths[1]), "--weights", "0.6,0.4")
    try:
        card = served.client.get("/v1/model").json()
        assert card["model"].startswith("ensemble of") and card["weights"] == [0.6, 0.4]
        assert card["validation"] is None and card["curves"] is False
        answer = served.client.post("/v1/translate", json={"text": lines}).json()
        assert answer["translations"] == expected
    finally:
        assert served.stop() == 0
    assert not any("Traceback" in line for line in served.log), "".join(served.log)


def test_a_cut_line_is_named_by_its_place_in_its_request_once(
    trained_run: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The batcher decodes several requests' lines as one batch; a line cut to the model's
    positions was named by its place in that batch ("line 3" for a second request's second
    line), and warned of twice (the request's count of tokens warned first)."""
    import logging

    from transformer_mt.serving import batching
    from transformer_mt.translation import sources

    t = translate.load_translator(trained_run / "checkpoints" / "step_00000030")
    long_line = " ".join(["a b c d"] * 100)  # past model.max_positions (128)

    class Quiet:
        def queued(self, n: int) -> None: ...

        def observe_batch(self, sentences: int, seconds: float) -> None: ...

    batcher = batching.Batcher(max_tokens=10_000, max_wait_s=0.0, max_queue=10, metrics=Quiet())
    jobs = [batching.Job(lines=lines, translator=t, key=(), tokens=10)
            for lines in (["a b", "c"], ["d", long_line])]  # fmt: skip
    with caplog.at_level(logging.WARNING):
        assert len(sources.source_ids(t, jobs[1].lines, warn=False)[1]) == 127  # as the service
        batcher._decode(jobs)
    assert [len(job.result.result(timeout=0)) for job in jobs] == [2, 2]
    warned = [r.getMessage() for r in caplog.records if "truncated" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("line 2: ")
