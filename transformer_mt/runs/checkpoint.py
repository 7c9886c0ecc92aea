"""One checkpoint directory: write it atomically, recover an interrupted write, read it (which
verifies it and builds its model).

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
command reads a file twice. Reading also loads: the tokenizer is parsed once and the weights are
loaded into the model the config describes, built once. Where checkpoints live in a run directory
is run.py's business; what train_state.pt holds, train_state.py's; averaging, averaging.py's.
"""

from __future__ import annotations

import errno
import hashlib
import importlib.metadata
import io
import json
import logging
import math
import os
import pickle
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from transformer_mt.common import distributed, faults, files
from transformer_mt.common.exits import TmtError, first_line
from transformer_mt.config import (
    MODEL_SECTIONS,
    Config,
    changed_keys,
    config_from_dict,
    config_hash,
    to_dict,
)
from transformer_mt.data.tokenizer import Tokenizer
from transformer_mt.data.tokenizer import load as load_tokenizer
from transformer_mt.network.model import Transformer, parameter_count
from transformer_mt.runs.train_state import check as check_train_state

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
    """A checkpoint as read: model.pt's content loaded, and train_state.pt's when asked for."""

    path: Path
    step: int
    config: Config
    tokenizer: Tokenizer  # parsed once, when read
    state_dict: dict[str, torch.Tensor]  # the weights (the model's own tensors when it is built)
    # The model the config describes, holding the weights (CPU, training mode); None when read to
    # be averaged with another checkpoint (read(..., average_with=...)).
    model: Transformer | None = None
    train_state: dict[str, Any] | None = None
    sources: tuple[str, ...] = ()  # an averaged model: the checkpoints it averages, oldest first

    @property
    def tokenizer_bytes(self) -> bytes:
        return self.tokenizer.model_bytes


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
    files.recover(root, live_writers=True, names=[name])
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


def read(
    path: str | Path, train_state: bool = False, average_with: Checkpoint | None = None
) -> Checkpoint:
    """Read model.pt (and train_state.pt) of a checkpoint directory, each file once, verified
    against the manifest before it is unpickled (tensors and plain values only), then loaded: the
    tokenizer parsed and the weights loaded into the model the config describes, each once. A
    checkpoint that reads is one that loads.

    With `average_with` (a checkpoint read before, to be averaged with this one), the model is
    not built again: this one must hold the same model (model and tokenizer settings, tokenizer,
    weight names and shapes), and it shares that checkpoint's parsed tokenizer."""
    path = Path(path)
    manifest = read_manifest(path)
    step, cfg, weights, spm = _read_model_file(path, manifest)
    sources = tuple(str(s) for s in manifest.get("averaged", ()) if isinstance(s, str))
    if average_with is not None:
        _check_same_model(average_with, path, cfg, spm, weights)
        return Checkpoint(
            path=path, step=step, config=cfg, tokenizer=average_with.tokenizer,
            state_dict=weights, sources=sources,
        )  # fmt: skip
    tokenizer = load_tokenizer(spm, origin=f"{path / MODEL_FILE} tokenizer")
    what, nbytes = check_size(cfg, tokenizer, weights, path / MODEL_FILE)
    # The random initialisation of the build is overwritten by the weights; it draws from a
    # forked generator, so reading a checkpoint never moves the caller's random streams.
    with torch.random.fork_rng(devices=[]), distributed.allocating(what, nbytes, _CPU):
        model = build_model(cfg, tokenizer)
    load_weights(model, weights, path / MODEL_FILE)
    state = None
    if train_state:
        state = _load_verified(path, STATE_FILE, manifest)
        check_train_state(state, list(model.parameters()), path / STATE_FILE)
    return Checkpoint(
        path=path, step=step, config=cfg, tokenizer=tokenizer, state_dict=model.state_dict(),
        model=model, train_state=state, sources=sources,
    )  # fmt: skip


_CPU = torch.device("cpu")


def check_size(
    cfg: Config, tokenizer: Any, weights: dict[str, torch.Tensor], where: Path
) -> tuple[str, int]:
    """Before the model is built: refuse weights that hold fewer values than the model their
    config describes (a small file must not make tmt allocate a large model, nor build a shape-
    only one of a million layers), and a model this machine has no room for. What is built, and
    the bytes it takes."""
    expected = parameter_count(cfg.model, tokenizer.vocab_size, tokenizer.source_vocab_size)
    storages = {t.untyped_storage().data_ptr(): t for t in weights.values()}  # tied: one storage
    held = sum(t.untyped_storage().nbytes() // t.element_size() for t in storages.values())
    if held < expected:
        raise TmtError(
            f"{where}: weights do not fit its config's model: the config describes"
            f" {expected:,} parameters, the file holds {held:,} values"
        )
    what = f"loading a model of {expected:,} parameters"
    nbytes = 4 * (expected + cfg.model.max_positions * cfg.model.d_model)
    distributed.check_room(nbytes, _CPU, what)
    return what, nbytes


def _read_model_file(
    path: Path, manifest: dict[str, Any]
) -> tuple[int, Config, dict[str, torch.Tensor], bytes]:
    """model.pt's step, config, weights (named floating-point tensors) and tokenizer bytes,
    checked against the manifest."""
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
    if not isinstance(weights, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) and v.is_floating_point()
        for k, v in weights.items()
    ):
        raise TmtError(f"{where}: malformed checkpoint (the weights are not named float tensors)")
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
    return step, cfg, weights, spm


