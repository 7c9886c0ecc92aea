"""A run directory from start to finish: what `tmt train` writes there, and where models are found.

    OUT_DIR/config.yaml                 the resolved config of the latest session
    OUT_DIR/tokenizer.model             the joint sentencepiece model (also inside every checkpoint)
    OUT_DIR/metrics.jsonl               one JSON object per log step, validation, event (metrics.py)
    OUT_DIR/curves.png                  loss, BLEU, learning rate and tokens/s (plot.py)
    OUT_DIR/tensorboard/                the same as TensorBoard events (train.tensorboard)
    OUT_DIR/checkpoints/step_00001000/  a checkpoint (checkpoint.py owns the format of one)
    OUT_DIR/checkpoints/best            -> step_00000500: the best by train.best_metric
    OUT_DIR/average/                    the last train.average_last checkpoints averaged (§6.1)

Start: sweep what killed writers left, refuse a directory without room, write the config and the
tokenizer, drop metrics past the resume step. Resume: the newest checkpoint that reads (verified
and read once), checked against the config; or, for a new fine-tuning run, the model it starts
from. Save: a checkpoint, the best link, retention. Every file is written atomically, and only by
rank 0. Commands that take a run directory as a model find here the model it finished with
(load_model: its average, else its best, else its newest checkpoint), each checkpoint read once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import tempfile
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from transformer_mt.common import distributed, exits, files
from transformer_mt.common.distributed import DistInfo
from transformer_mt.common.exits import TmtError
from transformer_mt.config import (
    BY_DEVICE,
    MODEL_SECTIONS,
    SECTIONS,
    Config,
    changed_keys,
    to_dict,
    to_yaml,
)
from transformer_mt.data import hints
from transformer_mt.data.tokenizer import Tokenizer
from transformer_mt.runs import checkpoint, metrics
from transformer_mt.runs.checkpoint import Checkpoint

logger = logging.getLogger(__name__)

CHECKPOINTS = files.CHECKPOINTS
_PREFIX = "step_"
LOCK_FILE = files.LOCK_FILE
# What may differ between a run's checkpoint and the config resuming it: budgets, logging,
# checkpoint cadence, decoding (it only scores validation) and how the run executes. Anything
# else would make a different experiment of the same run (train.resume=force records it).
MAY_CHANGE_ON_RESUME = (
    "train.out_dir", "train.max_steps", "train.max_epochs", "train.max_minutes",
    "train.log_every", "train.valid_every", "train.bleu_every", "train.bleu_beam_size",
    "train.save_every", "train.save_every_minutes", "train.keep_last", "train.average_last",
    "train.patience", "train.nonfinite_patience", "train.device", "train.compile",
    "train.distributed_timeout_s", "train.resume", "data.num_proc", "data.cache_dir", "data.test",
    "train.keep_best", "train.curves", "train.tensorboard", "train.oom_patience",
    "train.fused_loss", "train.cuda_graphs", "train.grad_sync",
)  # fmt: skip


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / CHECKPOINTS / f"{_PREFIX}{step:08d}"


# --- start -------------------------------------------------------------------------------------


def start(
    run_dir: Path, cfg: Config, tokenizer: Tokenizer, step: int, checkpoint_bytes: int,
    finished: bool = False,
) -> None:  # fmt: skip
    """Prepare the run directory for a session resuming at `step` (0: a new run).

    Refuses to start without room for checkpoints: a new one is written beside the last, so twice
    a checkpoint's size must be free. Metrics past `step` are dropped (those steps are trained
    again), unless the run is `finished`: it trains nothing, and its log stays as it is."""
    if run_dir.exists() and not run_dir.is_dir():
        raise TmtError(f"train.out_dir={run_dir}: exists and is not a directory")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=run_dir).close()
    except OSError as err:
        reason, code = exits.write_failed(err)
        raise TmtError(f"{run_dir}: cannot write there ({reason})", exit_code=code) from None
    sweep(run_dir)
    free = shutil.disk_usage(run_dir).free
    if free < 2 * checkpoint_bytes:
        raise TmtError(
            f"{run_dir}: {free / 2**20:.0f} MiB free, but a checkpoint takes about"
            f" {checkpoint_bytes / 2**20:.0f} MiB and twice that must be free",
            exit_code=exits.NO_ROOM,
        )
    try:
        files.atomic_write(run_dir / files.CONFIG_FILE, to_yaml(cfg).encode())
        files.atomic_write(run_dir / files.TOKENIZER_FILE, tokenizer.model_bytes)
        if not finished:
            metrics.trim(run_dir, step)
    except OSError as err:
        reason, code = exits.write_failed(err)
        raise TmtError(
            f"{run_dir}: cannot write the run's files ({reason})", exit_code=code
        ) from None


def sweep(run_dir: Path) -> None:
    """Clean up after interrupted writes in a run directory (its owner calls this): staging
    directories and temporary files go, a checkpoint caught between the two renames of a
    same-step save is put back."""
    files.remove_leftovers(run_dir, [f".*{files.TEMP_SUFFIX}"])
    files.recover(run_dir, live_writers=False)  # staging of OUT_DIR/average
    if (run_dir / CHECKPOINTS).is_dir():
        files.remove_leftovers(run_dir / CHECKPOINTS, [".best-*", f".*{files.TEMP_SUFFIX}"])
        files.recover(run_dir / CHECKPOINTS, live_writers=False)


class RunLock:
    """OUT_DIR/.lock: the one process that trains in a run directory holds it (an flock, which
    the kernel releases when the holder dies, however it dies). The file names the holder, so a
    second trainer is refused with who holds it, and a lock left by a crash is simply taken."""

    def __init__(
        self,
        run_dir: Path,
        hint: str = "or train into another train.out_dir",
        mentions: Sequence[str] = (),
        named: str = "",
    ) -> None:
        """`hint`: what else a refused user can do; `named`: how messages name the directory
        (its path, unless it belongs to what the user named: a file job's to its output);
        `mentions`: the parameters either writes as "{name}"."""
        self.path = run_dir / LOCK_FILE
        self.hint, self.mentions = hint, mentions
        self.named = named or str(run_dir)
        self.lock = files.Lock(self.path)
        self.fd: int | None = None
        self.made: list[Path] = []  # directories made for the lock: gone again if left empty

    def acquire(self) -> None:
        try:
            self.made = files.make_directories(self.path.parent)
            self.lock.acquire()
        except files.Busy as err:
            raise TmtError(
                f"{self.named}: in use by {err.holder}; wait for it to end, stop it, {self.hint}",
                mentions=self.mentions,
            ) from None
        except OSError as err:
            files.remove_made(self.made)
            reason, code = exits.write_failed(err)
            raise TmtError(
                f"{self.named}: cannot write there ({reason})",
                exit_code=code,
                mentions=self.mentions,
            ) from None
        if not self.lock.locked:  # a filesystem without locks: train, but say so
            logger.warning("%s: cannot lock; make sure no other trainer uses it", self.path)
        if self.lock.previous:
            logger.info("%s: the previous holder (%s) is gone; taking it over", self.path,
                        self.lock.previous)  # fmt: skip
        self.fd = self.lock.fd

    def take(self, info: DistInfo) -> None:
        """Rank 0 acquires the lock before anything reads or writes the run directory; every
        rank learns whether it did, so a refused job ends on every rank at once."""
        refusal = None
        if info.is_main:
            try:
                self.acquire()
            except TmtError as err:
                refusal = err
        refused = torch.tensor([float(refusal is not None)], device=info.device)
        if distributed.all_reduce_sum(refused, info).item():
            raise refusal or TmtError(
                f"{self.path.parent}: rank 0 could not take the run directory"
            )

    def release(self) -> None:
        if self.fd is not None:
            self.lock.release()
            self.fd = None
            # A run refused before its first file (a config the data cannot serve) leaves no
            # directory behind that it made only to hold its lock.
            if self.made and [p.name for p in self.path.parent.iterdir()] == [LOCK_FILE]:
                with contextlib.suppress(OSError):
                    self.path.unlink()
                    files.remove_made(self.made)


# --- resume ------------------------------------------------------------------------------------


def resume(run_dir: Path, cfg: Config) -> Checkpoint | None:
    """The newest checkpoint of the run that reads, with its training state (newer broken ones
    are reported and skipped); refused when it holds another model than `cfg` describes, or was
    trained with other settings (see MAY_CHANGE_ON_RESUME) unless train.resume=force, or when the
    run directory is a linked store (check_no_links)."""
    check_no_links(run_dir)
    saved = next(newest_valid(run_dir, train_state=True), None)
    if saved is None:
        return None
    differ = checkpoint.model_differences(
        saved.config, saved.tokenizer_bytes, cfg, saved.tokenizer_bytes
    )
    if differ:
        old, new = to_dict(saved.config), to_dict(cfg)
        named = [  # with both values, so a user sees which to give back
            f"{key} {old[section][name]} -> {new[section][name]}"
            if (section := key.partition(".")[0]) in old and (name := key.partition(".")[2])
            else key
            for key in differ
        ]
        raise TmtError(
            f"{cfg.train.out_dir}: holds a run of another model ({', '.join(named)}; its"
            f" checkpoint {saved.path.name}); use a new train.out_dir or the saved values"
        )
    changed = drift(saved.config, cfg)
    if changed and cfg.train.resume != "force":
        raise TmtError(
            f"{cfg.train.out_dir}: its checkpoint {saved.path.name} was trained with other"
            f" settings: {', '.join(changed)}; resume with the saved values, train into another"
            " train.out_dir, or set train.resume=force to continue with these (recorded in"
            " metrics.jsonl)"
        )
    if changed:
        logger.warning(
            "resuming with changed settings (train.resume=force): %s", ", ".join(changed)
        )
    return saved


def check_no_links(run_dir: Path) -> None:
    """Refuse to train into a run directory that holds symbolic links (a linked store: cp -rs,
    a Hugging Face cache's snapshot, git-annex, DVC, Nix; checkpoints/best, tmt's own, aside):
    training writes and prunes there, never through a link. Translating, evaluating, serving and
    exporting read such a store as it is."""
    if not run_dir.is_dir():
        return
    candidates = [*run_dir.iterdir()]
    for sub in (run_dir / CHECKPOINTS, run_dir / AVERAGE):
        if sub.is_dir() and not sub.is_symlink():
            for entry in sub.iterdir():
                candidates.append(entry)
                if entry.is_dir() and not entry.is_symlink():
                    candidates.extend(entry.iterdir())
    # A link to a file or directory: a store (a link to a device, a FIFO or nowhere is a damaged
    # checkpoint file, which resuming skips as any other).
    linked = [p for p in candidates if p.is_symlink() and p != run_dir / CHECKPOINTS / "best"
              and (p.is_file() or p.is_dir())]  # fmt: skip
    if linked:
        raise TmtError(
            f"train.out_dir={run_dir}: a store of symbolic links ({linked[0]} is one), which"
            " tmt train will not write through; train a copy (cp -rL"
            f" {run_dir} NEW_DIR) or into another train.out_dir"
        )


# Model settings a fine-tuning run may change: regularisation of its training, not the weights.
MAY_CHANGE_ON_INIT = ("model.dropout", "model.attention_dropout")


def init_model(cfg: Config) -> Checkpoint:
    """The model train.init_from names (a checkpoint, an averaged model, or a run directory: its
    average, else best, else newest), checked to be the model `cfg` describes."""
    source = Path(cfg.train.init_from)
    out_dir = Path(cfg.train.out_dir).resolve()
    if source.resolve() == out_dir or out_dir in source.resolve().parents:
        raise TmtError(
            f"train.init_from={source}: inside this run's train.out_dir; fine-tune into a new"
            " train.out_dir (a run resumes from its own checkpoints by itself)"
        )
    if not source.exists():
        raise TmtError(f"train.init_from={source}: no such checkpoint or run directory"
                       + _import_hint(source))  # fmt: skip
    parent = load_model(source)
    old, new = to_dict(parent.config), to_dict(cfg)
    differ = [
        f"{key} {old[s][k]!r} (model) vs {new[s][k]!r} (config)"
        for key in changed_keys(parent.config, cfg, MODEL_SECTIONS)
        if key not in MAY_CHANGE_ON_INIT
        for s, k in [key.split(".")]
    ]
    if differ:
        raise TmtError(
            f"train.init_from={source}: the model has other settings: {'; '.join(differ)};"
            " fine-tune with the model's own model and tokenizer settings (its config.yaml)"
        )
    if cfg.data.terms.annotate:  # term hints: its tokenizer gains their tags, if it lacks them
        tokenizer, state_dict = hints.with_tags(parent.tokenizer, parent.state_dict,
                                                cfg.train.seed)  # fmt: skip
        parent = dataclasses.replace(parent, tokenizer=tokenizer, state_dict=state_dict, model=None)
    return parent


def drift(saved: Config, cfg: Config) -> list[str]:
    """The settings that make `cfg` another experiment than the run `saved` comes from, as
    "key old -> new" (model and tokenizer sections aside: those can never change)."""
    old, new = to_dict(saved), to_dict(cfg)
    sections = [
        s for s in SECTIONS if s not in MODEL_SECTIONS and s not in ("decode", "serve", "glossary")
    ]
    return [
        f"{key} {old[s][k]} -> {new[s][k]}"
        for s in sections
        for k in new[s]
        if (key := f"{s}.{k}") not in MAY_CHANGE_ON_RESUME
        and old[s][k] != new[s][k]
        and BY_DEVICE.get(key, object()) != new[s][k]  # left to the device: the run's own
    ]


# --- save and retention ------------------------------------------------------------------------


def save(
    run_dir: Path,
    cfg: Config,
    model: dict[str, torch.Tensor],
    tokenizer_bytes: bytes,
    train_state: dict[str, Any],
    *,
    step: int,
    epoch: int,
    is_best: bool,
    scores: dict[str, float] | None = None,
    protect: Collection[Path] = (),
) -> Path:
    """Write checkpoint `step` atomically with the validation `scores` of its step (in its
    manifest), point `best` at it if it is, and prune old ones."""
    final = checkpoint_dir(run_dir, step)
    info: dict[str, Any] = {"epoch": epoch, **({"valid": scores} if scores else {})}
    try:
        path = checkpoint.write(
            final, step, cfg, state_dict=model, tokenizer_bytes=tokenizer_bytes,
            train_state=train_state, info=info,
        )  # fmt: skip
        if is_best:
            set_best(run_dir, path)
    except (OSError, RuntimeError) as err:  # disk full, quota, I/O (torch: RuntimeError)
        reason, code = exits.write_failed(err)
        raise TmtError(
            f"saving checkpoint step {step} failed ({reason}); nothing was left under"
            " its name and the checkpoints before it are intact",
            exit_code=code,
        ) from None
    prune(
        run_dir, cfg.train.keep_last, protect={path, *protect},
        keep_best=cfg.train.keep_best, metric=cfg.train.best_metric,
    )  # fmt: skip
    return path


def list_checkpoints(run_dir: Path, links: bool = False) -> list[Path]:
    """Checkpoint directories of a run, oldest step first (complete or not). A checkpoint that is
    a symbolic link (a linked store: a Hugging Face cache, cp -rs, git-annex, DVC, Nix) is listed
    only with `links`, for reading a model: what tmt writes, prunes or resumes is never reached
    through a link."""
    root = run_dir / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [
        p
        for p in root.iterdir()
        if p.name.startswith(_PREFIX)
        and p.name[len(_PREFIX) :].isdigit()
        and p.is_dir()
        and (links or not p.is_symlink())
    ]
    return sorted(found, key=lambda p: int(p.name[len(_PREFIX) :]))


def set_best(run_dir: Path, path: Path) -> None:
    """Point checkpoints/best at `path` (a relative symlink, swapped atomically)."""
    link = run_dir / CHECKPOINTS / "best"
    if link.is_dir() and not link.is_symlink():  # a copy of the run turned the link into a copy
        shutil.rmtree(link)
    tmp = link.with_name(f".best-{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    os.symlink(path.name, tmp)
    os.replace(tmp, link)
    files.fsync_dir(link.parent)


def best(run_dir: Path) -> Path | None:
    """The checkpoint checkpoints/best points at: a checkpoint of this run, nothing else."""
    link = run_dir / CHECKPOINTS / "best"
    if not link.is_symlink():
        return None
    target = link.parent / os.readlink(link)
    if target.parent != link.parent or target not in list_checkpoints(run_dir, links=True):
        logger.warning("ignoring %s: it points outside the run's checkpoints", link)
        return None
    return target


def prune(
    run_dir: Path,
    keep_last: int,
    protect: Collection[Path] = (),
    keep_best: int = 1,
    metric: str = "val_loss",
) -> None:
    """Delete all but the newest `keep_last` checkpoints and the `keep_best` best by `metric`;
    never the best or a protected one (the trainer protects the one it just wrote and the one it
    resumed from)."""
    checkpoints = list_checkpoints(run_dir)
    keep = set(checkpoints[-keep_last:] if keep_last > 0 else []) | set(protect)
    keep |= {best(run_dir)} - {None}
    if keep_best > 1:
        keep |= {path for path, _ in checkpoint.ranked_by(checkpoints, metric)[:keep_best]}
    keep = {p.resolve() for p in keep}
    for path in checkpoints:
        if path.resolve() not in keep:
            shutil.rmtree(path, ignore_errors=True)


# --- finding models: each checkpoint read (and so verified) once --------------------------------


def newest_valid(
    run_dir: Path, train_state: bool = False, skip: Collection[Path] = ()
) -> Iterator[Checkpoint]:
    """The run's checkpoints that read, newest first; broken ones are reported and skipped. A
    model is read through a linked store's links; a resume (`train_state`) never is."""
    for path in reversed(list_checkpoints(run_dir, links=not train_state)):
        if path in skip:
            continue
        try:
            yield checkpoint.read(path, train_state=train_state)
        except TmtError as err:
            logger.warning("skipping checkpoint %s: %s", path, err)


def latest_valid(run_dir: Path) -> Path | None:
    """The newest complete, uncorrupted checkpoint of a run (what a resume would start from)."""
    saved = next(newest_valid(run_dir, train_state=True), None)
    return saved.path if saved else None


AVERAGE = "average"  # OUT_DIR/average: training's final average of its newest checkpoints


def _import_hint(path: Path) -> str:
    """What a Hugging Face directory, or a Hub id (OWNER/NAME, no OWNER here), needs first."""
    command = f"`tmt import -m {path} -o DIR` makes it a tmt model"
    weights = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json")
    if (path / "config.json").is_file() and any((path / name).is_file() for name in weights):
        if (path / "tmt_export.json").is_file():  # tmt export --format huggingface
            return ": tmt's Hugging Face export; name its model"
        return f": a Hugging Face model directory; {command}"
    hub_id = not path.exists() and len(path.parts) == 2 and not Path(path.parts[0]).exists()
    return f"; a Hugging Face model id? {command}" if hub_id else ""


def load_model(path: Path) -> Checkpoint:
    """A checkpoint or averaged-model directory as given; for a run directory the model it
    finished with: its average (OUT_DIR/average), else its best checkpoint, else its newest that
    reads. Says which it took."""
    path = Path(path)
    if not path.is_dir():
        raise TmtError(f"{path}: {checkpoint.not_a_directory(path)}{_import_hint(path)}")
    if (path / checkpoint.MANIFEST_FILE).is_file():
        return checkpoint.read(path)
    if not (path / CHECKPOINTS).is_dir():
        raise TmtError(
            f"{path}: not a checkpoint (no {checkpoint.MANIFEST_FILE})"
            f" nor a run directory (no {CHECKPOINTS}/){_import_hint(path)}"
        )
    newest = list_checkpoints(path, links=True)[-1:]
    for kind, candidate in (("average", path / AVERAGE), ("best checkpoint", best(path))):
        if candidate is None or not (candidate / checkpoint.MANIFEST_FILE).exists():
            continue
        try:
            saved = checkpoint.read(candidate)
        except TmtError as err:
            logger.warning("skipping the %s %s: %s", kind, candidate, err)
            continue
        logger.info("%s: using its %s %s (step %d)", path, kind, candidate, saved.step)
        newest_step = int(newest[0].name[len(_PREFIX) :]) if newest else 0
        if kind == "average" and saved.step < newest_step:
            logger.warning(
                "%s averages checkpoints up to step %d, the run has one at step %d: refresh it"
                " with tmt average -m %s --last N -o %s --overwrite",
                candidate, saved.step, newest_step, path, candidate,
            )  # fmt: skip
        return saved
    saved = next(newest_valid(path, skip={best(path)} - {None}), None)
    if saved is None:
        raise TmtError(f"{path}: the run has no complete checkpoint")
    logger.info("%s: using its newest checkpoint %s", path, saved.path)
    return saved
