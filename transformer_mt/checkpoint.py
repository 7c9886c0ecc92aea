"""The format of one checkpoint: write it atomically, read it (which verifies it), average several.

A checkpoint is a directory:

    model.pt        weights, resolved config, tokenizer: all that translating needs
    train_state.pt  optimizer, schedule, scaler, RNG state of every rank, data position (training
                    checkpoints only; an averaged model has none)
    manifest.json   written last: SHA-256 of each file, step, format version, config and tokenizer
                    hashes

It is written into a hidden staging directory beside its final name (each file fsynced, the
manifest last), then renamed into place and the parent directory fsynced: a kill at any moment
leaves either the complete checkpoint or none under the final name. Reading is verifying: each file
is read once, its bytes hashed against the manifest and only then given to
torch.load(weights_only=True), so a checkpoint that reads is a checkpoint that verifies, and no
command reads a file twice. Where checkpoints live in a run directory is run.py's business.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging
import os
import pickle
import random
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from transformer_mt import __version__, faults, files
from transformer_mt.config import (
    MODEL_SECTIONS,
    Config,
    changed_keys,
    config_from_dict,
    config_hash,
    to_dict,
)
from transformer_mt.exits import TmtError
from transformer_mt.model import Transformer
from transformer_mt.tokenizer import Tokenizer

FORMAT_VERSION = 1
_MIN_TORCH = "2.10"  # weights_only bypasses before: CVE-2025-32434 (< 2.6), CVE-2026-24747 (< 2.10)
MODEL_FILE, STATE_FILE, MANIFEST_FILE = "model.pt", "train_state.pt", "manifest.json"

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint as read: model.pt's content, and train_state.pt's when it was asked for."""

    path: Path
    step: int
    config: Config
    state_dict: dict[str, torch.Tensor]
    tokenizer_bytes: bytes
    train_state: dict[str, Any] | None = None
    sources: tuple[str, ...] = ()  # an averaged model: the checkpoints it averages, oldest first

    def tokenizer(self) -> Tokenizer:
        return Tokenizer(self.tokenizer_bytes, origin=f"{self.path} tokenizer")


# --- writing -----------------------------------------------------------------------------------


def write(
    final: Path,
    step: int,
    cfg: Config,
    state_dict: dict[str, torch.Tensor],
    tokenizer_bytes: bytes,
    train_state: dict[str, Any] | None = None,
    info: dict[str, Any] | None = None,
) -> Path:
    """Write a checkpoint directory at `final` atomically (model-only without train_state);
    `info` adds fields to the manifest."""
    bad = _non_finite(state_dict) + _non_finite(train_state or {})
    if bad:
        raise TmtError(f"refusing to save {final}: non-finite values in {', '.join(bad[:5])}")
    root, name = final.parent, final.name
    root.mkdir(parents=True, exist_ok=True)
    staging = root / f".tmp-{name}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        digests = _write_files(staging, step, cfg, state_dict, tokenizer_bytes, train_state)
        manifest = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "files": digests,
            "config_sha256": config_hash(cfg),
            "tokenizer_sha256": hashlib.sha256(tokenizer_bytes).hexdigest(),
            "tmt_version": __version__,
            "torch_version": torch.__version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **(info or {}),
        }
        # The manifest is the commit marker: written last, after every file it vouches for.
        files.atomic_write(staging / MANIFEST_FILE, json.dumps(manifest, indent=1).encode())
        _swap_into_place(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # a failed save leaves nothing behind
        raise
    return final


def _write_files(
    staging: Path,
    step: int,
    cfg: Config,
    state_dict: dict[str, torch.Tensor],
    tokenizer_bytes: bytes,
    train_state: dict[str, Any] | None,
) -> dict[str, str]:
    """model.pt (and train_state.pt) in `staging`; their SHA-256 by name."""
    written = [0]  # bytes of this checkpoint so far, where TMT_FAULT's save{STEP}_bytes fire
    model_payload = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "config": to_dict(cfg),
        "tokenizer": tokenizer_bytes,
        "model": state_dict,
    }
    digests = {MODEL_FILE: _write_torch(staging / MODEL_FILE, model_payload, written, step)}
    if train_state is not None:
        digests[STATE_FILE] = _write_torch(staging / STATE_FILE, train_state, written, step)
    return digests


