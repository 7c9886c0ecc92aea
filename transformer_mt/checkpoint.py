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
import errno
import hashlib
import importlib.metadata
import io
import json
import logging
import os
import pickle
import random
import shutil
import stat
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from transformer_mt import exits, faults, files
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
MODEL_FILE, STATE_FILE, MANIFEST_FILE = "model.pt", "train_state.pt", files.MANIFEST_FILE
CHECKPOINTS = files.CHECKPOINTS  # a run keeps its training checkpoints in this directory (run.py)
try:  # the installed package's version, stamped into every manifest (and export report)
    TMT_VERSION = importlib.metadata.version("transformer_mt")
except importlib.metadata.PackageNotFoundError:  # run from a source tree that is not installed
    TMT_VERSION = "unknown"

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
    recover(root, live_writers=True)
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
            "tmt_version": TMT_VERSION,
            "torch_version": torch.__version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **(info or {}),
        }
        # The manifest is the commit marker: written last, after every file it vouches for.
        files.atomic_write(staging / MANIFEST_FILE, json.dumps(manifest, indent=1).encode())
        files.swap_into_place(staging, final)
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


def recover(root: Path, live_writers: bool) -> None:
    """Clean up after saves into `root` that were interrupted: a staging directory is removed; a
    checkpoint renamed aside by a save at the same step (".old-NAME-PID") is put back when NAME is
    missing (the kill came between the two renames), else removed. With live_writers, leftovers
    of processes still running on this host are left alone."""
    for path in [*root.glob(".tmp-*"), *root.glob(".old-*")]:
        name, _, pid = path.name[len(".tmp-") :].rpartition("-")
        if not name or not pid.isdigit() or (live_writers and _running(int(pid))):
            continue
        if path.name.startswith(".old-") and not (root / name).exists():
            os.rename(path, root / name)
        elif path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    files.fsync_dir(root)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


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

_MANIFEST_LIMIT = 1 << 20  # a manifest is a few hundred bytes; a bigger one is not a manifest
_SHA256_HEX = frozenset("0123456789abcdef")


def read(path: str | Path, train_state: bool = False) -> Checkpoint:
    """Read model.pt (and train_state.pt) of a checkpoint directory, each file once, verified
    against the manifest before it is unpickled (tensors and plain values only), then checked
    against the model its own config describes: a checkpoint that reads is one that loads."""
    path = Path(path)
    manifest = read_manifest(path)
    payload = _load_verified(path, MODEL_FILE, manifest)
    where = path / MODEL_FILE
    if not isinstance(payload, dict):
        raise TmtError(f"{where}: malformed checkpoint (holds a {type(payload).__name__})")
    missing = sorted({"config", "model", "step", "tokenizer"} - set(payload))
    if missing:
        raise TmtError(f"{where}: malformed checkpoint (no {', '.join(missing)})")
    cfg = config_from_dict(payload["config"], origin=f"{where} config")
    step, weights, spm = payload["step"], payload["model"], payload["tokenizer"]
    if not isinstance(step, int) or not isinstance(spm, bytes):
        raise TmtError(f"{where}: malformed checkpoint (step or tokenizer of the wrong type)")
    # The config as stored: a newer tmt fills in keys added since; the hash is of the stored.
    stored = json.dumps(payload["config"], sort_keys=True).encode()
    found = {
        "step": step,
        "config_sha256": hashlib.sha256(stored).hexdigest(),
        "tokenizer_sha256": hashlib.sha256(spm).hexdigest(),
    }
    differ = [key for key, value in found.items() if manifest.get(key) != value]
    if differ:
        raise TmtError(f"{path}: manifest does not match {MODEL_FILE} ({', '.join(differ)} differ)")
    parameters = _check_weights(cfg, spm, weights, where)
    state = None
    if train_state:
        state = _load_verified(path, STATE_FILE, manifest)
        _check_train_state(state, parameters, path / STATE_FILE)
    sources = tuple(str(s) for s in manifest.get("averaged", ()) if isinstance(s, str))
    return Checkpoint(path, step, cfg, weights, spm, state, sources)


