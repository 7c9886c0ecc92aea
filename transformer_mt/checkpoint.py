"""Checkpoints: self-contained, written atomically, verified when read, never unpickled unsafely.

A run directory holds:

    config.yaml, tokenizer.model, metrics.jsonl
    checkpoints/step_00001000/
        model.pt        weights, resolved config, tokenizer: all that translating needs
        train_state.pt  optimizer, schedule, scaler, RNG state of every rank, data position
        manifest.json   written last: SHA-256 of each file, step, format version
    checkpoints/best -> step_00000500   the best checkpoint by the validation metric

A checkpoint is written into a hidden staging directory beside its final name (each file fsynced,
the manifest last), then renamed into place and the parent directory fsynced: a kill at any moment
leaves either the complete checkpoint or none under the final name. Every read checks the
manifest's hashes, and tensors are loaded with torch.load(weights_only=True) only.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import pickle
import random
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from transformer_mt import __version__, faults
from transformer_mt.config import Config, TmtError, config_from_dict, config_hash, to_dict

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
_MIN_TORCH = "2.10"  # weights_only bypasses before: CVE-2025-32434 (< 2.6), CVE-2026-24747 (< 2.10)
MODEL_FILE, STATE_FILE, MANIFEST_FILE = "model.pt", "train_state.pt", "manifest.json"
_PREFIX = "step_"


@dataclass(frozen=True)
class ModelCheckpoint:
    """What model.pt holds: enough to rebuild the model and translate raw text."""

    path: Path
    step: int
    config: Config
    state_dict: dict[str, torch.Tensor]
    tokenizer_bytes: bytes


# --- writing -----------------------------------------------------------------------------------


def save(run_dir: Path, step: int, *args: Any, **kwargs: Any) -> Path:
    """Write checkpoints/step_{step} of a run atomically (the rest of `write`'s arguments)."""
    return write(run_dir / "checkpoints" / f"{_PREFIX}{step:08d}", step, *args, **kwargs)


def write(
    final: Path,
    step: int,
    cfg: Config,
    state_dict: dict[str, torch.Tensor],
    tokenizer_bytes: bytes,
    train_state: dict[str, Any] | None = None,
    info: dict[str, Any] | None = None,
) -> Path:
    """Write a checkpoint directory at `final` atomically (model-only without train_state)."""
    bad = _non_finite(state_dict) + _non_finite(train_state or {})
    if bad:
        raise TmtError(f"refusing to save {final}: non-finite values in {', '.join(bad[:5])}")
    root, name = final.parent, final.name
    root.mkdir(parents=True, exist_ok=True)
    staging = root / f".tmp-{name}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        return _write_staged(
            staging, final, step, cfg, state_dict, tokenizer_bytes, train_state, info
        )
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # a failed save leaves nothing behind
        raise


def _write_staged(
    staging: Path,
    final: Path,
    step: int,
    cfg: Config,
    state_dict: dict[str, torch.Tensor],
    tokenizer_bytes: bytes,
    train_state: dict[str, Any] | None,
    info: dict[str, Any] | None,
) -> Path:
    root, name = final.parent, final.name
    written = [0]
    model_payload = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "config": to_dict(cfg),
        "tokenizer": tokenizer_bytes,
        "model": state_dict,
    }
    files = {MODEL_FILE: _write_torch(staging / MODEL_FILE, model_payload, written, step)}
    if train_state is not None:
        files[STATE_FILE] = _write_torch(staging / STATE_FILE, train_state, written, step)
    manifest = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "files": files,
        "config_sha256": config_hash(cfg),
        "tokenizer_sha256": hashlib.sha256(tokenizer_bytes).hexdigest(),
        "tmt_version": __version__,
        "torch_version": torch.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **(info or {}),
    }
    # The manifest is the commit marker: written last, after every file it vouches for.
    _write_file(staging / MANIFEST_FILE, json.dumps(manifest, indent=1).encode())
    _fsync_dir(staging)
    previous = None
    if final.exists():  # saved again at the same step (e.g. the final save): swap, drop the old
        previous = root / f".old-{name}-{os.getpid()}"
        os.rename(final, previous)
    os.rename(staging, final)
    _fsync_dir(root)
    if previous is not None:
        shutil.rmtree(previous, ignore_errors=True)
    return final