def _swap_into_place(staging: Path, final: Path) -> None:
    """Rename the complete staging directory to its final name (replacing a checkpoint saved at
    the same step, e.g. by the final save) and make the rename durable."""
    root, name = final.parent, final.name
    previous = None
    if final.exists():
        previous = root / f".old-{name}-{os.getpid()}"
        os.rename(final, previous)
    os.rename(staging, final)
    files.fsync_dir(root)
    if previous is not None:
        shutil.rmtree(previous, ignore_errors=True)


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
    with files.atomic_file(path) as handle:
        writer = _HashingWriter(handle, written, f"save{step}_bytes")
        try:
            torch.save(payload, writer)
        except Exception as err:
            # torch.save reports a failed write as "[enforce fail at inline_container.cc] unexpected
            # pos"; the writer's own error (ENOSPC, EFBIG, ...) says what happened.
            raise (writer.error or err) from None
    return writer.digest.hexdigest()


# --- reading -----------------------------------------------------------------------------------


def read(path: str | Path, train_state: bool = False) -> Checkpoint:
    """Read model.pt (and train_state.pt) of a checkpoint directory, each file once, verified
    against the manifest before it is unpickled (tensors and plain values only)."""
    path = Path(path)
    manifest = read_manifest(path)
    payload = _load_verified(path, MODEL_FILE, manifest)
    try:
        cfg = config_from_dict(payload["config"], origin=f"{path / MODEL_FILE} config")
        step, weights, spm = int(payload["step"]), payload["model"], bytes(payload["tokenizer"])
        # The config as stored: a newer tmt fills in keys added since; the hash is of the stored.
        stored = json.dumps(payload["config"], sort_keys=True).encode()
    except (KeyError, TypeError, ValueError) as err:
        raise TmtError(f"{path / MODEL_FILE}: malformed checkpoint ({err})") from None
    found = {
        "step": step,
        "config_sha256": hashlib.sha256(stored).hexdigest(),
        "tokenizer_sha256": hashlib.sha256(spm).hexdigest(),
    }
    differ = [key for key, value in found.items() if manifest.get(key) != value]
    if differ:
        raise TmtError(f"{path}: manifest does not match {MODEL_FILE} ({', '.join(differ)} differ)")
    state = _load_verified(path, STATE_FILE, manifest) if train_state else None
    sources = tuple(str(s) for s in manifest.get("averaged", ()))
    return Checkpoint(path, step, cfg, weights, spm, state, sources)


def verify(path: Path) -> str | None:
    """None if `path` is a complete, uncorrupted checkpoint, else the reason it is not."""
    try:
        manifest = read_manifest(path)
        unexpected = sorted(set(manifest["files"]) - {MODEL_FILE, STATE_FILE})
        if unexpected:
            return f"{path}: manifest lists unexpected files {unexpected}"
        read(path, train_state=STATE_FILE in manifest["files"])
    except TmtError as err:
        return str(err)
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


def _load_verified(path: Path, name: str, manifest: dict[str, Any]) -> dict[str, Any]:
    if torch.__version__ < _MIN_TORCH:
        raise TmtError(
            f"torch {torch.__version__}: checkpoints are read with torch >= {_MIN_TORCH} only"
        )
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


# --- the model of a checkpoint -----------------------------------------------------------------


def model_differences(
    a_cfg: Config, a_tokenizer: bytes, b_cfg: Config, b_tokenizer: bytes
) -> list[str]:
    """What keeps two configs and tokenizers from describing the same model ([] if nothing): the
    one compatibility check of resuming, averaging and translating with overrides."""
    differ = changed_keys(a_cfg, b_cfg, MODEL_SECTIONS)
    if a_tokenizer != b_tokenizer:
        differ.append("the tokenizer model")
    return differ


def load_weights(model: Transformer, state_dict: dict[str, torch.Tensor], origin: Path) -> None:
    """Load weights into `model`, refusing weights of another shape before any compute and naming
    the parameters that differ."""
    expected = model.state_dict()
    differ = [f"{name} unexpected" for name in state_dict if name not in expected]
    for name, tensor in expected.items():
        found = tuple(state_dict[name].shape) if name in state_dict else "missing"
        if found != tuple(tensor.shape):
            differ.append(f"{name} {found} vs {tuple(tensor.shape)}")
    if differ:
        raise TmtError(f"{origin}: weights do not fit this model: {'; '.join(differ[:4])}")
    model.load_state_dict(state_dict)