def verify(path: Path) -> str | None:
    """None if `path` is a complete, uncorrupted checkpoint, else the reason it is not."""
    try:
        read(path, train_state=STATE_FILE in read_manifest(path)["files"])
    except TmtError as err:
        return str(err)
    return None


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of a checkpoint directory, checked: a format version this tmt reads, a step,
    and SHA-256 digests for model.pt (and train_state.pt), no other file."""
    file = path / MANIFEST_FILE
    try:
        manifest = json.loads(_read_plain(file, _MANIFEST_LIMIT))
    except FileNotFoundError:
        raise TmtError(f"{path}: not a complete checkpoint (no {MANIFEST_FILE})") from None
    except (ValueError, RecursionError) as err:
        raise TmtError(f"{file}: unreadable manifest ({str(err)[:200]})") from None
    if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
        found = manifest.get("format_version") if isinstance(manifest, dict) else None
        raise TmtError(
            f"{path}: checkpoint format version {found}, this tmt reads {FORMAT_VERSION}"
        )
    listed = manifest.get("files")
    if not isinstance(listed, dict) or MODEL_FILE not in listed:
        raise TmtError(f"{file}: malformed manifest (no file list with {MODEL_FILE})")
    unexpected = sorted(set(listed) - {MODEL_FILE, STATE_FILE})
    if unexpected:
        raise TmtError(f"{file}: malformed manifest (lists files it may not name: {unexpected})")
    for digest in listed.values():
        if not (isinstance(digest, str) and len(digest) == 64 and set(digest) <= _SHA256_HEX):
            raise TmtError(f"{file}: malformed manifest (a file digest is not a SHA-256)")
    return manifest


def _read_plain(path: Path, limit: int | None = None) -> bytes:
    """The bytes of the plain file at `path`, refusing anything else without waiting: a symbolic
    link, a FIFO or a device (a naive read of one hangs, or never ends)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise
    except OSError as err:
        what = "a symbolic link" if err.errno == errno.ELOOP else (err.strerror or str(err))
        raise TmtError(f"{path}: cannot read: {what}; checkpoint files are plain files") from None
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise TmtError(f"{path}: not a plain file; checkpoint files are plain files")
        if limit is not None and info.st_size > limit:
            raise TmtError(f"{path}: {info.st_size} bytes, larger than it can be ({limit})")
        try:
            return handle.read()
        except OSError as err:
            raise TmtError(f"{path}: cannot read: {err.strerror or err}") from None


def _load_verified(path: Path, name: str, manifest: dict[str, Any]) -> Any:
    if torch.__version__ < _MIN_TORCH:
        raise TmtError(
            f"torch {torch.__version__}: checkpoints are read with torch >= {_MIN_TORCH} only"
        )
    if name not in manifest["files"]:
        raise TmtError(f"{path}: checkpoint has no {name}")
    try:
        data = _read_plain(path / name)
    except FileNotFoundError:
        raise TmtError(f"{path / name}: cannot read: no such file") from None
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


def _check_weights(cfg: Config, spm: bytes, weights: Any, where: Path) -> list[torch.nn.Parameter]:
    """Refuse weights that are not the tensors of the model `cfg` describes (names, shapes,
    floating point); returns that model's parameters (shapes only: built on the meta device)."""
    tokenizer = Tokenizer(spm, origin=f"{where} tokenizer")
    with torch.device("meta"):
        expected = Transformer(cfg.model, tokenizer.vocab_size, tokenizer.pad_id)
    if not isinstance(weights, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in weights.items()
    ):
        raise TmtError(f"{where}: malformed checkpoint (the weights are not named tensors)")
    shapes = {name: tuple(t.shape) for name, t in expected.state_dict().items()}
    differ = [f"{n} unexpected" for n in weights if n not in shapes]
    for name, shape in shapes.items():
        found = tuple(weights[name].shape) if name in weights else "missing"
        if found != shape or (name in weights and not weights[name].is_floating_point()):
            differ.append(f"{name} {found} vs {shape}")
    if differ:
        raise TmtError(f"{where}: weights do not fit its config's model: {'; '.join(differ[:4])}")
    return list(expected.parameters())