def remove_leftovers(run_dir: Path) -> None:
    """Staging directories of saves that were interrupted (they never carry a final name)."""
    root = run_dir / "checkpoints"
    if root.is_dir():
        for path in (
            list(root.glob(".tmp-*")) + list(root.glob(".old-*")) + list(root.glob(".best-*"))
        ):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


def set_best(run_dir: Path, path: Path) -> None:
    """Point checkpoints/best at `path` (a relative symlink, swapped atomically)."""
    link = run_dir / "checkpoints" / "best"
    if link.is_dir() and not link.is_symlink():  # a copy of the run turned the link into a copy
        shutil.rmtree(link)
    tmp = link.with_name(f".best-{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    os.symlink(path.name, tmp)
    os.replace(tmp, link)
    _fsync_dir(link.parent)


def best(run_dir: Path) -> Path | None:
    link = run_dir / "checkpoints" / "best"
    if not link.is_symlink():
        return None
    target = link.parent / os.readlink(link)
    return target if target.is_dir() else None


def prune(
    run_dir: Path, keep_last: int, protect: set[Path] | frozenset[Path] = frozenset()
) -> None:
    """Delete all but the newest `keep_last` checkpoints; never the best or a protected one (the
    trainer protects the one it just wrote, the newest valid, and the one it resumed from)."""
    checkpoints = list_checkpoints(run_dir)
    keep = set(checkpoints[-keep_last:] if keep_last > 0 else []) | set(protect)
    keep |= {best(run_dir)} - {None}
    keep = {p.resolve() for p in keep}
    for path in checkpoints:
        if path.resolve() not in keep:
            shutil.rmtree(path, ignore_errors=True)


# --- reading -----------------------------------------------------------------------------------


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoint directories of a run, oldest step first (complete or not)."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    found = [
        p
        for p in root.iterdir()
        if p.is_dir() and p.name.startswith(_PREFIX) and p.name[len(_PREFIX) :].isdigit()
    ]
    return sorted(found, key=lambda p: int(p.name[len(_PREFIX) :]))


def verify(path: Path) -> str | None:
    """None if `path` is a complete, uncorrupted checkpoint, else the reason it is not: every
    file matches its hash, and model.pt loads and agrees with the manifest."""
    try:
        manifest = read_manifest(path)
        load_model(path)
        for name, digest in manifest["files"].items():
            if name != MODEL_FILE and _sha256_file(path / name) != digest:
                return f"{path / name}: does not match its manifest hash (corrupted or truncated)"
    except TmtError as err:
        return str(err)
    except OSError as err:
        return f"cannot read: {err.strerror or err}"
    return None


def latest_valid(run_dir: Path) -> Path | None:
    """The newest checkpoint that verifies; newer broken ones are reported and skipped."""
    for path in reversed(list_checkpoints(run_dir)):
        problem = verify(path)
        if problem is None:
            return path
        logger.warning("skipping checkpoint %s: %s", path, problem)
    return None


