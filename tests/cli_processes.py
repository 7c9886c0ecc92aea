"""`tmt` commands for the tests, each in a process of its own, without paying `import torch` each
time.

A test that starts `python -m transformer_mt` spends 2-4 s of the 2-core VM's time importing torch
and tmt before the command does anything; the suite starts over a hundred. Here one server
process imports them once, runs no torch op (GNU OpenMP is not fork-safe once its threads have
run) and forks a child per command. The child gets the caller's pipes as stdin, stdout and
stderr, the command's argv, environment and working directory, runs the CLI's `main` and exits
with its code; a child killed by a signal is reported as subprocess reports it (-N). A test thus
sees what a started interpreter shows (a process of its own, its streams, its exit status, what
a kill does) less the import. What the interpreter reads only when it starts (the allocator,
thread and Hugging Face variables, PYTHON*) must equal the server's, else the command gets a
real interpreter; so do tests of start-up itself (`--help`'s speed, a missing extra, torchrun),
which start one directly. TMT_TESTS_FORK=0 gives every command a real interpreter.

    python tests/cli_processes.py SOCKET PARENT_PID     # the server (started on first use)
"""

from __future__ import annotations

import atexit
import contextlib
import json
import locale
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# Read when an interpreter starts, so a command whose value differs needs its own interpreter.
_AT_START = ("HF_", "MALLOC_", "PYTHON", "OMP_", "MKL_", "OPENBLAS_", "LD_", "CUDA_", "TORCH")
_THREADS = "OMP_NUM_THREADS"  # set in the child instead (torch.set_num_threads)
# Also read at start, but the child applies them itself (its streams, sys.dont_write_bytecode,
# faulthandler: tests/test_serve.py's servers print their stacks on SIGABRT, and a started
# interpreter for each of them cost the suite 2-3 s a server); and TORCHINDUCTOR_CACHE_DIR,
# which torch writes into the test process's environment the first time anything there asks for
# inductor's cache (torchao, torch.compile) and reads only when it compiles: matched, it sent
# every later command of that worker to a started interpreter.
_APPLIED = (
    _THREADS,
    "PYTHONUNBUFFERED",
    "PYTHONDONTWRITEBYTECODE",
    "PYTHONFAULTHANDLER",
    "TORCHINDUCTOR_CACHE_DIR",
)
_READY_TIMEOUT = 300.0  # s for the server to import torch and tmt on a busy machine


# --- the caller's side ----------------------------------------------------------------------


class _Server:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.process: subprocess.Popen | None = None
        self.socket = ""
        self.env: dict[str, str] = {}

    def address(self) -> str:
        with self.lock:
            if self.process is None or self.process.poll() is not None:
                self._start()
            return self.socket

    def _start(self) -> None:
        directory = tempfile.mkdtemp(prefix="tmt-cli-")
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
        self.socket = str(Path(directory) / "server.sock")
        self.env = dict(os.environ)
        self.process = subprocess.Popen(
            [sys.executable, __file__, self.socket, str(os.getpid())],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, cwd=REPO, env=self.env,
        )  # fmt: skip
        ready = threading.Event()
        threading.Thread(target=lambda: (self.process.stdout.readline(), ready.set()),
                         daemon=True).start()  # fmt: skip
        if not ready.wait(_READY_TIMEOUT) or self.process.poll() is not None:
            self.process.kill()
            raise RuntimeError(f"the tests' tmt server did not start ({sys.executable} {__file__})")
        atexit.register(self.process.kill)

    def suits(self, env: dict[str, str]) -> bool:
        """Whether a command with `env` may run in a child of the server (started from self.env)."""
        names = {n for n in (*env, *self.env) if n.startswith(_AT_START) and n not in _APPLIED}
        return all(env.get(n) == self.env.get(n) for n in names)


_SERVER = _Server()