def _check_train_state(state: Any, parameters: list[torch.nn.Parameter], where: Path) -> None:
    """Refuse a training state that could not be restored into the model's optimizer."""

    def bad(what: str) -> TmtError:
        return TmtError(f"{where}: malformed training state ({what})")

    kinds = {"optimizer": dict, "scheduler": dict, "scaler": dict, "rng": list, "progress": dict}
    if not isinstance(state, dict):
        raise bad(f"holds a {type(state).__name__}")
    for key, kind in kinds.items():
        if not isinstance(state.get(key), kind):
            raise bad(f"{key}: expected a {kind.__name__}")
    groups, per_param = state["optimizer"].get("param_groups"), state["optimizer"].get("state")
    if not isinstance(groups, list) or not isinstance(per_param, dict):
        raise bad("optimizer: no param_groups or state")
    indices = [i for g in groups if isinstance(g, dict) for i in g.get("params", [None])]
    if sorted(map(str, indices)) != sorted(str(i) for i in range(len(parameters))):
        raise bad(f"optimizer: {len(indices)} parameters, the model has {len(parameters)}")
    for index, moments in per_param.items():
        if not isinstance(moments, dict) or index not in range(len(parameters)):
            raise bad(f"optimizer state of parameter {index!r}")
        for name in ("exp_avg", "exp_avg_sq"):
            value = moments.get(name)
            if value is not None and getattr(value, "shape", None) != parameters[index].shape:
                raise bad(f"optimizer {name} of parameter {index} has the wrong shape")
    if not all(isinstance(r, dict) for r in state["rng"] + state.get("metrics", [])):
        raise bad("rng or metrics: expected one mapping per rank")
    if not all(isinstance(k, str) for k in state["progress"]):
        raise bad("progress: expected named values")


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
    _check_average_output(output)
    mean = average(checkpoints)
    info = {"averaged": list(mean.sources)}
    try:
        write(output, mean.step, mean.config, mean.state_dict, mean.tokenizer_bytes, info=info)
    except (OSError, RuntimeError) as err:  # disk full, quota, I/O (torch: RuntimeError)
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise TmtError(
            f"{output}: writing the averaged model failed ({reason.splitlines()[0]});"
            " nothing was left there",
            exit_code=exits.NO_ROOM,
        ) from None
    return dataclasses.replace(mean, path=output)


def _check_average_output(output: Path) -> None:
    """An average may replace an averaged model, never a training checkpoint (its training state
    would be lost) nor a file or directory that is not a model."""
    if output.parent.name == CHECKPOINTS:
        raise TmtError(
            f"{output}: inside a run's {CHECKPOINTS}/ directory, where it would be taken for a"
            " training checkpoint; choose another output"
        )
    if not output.exists() and not output.is_symlink():
        return
    if output.is_symlink() or not output.is_dir():
        raise TmtError(f"{output}: exists and is not a model directory; choose another output")
    if (output / MANIFEST_FILE).exists():
        try:
            listed = read_manifest(output)["files"]
        except TmtError:
            listed = {STATE_FILE: "unreadable"}
        if STATE_FILE in listed:
            raise TmtError(
                f"{output}: a training checkpoint; averaging into it would destroy its training"
                " state; choose another output"
            )
    elif any(output.iterdir()):
        raise TmtError(f"{output}: exists and is not a checkpoint; choose another output")


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
    ranks: list[dict[str, Any]],
    progress: dict[str, Any],
) -> dict[str, Any]:
    """What train_state.pt holds: Adam's state, the schedule, the fp16 scaler, the trainer's
    progress (plain values), and per rank (in rank order) its RNG states (capture_rng) and its
    metrics since the last record."""
    return {
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict(),
        "rng": [r["rng"] for r in ranks],
        "metrics": [r["metrics"] for r in ranks],
        "progress": progress,
    }


def restore_train_state(
    saved: Checkpoint,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    scaler: torch.amp.GradScaler,
    rank: int,
    world_size: int,
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Load a checkpoint's train_state.pt into the optimizer, schedule and scaler and restore this
    rank's RNG states; returns the saved progress and this rank's metrics since the last record
    (None when the world size changed or the checkpoint predates them)."""
    state = saved.train_state or {}
    try:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        scaler.load_state_dict(state["scaler"])
        same_world = len(state["rng"]) == world_size
        if same_world:
            restore_rng(state["rng"][rank])
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as err:
        reason = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
        raise TmtError(f"{saved.path / STATE_FILE}: cannot be restored ({reason})") from None
    if not same_world:  # another world size: the data order resumes exactly, the dropout cannot
        logger.warning(
            "checkpoint has %d ranks, this run %d: random streams and the metrics since the"
            " last record restart",
            len(state["rng"]),
            world_size,
        )
    metrics = state.get("metrics", [])
    return state["progress"], metrics[rank] if same_world and len(metrics) == world_size else None


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