def read_manifest(path: Path) -> dict[str, Any]:
    file = path / MANIFEST_FILE
    try:
        manifest = json.loads(file.read_bytes())
    except FileNotFoundError:
        raise TmtError(f"{path}: not a complete checkpoint (no {MANIFEST_FILE})") from None
    except (OSError, ValueError) as err:
        raise TmtError(f"{file}: unreadable manifest ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
        found = manifest.get("format_version") if isinstance(manifest, dict) else None
        raise TmtError(
            f"{path}: checkpoint format version {found}, this tmt reads {FORMAT_VERSION}"
        )
    return manifest


def resolve(path: Path) -> Path:
    """A checkpoint directory as given; for a run directory its best checkpoint, else its newest."""
    if (path / MANIFEST_FILE).is_file():
        return path
    if (path / "checkpoints").is_dir():
        best_path = best(path)
        if best_path is not None and verify(best_path) is None:
            return best_path
        latest = latest_valid(path)
        if latest is not None:
            return latest
        raise TmtError(f"{path}: the run has no complete checkpoint")
    raise TmtError(
        f"{path}: not a checkpoint (no {MANIFEST_FILE}) nor a run directory (no checkpoints/)"
    )


def last_checkpoints(run_dir: Path, n: int, allow_fewer: bool = False) -> list[Path]:
    """The newest `n` complete checkpoints of a run, oldest first (the paper averages the last 5
    or 20); broken ones are reported and skipped. With allow_fewer, as many as there are (≥ 1)."""
    if not (run_dir / "checkpoints").is_dir():
        raise TmtError(f"{run_dir}: not a run directory (no checkpoints/)")
    valid: list[Path] = []
    for path in reversed(list_checkpoints(run_dir)):
        problem = verify(path)
        if problem is None:
            valid.append(path)
        else:
            logger.warning("skipping checkpoint %s: %s", path, problem)
        if len(valid) == n:
            return valid[::-1]
    if allow_fewer and valid:
        return valid[::-1]
    raise TmtError(f"{run_dir}: {len(valid)} complete checkpoints, {n} asked for")


def average(paths: Sequence[Path]) -> ModelCheckpoint:
    """The element-wise mean of the checkpoints' weights, with the newest one's config and step.

    Sums are accumulated in float64 and cast back, so N copies of one checkpoint average back to
    it bitwise. All must share the architecture and the tokenizer.
    """
    if not paths:
        raise TmtError("no checkpoints to average")
    first = load_model(paths[0])
    sums = {k: v.to(torch.float64) for k, v in first.state_dict.items()}
    newest = first
    for path in paths[1:]:
        other = load_model(path)
        _check_same_model(first, other)
        for key, value in other.state_dict.items():
            sums[key] += value.to(torch.float64)
        newest = other if other.step >= newest.step else newest
    mean = {k: (v / len(paths)).to(first.state_dict[k].dtype) for k, v in sums.items()}
    return ModelCheckpoint(newest.path, newest.step, newest.config, mean, first.tokenizer_bytes)


def write_average(paths: Sequence[Path], output: Path) -> Path:
    """Average `paths` into a self-contained model directory at `output` (written atomically)."""
    if output.exists() and not (output / MANIFEST_FILE).is_file():
        if output.is_file() or any(output.iterdir()):
            raise TmtError(f"{output}: exists and is not a checkpoint; choose another output")
        output.rmdir()
    mean = average(paths)
    info = {"averaged": [str(p) for p in paths]}
    return write(output, mean.step, mean.config, mean.state_dict, mean.tokenizer_bytes, info=info)


def _check_same_model(a: ModelCheckpoint, b: ModelCheckpoint) -> None:
    old, new = to_dict(a.config), to_dict(b.config)
    differ = [f"{s}.{k}" for s in ("model", "tokenizer") for k in old[s] if old[s][k] != new[s][k]]
    if a.tokenizer_bytes != b.tokenizer_bytes:
        differ.append("the tokenizer model")
    if not differ and set(a.state_dict) != set(b.state_dict):
        differ.append("the parameter names")
    if differ:
        raise TmtError(f"cannot average {a.path} with {b.path}: {', '.join(differ)} differ")


def load_model(path: str | Path) -> ModelCheckpoint:
    """Read and verify model.pt of a checkpoint directory."""
    path = Path(path)
    payload = _load_verified(path, MODEL_FILE)
    try:
        cfg = config_from_dict(payload["config"], origin=f"{path / MODEL_FILE} config")
        step, weights, spm = int(payload["step"]), payload["model"], bytes(payload["tokenizer"])
    except (KeyError, TypeError, ValueError) as err:
        raise TmtError(f"{path / MODEL_FILE}: malformed checkpoint ({err})") from None
    manifest = read_manifest(path)
    # The config as stored (a newer tmt fills in keys added since; the hash is of what was saved).
    stored = json.dumps(payload["config"], sort_keys=True).encode()
    found = {
        "step": step,
        "config_sha256": hashlib.sha256(stored).hexdigest(),
        "tokenizer_sha256": hashlib.sha256(spm).hexdigest(),
    }
    differ = [key for key, value in found.items() if manifest.get(key) != value]
    if differ:
        raise TmtError(f"{path}: manifest does not match {MODEL_FILE} ({', '.join(differ)} differ)")
    return ModelCheckpoint(path, step, cfg, weights, spm)


def load_train_state(path: Path) -> dict[str, Any]:
    return _load_verified(path, STATE_FILE)


def _load_verified(path: Path, name: str) -> dict[str, Any]:
    if torch.__version__ < _MIN_TORCH:
        raise TmtError(
            f"torch {torch.__version__}: checkpoints are read with torch >= {_MIN_TORCH} only"
        )
    manifest = read_manifest(path)
    if name not in manifest["files"]:
        raise TmtError(f"{path}: checkpoint has no {name}")
    try:
        data = (path / name).read_bytes()
    except OSError as err:
        raise TmtError(f"{path / name}: cannot read: {err.strerror or err}") from None
    if hashlib.sha256(data).hexdigest() != manifest["files"][name]:
        raise TmtError(f"{path / name}: does not match its manifest hash (corrupted or truncated)")
    try:
        # weights_only: tensors and plain containers only; a pickled object or callable is refused.
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        reason = str(err).splitlines()[0][:200]
        raise TmtError(
            f"{path / name}: refused: holds more than tensors and plain values ({reason})"
        ) from None
    except (RuntimeError, EOFError, ValueError) as err:
        raise TmtError(f"{path / name}: unreadable ({str(err).splitlines()[0]})") from None


# --- RNG state as tensors and primitives (loadable with weights_only) ----------------------------


def capture_rng() -> dict[str, Any]:
    """This process's Python, NumPy, torch and CUDA generator states."""
    py_version, py_state, py_gauss = random.getstate()
    _, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    return {
        "python_version": py_version,
        "python_state": torch.tensor(py_state, dtype=torch.int64),
        "python_gauss": py_gauss,
        "numpy_keys": torch.from_numpy(np_keys.astype(np.int64)),
        "numpy_pos": int(np_pos),
        "numpy_has_gauss": int(np_has_gauss),
        "numpy_gauss": float(np_gauss),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(
        (state["python_version"], tuple(state["python_state"].tolist()), state["python_gauss"])
    )
    keys = state["numpy_keys"].numpy().astype(np.uint32)
    np.random.set_state(
        ("MT19937", keys, state["numpy_pos"], state["numpy_has_gauss"], state["numpy_gauss"])
    )
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _non_finite(tree: Any, prefix: str = "") -> list[str]:
    """Names of floating-point tensors in a nested dict/list that hold NaN or infinity."""
    if isinstance(tree, torch.Tensor):
        finite = not tree.is_floating_point() or bool(torch.isfinite(tree).all())
        return [] if finite else [prefix or "tensor"]
    if isinstance(tree, dict):
        return [
            n
            for k, v in tree.items()
            for n in _non_finite(v, f"{prefix}.{k}" if prefix else str(k))
        ]
    if isinstance(tree, list | tuple):
        return [n for i, v in enumerate(tree) for n in _non_finite(v, f"{prefix}[{i}]")]
    return []


# --- files -------------------------------------------------------------------------------------


class _HashingWriter:
    """A write-only file wrapper that hashes what passes through (torch.save streams into it).

    It also counts the bytes of the whole checkpoint, where TMT_FAULT's "save{STEP}_bytes@N"
    points fire (e.g. save8_bytes@5000: checkpoint 8, after 5,000 bytes)."""

    def __init__(self, handle: BinaryIO, written: list[int], point: str) -> None:
        self.handle = handle
        self.digest = hashlib.sha256()
        self.written = written  # bytes of this checkpoint so far, shared by its files
        self.point = point
        self.faults = [n for n in faults.planned(point) if n >= written[0]]
        self.error: BaseException | None = None  # torch.save hides a writer's error behind its own

    def write(self, data: bytes) -> int:
        self.digest.update(data)
        try:
            count = self.handle.write(data)
        except BaseException as err:
            self.error = err
            raise
        self.written[0] += len(data)
        while self.faults and self.written[0] >= self.faults[0]:
            self.handle.flush()  # what a crash would leave on disk
            try:
                faults.fault_point(self.point, self.faults.pop(0))
            except BaseException as err:
                self.error = err
                raise
        return count

    def flush(self) -> None:
        self.handle.flush()


def _write_torch(path: Path, payload: Any, written: list[int], step: int) -> str:
    with open(path, "wb") as handle:
        writer = _HashingWriter(handle, written, f"save{step}_bytes")
        try:
            torch.save(payload, writer)
        except Exception as err:
            # torch.save reports a failed write as "[enforce fail at inline_container.cc] unexpected
            # pos"; the writer's own error (ENOSPC, EFBIG, ...) says what happened.
            raise (writer.error or err) from None
        handle.flush()
        os.fsync(handle.fileno())
    return writer.digest.hexdigest()


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