def build_model(saved: Checkpoint, tokenizer: Tokenizer) -> Transformer:
    """The checkpoint's model (on the CPU, in training mode), with its weights."""
    model = Transformer(saved.config.model, tokenizer.vocab_size, tokenizer.pad_id)
    load_weights(model, saved.state_dict, saved.path)
    return model


# --- averaging (§6.1) --------------------------------------------------------------------------


def average(checkpoints: Iterable[Checkpoint]) -> Checkpoint:
    """The element-wise mean of the checkpoints' weights, with the newest one's config and step.

    Checkpoints are consumed one at a time (an iterator reads each as it comes), so memory holds
    one checkpoint and the sums. Sums are accumulated in float64 and cast back, so N copies of one
    checkpoint average back to it bitwise. All must share the architecture and the tokenizer.
    """
    sums: dict[str, torch.Tensor] = {}
    dtypes: dict[str, torch.dtype] = {}
    first = newest = None  # without their weights: only the config, tokenizer and step are kept
    sources: list[tuple[int, str]] = []
    for saved in checkpoints:
        if first is None:
            first = dataclasses.replace(saved, state_dict={}, train_state=None)
            dtypes = {k: v.dtype for k, v in saved.state_dict.items()}
            sums = {k: v.to(torch.float64) for k, v in saved.state_dict.items()}
        else:
            _check_same_model(first, saved, set(sums))
            for key, value in saved.state_dict.items():
                sums[key] += value.to(torch.float64)
        if newest is None or saved.step >= newest.step:
            newest = dataclasses.replace(saved, state_dict={}, train_state=None)
        sources.append((saved.step, str(saved.path)))
    if first is None or newest is None:
        raise TmtError("no checkpoints to average")
    mean = {k: (v / len(sources)).to(dtypes[k]) for k, v in sums.items()}
    oldest_first = tuple(path for _, path in sorted(sources))
    return dataclasses.replace(newest, state_dict=mean, sources=oldest_first)


def write_average(checkpoints: Iterable[Checkpoint], output: Path) -> Checkpoint:
    """Average `checkpoints` into a self-contained model directory at `output` (written
    atomically); returns the averaged model as written."""
    if output.exists() and not (output / MANIFEST_FILE).is_file():
        if output.is_file() or any(output.iterdir()):
            raise TmtError(f"{output}: exists and is not a checkpoint; choose another output")
        output.rmdir()
    mean = average(checkpoints)
    info = {"averaged": list(mean.sources)}
    write(output, mean.step, mean.config, mean.state_dict, mean.tokenizer_bytes, info=info)
    return dataclasses.replace(mean, path=output)


def _check_same_model(first: Checkpoint, other: Checkpoint, names: set[str]) -> None:
    differ = model_differences(
        first.config, first.tokenizer_bytes, other.config, other.tokenizer_bytes
    )
    if not differ and names != set(other.state_dict):
        differ.append("the parameter names")
    if differ:
        raise TmtError(f"cannot average {first.path} with {other.path}: {', '.join(differ)} differ")


# --- the training state ------------------------------------------------------------------------


def train_state(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    scaler: torch.amp.GradScaler,
    rng: list[dict[str, Any]],
    progress: dict[str, Any],
) -> dict[str, Any]:
    """What train_state.pt holds: Adam's state, the schedule, the fp16 scaler, every rank's RNG
    states (capture_rng, in rank order) and the trainer's progress (plain values)."""
    return {
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict(),
        "rng": rng,
        "progress": progress,
    }


def restore_train_state(
    state: dict[str, Any],
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    scaler: torch.amp.GradScaler,
    rank: int,
    world_size: int,
) -> dict[str, Any]:
    """Load a train_state.pt into the optimizer, schedule and scaler, restore this rank's RNG
    states; returns the saved progress."""
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    scaler.load_state_dict(state["scaler"])
    if len(state["rng"]) == world_size:
        restore_rng(state["rng"][rank])
    else:  # another world size: the data order resumes exactly, the dropout streams cannot
        logger.warning(
            "checkpoint has %d ranks, this run %d: random streams restart",
            len(state["rng"]),
            world_size,
        )
    return state["progress"]


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
