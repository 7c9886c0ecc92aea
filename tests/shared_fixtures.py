"""Expensive session fixtures built once for all pytest-xdist workers, not once per worker.

Each worker of `make test` is a process with its own session, so a session fixture that trains a
model (multi30k_run, marian_dirs: about 40 s each on one core) was trained by every worker. Here
the first worker that needs one builds it into the directory all workers share (the session's
basetemp, whose popen-gwN subdirectories are the workers'), under a file lock; the others wait
for it, and reuse it. A worker that would only wait builds meanwhile another such fixture that
its session needs and no one is building (both workers start by needing multi30k_run: one trains
it while the other makes marian_dirs). Without xdist, nothing is shared and nothing waits.

A shared directory is read-only by convention: a test that changes a file in it would change it
for tests on the other worker at a moment neither controls, so each worker checks, when its session
ends, that every file is as built (tests that write beside a model copy it first).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

BUILT = ".built.json"  # written last, with the listing the end-of-session check compares against


def shared(request: pytest.FixtureRequest, name: str, build: Callable[[Path], None]) -> Path:
    """The directory `build(directory)` fills, built once across the session's workers."""
    root = _root(request)
    target = once(root, name, build, meanwhile=lambda: _help(request, root, name))
    listing = json.loads((target / BUILT).read_text())
    request.addfinalizer(lambda: unchanged(target, listing))
    return target


def once(
    root: Path,
    name: str,
    build: Callable[[Path], None],
    meanwhile: Callable[[], None] = lambda: None,
) -> Path:
    """root/name as `build` made it: built here unless another process built it or is building
    it (then `meanwhile` runs before this one waits for it)."""
    target = root / name
    with _lock(root, name, wait=False) as held:
        if held:
            _build(target, build)
    if not held:
        meanwhile()
        with _lock(root, name, wait=True):
            _build(target, build)  # a no-op unless its builder failed: then this one tries
    return target


# Fixtures a waiting worker may build meanwhile, by name (conftest.py registers them), in this
# order; one that needs another builds it first through `once`.
HELPERS: dict[str, Callable[[Path], None]] = {}


def _help(request: pytest.FixtureRequest, root: Path, waiting_for: str) -> None:
    """Builds, while `waiting_for` (a helper itself: a long build) is being built elsewhere, the
    helpers this session needs that no one has built or is building."""
    if waiting_for not in HELPERS:
        return  # a small fixture: waiting is shorter than any helper
    needed = {name for item in request.session.items for name in getattr(item, "fixturenames", ())}
    for name, build in HELPERS.items():
        if name == waiting_for or name not in needed or (root / name / BUILT).exists():
            continue
        with _lock(root, name, wait=False) as held:
            if held:
                _build(root / name, build)
        with _lock(root, waiting_for, wait=False) as free:
            if free:
                return  # built meanwhile: no need to help further


def _root(request: pytest.FixtureRequest) -> Path:
    base = request.config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined]
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextmanager
def _lock(root: Path, name: str, *, wait: bool) -> Iterator[bool]:
    with open(root / f"{name}.lock", "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build(target: Path, build: Callable[[Path], None]) -> None:
    if (target / BUILT).exists():
        return
    if target.exists():
        shutil.rmtree(target)  # what a builder that failed half way left
    target.mkdir(parents=True)
    build(target)
    (target / BUILT).write_text(json.dumps(_listing(target)))


def _engine_cache(relative: str) -> bool:
    parts = Path(relative).parts
    return parts[-1] == ".ctranslate2.lock" or any(p.startswith("ctranslate2-") for p in parts)


def _listing(target: Path) -> dict[str, str]:
    return {
        str(path.relative_to(target)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(target.rglob("*"))
        if path.is_file() and path.name != BUILT
    }


def unchanged(target: Path, listing: dict[str, str]) -> None:
    """Fails the test whose teardown this is when a file of `target` differs from `listing`."""
    # tmt's CTranslate2 engine converts a checkpoint on first use into a directory beside it,
    # under its own lock (tests/test_engine.py): a cache any process may add, not a change.
    now = {k: v for k, v in _listing(target).items() if k in listing or not _engine_cache(k)}
    changed = sorted(set(now) ^ set(listing) | {k for k in now.keys() & listing.keys()
                                                if now[k] != listing[k]})  # fmt: skip
    if changed:
        pytest.fail(f"a test changed the shared fixture {target}: {', '.join(changed[:10])}")