def verify(path: Path) -> str | None:
    """None if `path` is a complete, uncorrupted checkpoint, else the reason it is not."""
    try:
        read(path, train_state=STATE_FILE in read_manifest(path)["files"])
    except TmtError as err:
        return str(err)
    return None


def not_a_directory(path: Path) -> str:
    """Why `path`, named as a model, is no checkpoint directory: it is missing, or a file (say,
    the model.pt inside one)."""
    if not path.exists():
        return "no such file or directory"
    return "a file; a checkpoint is a directory (with manifest.json), as a run directory is"


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of a checkpoint directory, checked: a format version this tmt reads, a step,
    and SHA-256 digests for model.pt (and train_state.pt), no other file."""
    file = path / MANIFEST_FILE
    if not path.is_dir():
        raise TmtError(f"{path}: {not_a_directory(path)}")
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
    """The bytes of the plain file at `path` (files.read_plain), its refusals as one line; a
    symbolic link to a plain file is read through (a linked store: its content is checked
    against the manifest's SHA-256 all the same), one to a FIFO or a device is refused."""
    try:
        return files.read_plain(path, limit, follow_links=True)
    except FileNotFoundError:
        raise
    except files.NotPlainFile as err:
        if err.errno == errno.EFBIG:
            raise TmtError(f"{path}: {err.strerror}") from None
        what = f"cannot read: {err.strerror}" if err.errno == errno.ELOOP else err.strerror
        raise TmtError(f"{path}: {what}; checkpoint files are plain files") from None
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
        reason = first_line(err)[:200]
        raise TmtError(
            f"{path / name}: refused: holds more than tensors and plain values ({reason})"
        ) from None
    except (RuntimeError, EOFError, ValueError) as err:
        raise TmtError(f"{path / name}: unreadable ({first_line(err)})") from None


# --- validation scores in the manifest ---------------------------------------------------------

HIGHER_IS_BETTER = {"val_bleu": True, "val_chrf": True, "val_loss": False, "val_ppl": False}


def scores(path: Path) -> dict[str, float]:
    """The validation scores a checkpoint's manifest carries ({} for none or a broken one)."""
    try:
        found = read_manifest(path).get("valid")
    except TmtError:
        return {}
    if not isinstance(found, dict):
        return {}
    return {
        name: float(value)
        for name, value in found.items()
        if name in HIGHER_IS_BETTER
        and isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
    }


def ranked_by(checkpoints: list[Path], metric: str) -> list[tuple[Path, float]]:
    """The checkpoints (oldest first) that carry `metric`, best first (ties: the newer first)."""
    scored = [(path, scores(path).get(metric)) for path in reversed(checkpoints)]
    sign = -1.0 if HIGHER_IS_BETTER[metric] else 1.0
    ranked = [(path, value) for path, value in scored if value is not None]
    return sorted(ranked, key=lambda item: sign * item[1])  # stable: newer first among ties


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


def build_model(cfg: Config, tokenizer: Tokenizer) -> Transformer:
    """The model `cfg` describes over `tokenizer`'s vocabularies (randomly initialised), once the
    tokenizer can start its decoder as model.decoder_start says."""
    tokenizer.start_id(cfg.model.decoder_start)  # a Marian tokenizer has no <s>: refused here
    return Transformer(
        cfg.model, tokenizer.vocab_size, tokenizer.pad_id, tokenizer.source_vocab_size,
        tokenizer.source_pad_id,
    )  # fmt: skip


def load_weights(model: Transformer, state_dict: dict[str, torch.Tensor], origin: Path) -> None:
    """Load weights into `model`, refusing weights of another shape before any compute and naming
    the parameters that differ: the one shape check of every load."""
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    differ = _shape_differences(expected, state_dict)
    if differ:
        raise TmtError(f"{origin}: weights do not fit its model: {'; '.join(differ[:4])}")
    model.load_state_dict(state_dict)


def _shape_differences(
    expected: dict[str, tuple[int, ...]], weights: dict[str, torch.Tensor]
) -> list[str]:
    differ = [f"{name} unexpected" for name in weights if name not in expected]
    for name, shape in expected.items():
        found = tuple(weights[name].shape) if name in weights else "missing"
        if found != shape:
            differ.append(f"{name} {found} vs {shape}")
    return differ


def _check_same_model(
    first: Checkpoint, path: Path, cfg: Config, spm: bytes, weights: dict[str, torch.Tensor]
) -> None:
    """Refuse weights that are not `first`'s model: they could not be averaged with it."""
    differ = model_differences(first.config, first.tokenizer_bytes, cfg, spm)
    if not differ:
        expected = {name: tuple(t.shape) for name, t in first.state_dict.items()}
        differ = _shape_differences(expected, weights)[:4]
    if differ:
        raise TmtError(f"cannot average {first.path} with {path}: {', '.join(differ)} differ")


def _non_finite(tree: Any) -> list[str]:
    """Names of floating-point tensors in a nested dict/list that hold NaN or infinity: one total
    norm (one wait for a GPU, not ~500 a save), then, if it is not finite (or overflowed), each."""
    named = list(_floating(tree, ""))
    if not named or torch.isfinite(torch.nn.utils.get_total_norm([t for _, t in named])):
        return []
    return [name for name, tensor in named if not bool(torch.isfinite(tensor).all())]


def _floating(tree: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(tree, torch.Tensor):
        if tree.is_floating_point():
            yield prefix or "tensor", tree.detach()
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from _floating(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(tree, list | tuple):
        for i, v in enumerate(tree):
            yield from _floating(v, f"{prefix}[{i}]")