def run(
    args: list[str], env: dict[str, str] | None = None, cwd: str | Path = REPO,
    timeout: float | None = None, input: str | None = None,
) -> subprocess.CompletedProcess:  # fmt: skip
    """`subprocess.run([python, -m, transformer_mt, *args], capture_output=True, text=True, ...)`."""
    pipe = subprocess.PIPE
    process = popen(args, env, cwd, stdin=pipe, stdout=pipe, stderr=pipe, text=True)
    try:
        stdout, stderr = process.communicate(input, timeout)
    except subprocess.TimeoutExpired:  # as subprocess.run: kill it, keep what it wrote
        process.kill()
        stdout, stderr = process.communicate()
        raise subprocess.TimeoutExpired(process.args, timeout, stdout, stderr) from None
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def popen(
    args: list[str], env: dict[str, str] | None = None, cwd: str | Path = REPO, **streams: Any
) -> subprocess.Popen | Process:
    """`subprocess.Popen([python, -m, transformer_mt, *args], env=env, cwd=cwd, **streams)`
    (streams: stdin, stdout, stderr as PIPE, DEVNULL or None; text), in a child of the server
    where the command may run there."""
    env = dict(os.environ if env is None else env)
    address = "" if os.environ.get("TMT_TESTS_FORK") == "0" else _SERVER.address()
    if not address or not _SERVER.suits(env):
        command = [sys.executable, "-m", "transformer_mt", *args]
        return subprocess.Popen(command, env=env, cwd=cwd, **streams)
    return Process(address, args, env, cwd, **streams)


class Process:
    """A command in a child of the server: the part of subprocess.Popen the tests use."""

    def __init__(
        self, address: str, args: list[str], env: dict[str, str], cwd: str | Path,
        stdin: int | None = None, stdout: int | None = None, stderr: int | None = None,
        text: bool = False,
    ) -> None:  # fmt: skip
        self.args = [sys.executable, "-m", "transformer_mt", *args]
        self.returncode: int | None = None
        self._text = text
        self.stdin = self.stdout = self.stderr = None
        theirs = []  # the child's ends: stdin, stdout, stderr
        for number, (name, how) in enumerate(zip(("stdin", "stdout", "stderr"),
                                                 (stdin, stdout, stderr), strict=True)):  # fmt: skip
            if how == subprocess.PIPE:
                read, write = os.pipe()
                child, mine = (read, write) if number == 0 else (write, read)
                mode = ("w" if number == 0 else "r") + ("" if text else "b")
                encoding = {"encoding": _ENCODING} if text else {}
                setattr(self, name, open(mine, mode, **encoding))  # noqa: SIM115 - ours to close
            elif how == subprocess.DEVNULL:
                child = os.open(os.devnull, os.O_RDWR)
            else:  # None: the caller's own
                child = os.dup(number)
            theirs.append(child)
        request = json.dumps({"args": args, "env": env, "cwd": str(Path(cwd).resolve())}).encode()
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._conn.connect(address)
            socket.send_fds(self._conn, [struct.pack("!I", len(request)) + request], theirs)
        finally:
            for fd in theirs:
                os.close(fd)
        replies = self._conn.makefile("rb")
        self.pid = int(replies.readline())
        self._ended = threading.Event()
        threading.Thread(target=self._await_status, args=(replies,), daemon=True).start()
        self._outputs: dict[str, list] | None = None

    def _await_status(self, replies: Any) -> None:
        self.returncode = int(replies.readline())
        self._conn.close()
        self._ended.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, number: int) -> None:
        if self.returncode is None:  # else the pid may be another process's by now
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, number)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(
        self, input: str | bytes | None = None, timeout: float | None = None
    ) -> tuple[Any, Any]:
        """Write `input`, close stdin, read stdout and stderr to their ends, wait (as Popen's)."""
        if self._outputs is None:
            self._outputs = {"stdout": [], "stderr": []}
            self._threads = [threading.Thread(target=_feed, args=(self.stdin, input), daemon=True)]
            for name in ("stdout", "stderr"):
                stream = getattr(self, name)
                if stream is not None:
                    self._threads.append(threading.Thread(
                        target=_drain, args=(stream, self._outputs[name]), daemon=True))  # fmt: skip
            for thread in self._threads:
                thread.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in self._threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        empty = "" if self._text else b""
        return tuple(None if getattr(self, name) is None else empty.join(self._outputs[name])
                     for name in ("stdout", "stderr"))  # fmt: skip


