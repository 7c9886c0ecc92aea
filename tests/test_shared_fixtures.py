"""The tests' own sharing of expensive fixtures between xdist workers (tests/shared_fixtures.py):
built once by whichever process comes first, rebuilt after a builder that failed, and a test
that changes a shared file fails."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest
import shared_fixtures


def _count_and_build(into: Path) -> None:
    with open(into.parent / "builds.txt", "a") as builds:
        builds.write("built\n")
    # The build lasts until the other process has found it building (a bounded wait: were the
    # lock not exclusive, both would build and the count below says so).
    deadline = time.monotonic() + 60
    while not list(into.parent.glob("helped*")) and time.monotonic() < deadline:
        time.sleep(0.05)
    (into / "model.bin").write_bytes(b"weights")


def _worker(root: str, helped: str) -> None:
    def meanwhile() -> None:
        Path(helped).write_text("helped while waiting\n")

    target = shared_fixtures.once(Path(root), "model", _count_and_build, meanwhile)
    assert (target / "model.bin").read_bytes() == b"weights"


def test_two_processes_build_a_fixture_once_and_the_waiting_one_helps(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    processes = [ctx.Process(target=_worker, args=(str(tmp_path), str(tmp_path / f"helped{i}")))
                 for i in range(2)]  # fmt: skip
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=120)  # the hang guard of this step: a lock never released
        assert process.exitcode == 0
    assert (tmp_path / "builds.txt").read_text() == "built\n"
    # The other found it building, helped, waited and reused it.
    assert len(list(tmp_path.glob("helped*"))) == 1


def test_a_failed_build_is_removed_and_built_again(tmp_path: Path) -> None:
    def fails(into: Path) -> None:
        (into / "half.bin").write_bytes(b"half")
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError):
        shared_fixtures.once(tmp_path, "model", fails)
    target = shared_fixtures.once(tmp_path, "model", lambda into: (into / "model.bin").touch())
    assert sorted(p.name for p in target.iterdir()) == [shared_fixtures.BUILT, "model.bin"]


def test_a_changed_added_or_removed_file_fails_but_the_engine_cache_does_not(
    tmp_path: Path,
) -> None:
    target = shared_fixtures.once(
        tmp_path, "run", lambda into: (into / "model.pt").write_bytes(b"weights")
    )
    listing = shared_fixtures._listing(target)
    cache = target / "ctranslate2-float32-0123" / "model.bin"
    cache.parent.mkdir()
    cache.write_bytes(b"converted")  # tmt's engine cache, made on first use
    shared_fixtures.unchanged(target, listing)
    (target / "shortlist.npz").write_bytes(b"a test's file")
    with pytest.raises(pytest.fail.Exception, match="shortlist.npz"):
        shared_fixtures.unchanged(target, listing)
    (target / "shortlist.npz").unlink()
    (target / "model.pt").write_bytes(b"retrained")
    with pytest.raises(pytest.fail.Exception, match="model.pt"):
        shared_fixtures.unchanged(target, listing)
    (target / "model.pt").unlink()
    with pytest.raises(pytest.fail.Exception, match="model.pt"):
        shared_fixtures.unchanged(target, listing)