_ENCODING = locale.getpreferredencoding(False)  # what subprocess's text mode uses


def _drain(stream: Any, chunks: list) -> None:
    with stream:
        while chunk := stream.read(1 << 16):
            chunks.append(chunk)


def _feed(stream: Any, data: str | bytes | None) -> None:
    if stream is None:
        return
    # The command may stop reading (subprocess allows it).
    with contextlib.suppress(BrokenPipeError), stream:
        if data:
            stream.write(data)


# --- the server's side ----------------------------------------------------------------------


def serve(address: str, parent: int) -> None:
    """Import torch and every tmt module, then fork a child per request until the caller ends."""
    import importlib
    import pkgutil

    sys.path[0] = str(REPO)  # as `python -m transformer_mt` run from the repository sees it
    from transformer_mt.common.allocator import keep_freed_memory

    keep_freed_memory()  # what `tmt` does first; the children inherit it
    import transformer_mt

    for module in pkgutil.walk_packages(transformer_mt.__path__, "transformer_mt."):
        if not module.name.endswith("__main__"):
            importlib.import_module(module.name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(64)
    listener.settimeout(1.0)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the monitors
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while os.getppid() == parent:  # the tests' process is gone: so is the server
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        conn.settimeout(None)
        request, fds = _receive(conn)
        if os.fork() == 0:
            listener.close()
            _monitor(conn, request, fds)
        conn.close()
        for fd in fds:
            os.close(fd)


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    size = struct.unpack("!I", data[:4])[0]
    data = data[4:]
    while len(data) < size:
        data += conn.recv(size - len(data))
    return json.loads(data), fds


def _monitor(conn: socket.socket, request: dict, fds: list[int]) -> None:
    """Fork the command's child, tell the caller its pid, wait, tell its exit status; kill the
    child if the caller goes first (as the tests' process, killed, takes no command with it)."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    pid = os.fork()
    if pid == 0:
        conn.close()
        _command(request, fds)
    for fd in fds:
        os.close(fd)
    conn.sendall(f"{pid}\n".encode())
    ended = os.pidfd_open(pid)
    readable, _, _ = select.select([ended, conn], [], [])
    if ended not in readable:  # the caller has gone (it never writes): so does its command
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
    os._exit(0)


def _command(request: dict, fds: list[int]) -> None:
    """Become `python -m transformer_mt ARGS` run with the request's streams, env and cwd."""
    import atexit as exits
    import io
    import random
    import traceback

    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.dont_write_bytecode = bool(os.environ.get("PYTHONDONTWRITEBYTECODE"))
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r")))
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(
        io.BufferedWriter(io.FileIO(1, "w")), write_through=unbuffered
    )
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(
        io.BufferedWriter(io.FileIO(2, "w")), errors="backslashreplace", write_through=True
    )
    import faulthandler  # on as the interpreter turns it on at start, or off

    if os.environ.get("PYTHONFAULTHANDLER"):
        faulthandler.enable(all_threads=True)
    else:
        faulthandler.disable()
    sys.argv = [str(REPO / "transformer_mt" / "__main__.py"), *request["args"]]
    if _THREADS in os.environ:
        import torch

        torch.set_num_threads(int(os.environ[_THREADS]))
    random.seed()  # a started interpreter's state is its own
    code: int = 0
    try:
        from transformer_mt.cli import main

        main()
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException as error:  # as the interpreter reports an uncaught exception
        traceback.print_exc()
        code = -signal.SIGINT if isinstance(error, KeyboardInterrupt) else 1
    exits._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    if code == -signal.SIGINT:  # the interpreter ends an uncaught ^C by the signal itself
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]))
