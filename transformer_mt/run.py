"""A run directory from start to finish: what `tmt train` writes there, and where models are found.

    OUT_DIR/config.yaml                 the resolved config of the latest session
    OUT_DIR/tokenizer.model             the joint sentencepiece model (also inside every checkpoint)
    OUT_DIR/metrics.jsonl               one JSON object per log step, validation and skipped update
    OUT_DIR/curves.png                  loss, BLEU, learning rate and tokens/s (plot.py)
    OUT_DIR/tensorboard/                the same as TensorBoard events (train.tensorboard)
    OUT_DIR/checkpoints/step_00001000/  a checkpoint (checkpoint.py owns the format of one)
    OUT_DIR/checkpoints/best            -> step_00000500: the best by train.best_metric
    OUT_DIR/average/                    the last train.average_last checkpoints averaged (§6.1)

Start: sweep what killed writers left, refuse a directory without room, write the config and the
tokenizer, drop metrics past the resume step. Resume: the newest checkpoint that reads (verified
and read once), checked against the config. Save: a checkpoint, the best link, retention. Every file
is written atomically, and only by rank 0. Translating, evaluating and averaging find their models
here too (load_model, newest_models), each checkpoint read once.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from transformer_mt import checkpoint, distributed, exits, files
from transformer_mt.checkpoint import Checkpoint
from transformer_mt.config import (
    MODEL_SECTIONS,
    SECTIONS,
    Config,
    changed_keys,
    to_dict,
    to_yaml,
)
from transformer_mt.distributed import DistInfo
from transformer_mt.exits import TmtError
from transformer_mt.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

CHECKPOINTS = checkpoint.CHECKPOINTS
_PREFIX = "step_"
LOCK_FILE = ".lock"
# What may differ between a run's checkpoint and the config resuming it: budgets, logging,
# checkpoint cadence, decoding (it only scores validation) and how the run executes. Anything
# else would make a different experiment of the same run (train.resume=force records it).
MAY_CHANGE_ON_RESUME = (
    "train.out_dir", "train.max_steps", "train.max_epochs", "train.max_minutes",
    "train.log_every", "train.valid_every", "train.bleu_every", "train.bleu_beam_size",
    "train.save_every", "train.save_every_minutes", "train.keep_last", "train.average_last",
    "train.patience", "train.nonfinite_patience", "train.device", "train.compile",
    "train.distributed_timeout_s", "train.resume", "data.num_proc", "data.cache_dir", "data.test",
    "train.keep_best", "train.curves", "train.tensorboard",
)  # fmt: skip


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / CHECKPOINTS / f"{_PREFIX}{step:08d}"


# --- start -------------------------------------------------------------------------------------


def start(
    run_dir: Path, cfg: Config, tokenizer: Tokenizer, step: int, checkpoint_bytes: int
) -> None:
    """Prepare the run directory for a session resuming at `step` (0: a new run).

    Refuses to start without room for checkpoints: a new one is written beside the last, so twice
    a checkpoint's size must be free. Metrics past `step` are dropped (those steps are trained
    again)."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=run_dir).close()
    except OSError as err:
        raise TmtError(
            f"{run_dir}: cannot write there ({err.strerror or err})", exit_code=exits.NO_ROOM
        ) from None
    sweep(run_dir)
    free = shutil.disk_usage(run_dir).free
    if free < 2 * checkpoint_bytes:
        raise TmtError(
            f"{run_dir}: {free / 2**20:.0f} MiB free, but a checkpoint takes about"
            f" {checkpoint_bytes / 2**20:.0f} MiB and twice that must be free",
            exit_code=exits.NO_ROOM,
        )
    try:
        files.atomic_write(run_dir / "config.yaml", to_yaml(cfg).encode())
        files.atomic_write(run_dir / "tokenizer.model", tokenizer.model_bytes)
        _trim_metrics(run_dir / "metrics.jsonl", step)
    except OSError as err:
        raise TmtError(
            f"{run_dir}: cannot write the run's files ({err.strerror or err})",
            exit_code=exits.NO_ROOM,
        ) from None


def sweep(run_dir: Path) -> None:
    """Clean up after interrupted writes in a run directory (its owner calls this): staging
    directories and temporary files go, a checkpoint caught between the two renames of a
    same-step save is put back."""
    files.remove_leftovers(run_dir, [f".*{files.TEMP_SUFFIX}"])
    checkpoint.recover(run_dir, live_writers=False)  # staging of OUT_DIR/average
    if (run_dir / CHECKPOINTS).is_dir():
        files.remove_leftovers(run_dir / CHECKPOINTS, [".best-*", f".*{files.TEMP_SUFFIX}"])
        checkpoint.recover(run_dir / CHECKPOINTS, live_writers=False)


class RunLock:
    """OUT_DIR/.lock: the one process that trains in a run directory holds it (an flock, which
    the kernel releases when the holder dies, however it dies). The file names the holder, so a
    second trainer is refused with who holds it, and a lock left by a crash is simply taken."""

    def __init__(
        self,
        run_dir: Path,
        hint: str = "or train into another train.out_dir",
        mentions: Sequence[str] = (),
    ) -> None:
        self.path = run_dir / LOCK_FILE
        self.hint, self.mentions = hint, mentions  # what else the refused user can do
        self.fd: int | None = None

    def acquire(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise TmtError(
                f"{self.path.parent}: cannot write there ({err.strerror or err})",
                exit_code=exits.NO_ROOM,
            ) from None
        holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise TmtError(
                f"{self.path.parent}: in use by {holder or 'another process'}; wait for it to"
                f" end, stop it, {self.hint}",
                mentions=self.mentions,
            ) from None
        except OSError as err:  # a filesystem without locks: train, but say so
            logger.warning("%s: cannot lock (%s); make sure no other trainer uses it",
                           self.path, err.strerror)  # fmt: skip
        if holder:
            logger.info("%s: the previous holder (%s) is gone; taking it over", self.path, holder)
        me = f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%H:%M:%S')}"
        os.ftruncate(fd, 0)
        os.pwrite(fd, me.encode(), 0)
        self.fd = fd

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
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, 0)  # a clean end leaves no holder behind
            os.close(self.fd)  # releases the flock
            self.fd = None


def _trim_metrics(path: Path, step: int) -> None:
    if path.exists():
        kept = [line for line in path.read_text().splitlines() if _record_step(line) <= step]
        files.atomic_write(path, "".join(line + "\n" for line in kept).encode())


def _record_step(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return sys.maxsize  # a torn last line from a kill: dropped


class MetricsLog:
    """What training reports: metrics.jsonl (rank 0 writes one JSON object per line, flushed as
    written) and the progress bar (rank 0 shows it), with the sums of the updates since the last
    record, which `flush` all-reduces over ranks (every rank calls it at the same steps)."""

    def __init__(
        self, run_dir: Path, info: DistInfo, max_steps: int, step: int, tensorboard: bool = False
    ) -> None:
        from tqdm import tqdm

        self.info = info
        self.handle = None
        self.events = None  # a TensorBoard SummaryWriter (train.tensorboard), rank 0's
        if info.is_main and tensorboard:
            self.events = _summary_writer(run_dir / "tensorboard", step)
        if info.is_main:
            try:
                self.handle = open(run_dir / "metrics.jsonl", "a", encoding="utf-8")  # noqa: SIM115
            except OSError as err:
                raise TmtError(
                    f"{run_dir / 'metrics.jsonl'}: cannot write ({err.strerror or err})",
                    exit_code=exits.NO_ROOM,
                ) from None
        self.bar = tqdm(
            total=max_steps or None, initial=step, disable=not info.is_main or None,
            unit="step", dynamic_ncols=True, file=sys.stderr,
        )  # fmt: skip
        self._reset()

    def _reset(self) -> None:
        self.loss = self.nll = 0.0  # sums over this rank's target tokens
        self.tokens = self.real_tokens = self.padded_tokens = 0
        self.lr = 0.0
        self.start = time.monotonic()

    def update(
        self, loss: float, nll: float, tokens: int, real: int, padded: int, lr: float
    ) -> None:
        """One applied update: its sums on this rank, and the learning rate it used."""
        self.loss += loss
        self.nll += nll
        self.tokens += tokens
        self.real_tokens += real
        self.padded_tokens += padded
        self.lr = lr
        self.bar.update(1)

    def flush(self, step: int, epoch: int) -> dict[str, Any]:
        """The record of the updates since the last one (all ranks), written and shown."""
        sums = [self.loss, self.nll, self.tokens]
        totals = torch.tensor(sums, dtype=torch.float64, device=self.info.device)
        loss, nll, tokens = distributed.all_reduce_sum(totals, self.info).tolist()
        record = {
            "step": step,
            "epoch": epoch,
            "loss": loss / tokens,
            "nll": nll / tokens,
            "ppl": math.exp(min(nll / tokens, 100.0)),
            "lr": self.lr,
            "tokens_per_s": tokens / max(time.monotonic() - self.start, 1e-9),
            "padding_efficiency": self.real_tokens / self.padded_tokens,
        }
        self._reset()
        self.write(record)
        self.bar.set_postfix(
            loss=f"{record['loss']:.3f}", lr=f"{record['lr']:.2e}",
            tok_s=f"{record['tokens_per_s']:.0f}", pad=f"{record['padding_efficiency']:.2f}",
        )  # fmt: skip
        return record

    def write(self, record: dict[str, Any]) -> None:
        if self.handle is None:
            return
        if self.events is not None:  # the curves: update records and validations
            for name, value in record.items():
                if name in _TRAIN_CURVES or name.startswith("val_"):
                    group = "valid" if name.startswith("val_") else "train"
                    self.events.add_scalar(f"{group}/{name}", value, record["step"])
        try:
            self.handle.write(json.dumps(record) + "\n")
            self.handle.flush()
        except OSError as err:
            raise TmtError(
                f"{self.handle.name}: cannot write ({err.strerror or err}); the checkpoints"
                " written so far are intact",
                exit_code=exits.NO_ROOM,
            ) from None

    def window(self) -> dict[str, Any]:
        """This rank's sums since the last record: saved with each checkpoint, so the first
        record after a resume covers the same updates as in an uninterrupted run."""
        sums = {"loss": self.loss, "nll": self.nll, "tokens": self.tokens, "lr": self.lr}
        counts = {"real_tokens": self.real_tokens, "padded_tokens": self.padded_tokens}
        return {**sums, **counts, "seconds": time.monotonic() - self.start}

    def restore(self, window: dict[str, Any]) -> None:
        self.loss, self.nll, self.tokens = window["loss"], window["nll"], window["tokens"]
        self.real_tokens, self.padded_tokens = window["real_tokens"], window["padded_tokens"]
        self.lr, self.start = window["lr"], time.monotonic() - window["seconds"]

    def show(self, message: str) -> None:
        """A line on stderr past the bar (which is hidden off a terminal), from rank 0."""
        if self.info.is_main:
            self.bar.write(f"tmt: {message}", file=sys.stderr)

    def close(self) -> None:
        self.bar.close()
        if self.events is not None:
            self.events.close()
        if self.handle is not None:
            self.handle.close()


_TRAIN_CURVES = ("loss", "nll", "ppl", "lr", "tokens_per_s", "padding_efficiency")


def require_tensorboard() -> Any:
    """TensorBoard's SummaryWriter class, or a one-line error naming the extra to install."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise TmtError(
            "train.tensorboard=true needs the tensorboard package:"
            " pip install 'transformer_mt[tensorboard]' (or set train.tensorboard=false)"
        ) from None
    return SummaryWriter


def _summary_writer(log_dir: Path, step: int) -> Any:
    """TensorBoard's writer; events past `step` (a resume) are purged from what it shows, as
    metrics.jsonl drops them."""
    return require_tensorboard()(str(log_dir), purge_step=step or None, flush_secs=30)


# --- resume ------------------------------------------------------------------------------------


def resume(run_dir: Path, cfg: Config) -> Checkpoint | None:
    """The newest checkpoint of the run that reads, with its training state (newer broken ones
    are reported and skipped); refused when it holds another model than `cfg` describes, or was
    trained with other settings (see MAY_CHANGE_ON_RESUME) unless train.resume=force."""
    saved = next(newest_valid(run_dir, train_state=True), None)
    if saved is None:
        return None
    differ = checkpoint.model_differences(
        saved.config, saved.tokenizer_bytes, cfg, saved.tokenizer_bytes
    )
    if differ:
        raise TmtError(
            f"{cfg.train.out_dir}: holds a run with other settings"
            f" ({', '.join(differ)} differ from {saved.path});"
            " use a new train.out_dir or the saved values"
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
        raise TmtError(f"train.init_from={source}: no such checkpoint or run directory")
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
    return parent


def drift(saved: Config, cfg: Config) -> list[str]:
    """The settings that make `cfg` another experiment than the run `saved` comes from, as
    "key old -> new" (model and tokenizer sections aside: those can never change)."""
    old, new = to_dict(saved), to_dict(cfg)
    sections = [s for s in SECTIONS if s not in MODEL_SECTIONS and s != "decode"]
    return [
        f"{key} {old[s][k]} -> {new[s][k]}"
        for s in sections
        for k in new[s]
        if (key := f"{s}.{k}") not in MAY_CHANGE_ON_RESUME and old[s][k] != new[s][k]
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
        path = checkpoint.write(final, step, cfg, model, tokenizer_bytes, train_state, info)
        if is_best:
            set_best(run_dir, path)
    except (OSError, RuntimeError) as err:  # disk full, quota, I/O (torch: RuntimeError)
        strerror = err.strerror if isinstance(err, OSError) else None
        reason = strerror or str(err).strip().splitlines()[0]
        raise TmtError(
            f"saving checkpoint step {step} failed ({reason}); nothing was left under"
            " its name and the checkpoints before it are intact",
            exit_code=exits.NO_ROOM,
        ) from None
    prune(
        run_dir, cfg.train.keep_last, protect={path, *protect},
        keep_best=cfg.train.keep_best, metric=cfg.train.best_metric,
    )  # fmt: skip
    return path


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoint directories of a run, oldest step first (complete or not)."""
    root = run_dir / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [
        p
        for p in root.iterdir()
        if p.name.startswith(_PREFIX)
        and p.name[len(_PREFIX) :].isdigit()
        and p.is_dir()
        and not p.is_symlink()  # a link could point anywhere
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
    if target.parent != link.parent or target not in list_checkpoints(run_dir):
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
        keep |= {path for path, _ in ranked_by(checkpoints, metric)[:keep_best]}
    keep = {p.resolve() for p in keep}
    for path in checkpoints:
        if path.resolve() not in keep:
            shutil.rmtree(path, ignore_errors=True)


# --- finding models: each checkpoint read (and so verified) once --------------------------------


def newest_valid(
    run_dir: Path, train_state: bool = False, skip: Collection[Path] = ()
) -> Iterator[Checkpoint]:
    """The run's checkpoints that read, newest first; broken ones are reported and skipped."""
    for path in reversed(list_checkpoints(run_dir)):
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


def newest_models(run_dir: Path, n: int, allow_fewer: bool = False) -> Iterator[Checkpoint]:
    """The newest `n` checkpoints of a run that read, newest first, each read as it is taken (the
    paper averages the last 5 or 20); with allow_fewer, as many as there are (at least 1)."""
    if not (run_dir / CHECKPOINTS).is_dir():
        raise TmtError(f"{run_dir}: not a run directory (no {CHECKPOINTS}/)")
    taken = 0
    for saved in newest_valid(run_dir):
        yield saved
        taken += 1
        if taken == n:
            return
    if not (allow_fewer and taken):
        raise TmtError(f"{run_dir}: {taken} complete checkpoints, {n} asked for")


HIGHER_IS_BETTER = {"val_bleu": True, "val_chrf": True, "val_loss": False, "val_ppl": False}


def checkpoint_scores(path: Path) -> dict[str, float]:
    """The validation scores a checkpoint's manifest carries ({} for none or a broken one)."""
    try:
        scores = checkpoint.read_manifest(path).get("valid")
    except TmtError:
        return {}
    if not isinstance(scores, dict):
        return {}
    return {
        name: float(value)
        for name, value in scores.items()
        if name in HIGHER_IS_BETTER
        and isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
    }


def ranked_by(checkpoints: list[Path], metric: str) -> list[tuple[Path, float]]:
    """The checkpoints that carry `metric`, best first (ties: the newer first)."""
    scored = [(path, checkpoint_scores(path).get(metric)) for path in reversed(checkpoints)]
    sign = -1.0 if HIGHER_IS_BETTER[metric] else 1.0
    ranked = [(path, value) for path, value in scored if value is not None]
    return sorted(ranked, key=lambda item: sign * item[1])  # stable: newer first among ties


def scored_metric(run_dir: Path) -> str:
    """What best-N averaging ranks a run's checkpoints by unless told: val_bleu when they carry
    it (the run measured BLEU at checkpoint steps), else val_loss."""
    carried = {name for path in list_checkpoints(run_dir) for name in checkpoint_scores(path)}
    return "val_bleu" if "val_bleu" in carried else "val_loss"


def best_models(run_dir: Path, n: int, metric: str) -> Iterator[Checkpoint]:
    """The `n` best checkpoints of a run by a validation metric they carry, best first, each
    read (so verified) as it is taken; broken ones are reported and skipped."""
    if not (run_dir / CHECKPOINTS).is_dir():
        raise TmtError(f"{run_dir}: not a run directory (no {CHECKPOINTS}/)")
    if metric not in HIGHER_IS_BETTER:
        raise TmtError(f"--by {metric}: expected one of {', '.join(HIGHER_IS_BETTER)}")
    ranked = ranked_by(list_checkpoints(run_dir), metric)
    if len(ranked) < n:
        raise TmtError(
            f"{run_dir}: {n} checkpoints with {metric} asked for, {len(ranked)} carry it (a"
            " checkpoint carries the scores of a validation at its step; train.keep_best keeps"
            " the best ones)"
        )
    taken = 0
    for path, value in ranked:
        try:
            saved = checkpoint.read(path)
        except TmtError as err:
            logger.warning("skipping checkpoint %s: %s", path, err)
            continue
        logger.info("%s: %s %.4f", path.name, metric, value)
        yield saved
        taken += 1
        if taken == n:
            return
    raise TmtError(f"{run_dir}: {n} checkpoints with {metric} asked for, {taken} read")


AVERAGE = "average"  # OUT_DIR/average: training's final average of its newest checkpoints


def load_model(path: Path) -> Checkpoint:
    """A checkpoint or averaged-model directory as given; for a run directory the model it
    finished with: its average (OUT_DIR/average), else its best checkpoint, else its newest that
    reads. Says which it took."""
    path = Path(path)
    if (path / checkpoint.MANIFEST_FILE).is_file():
        return checkpoint.read(path)
    if not (path / CHECKPOINTS).is_dir():
        raise TmtError(
            f"{path}: not a checkpoint (no {checkpoint.MANIFEST_FILE})"
            f" nor a run directory (no {CHECKPOINTS}/)"
        )
    newest = list_checkpoints(path)[-1:]
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
                " with tmt average %s --last N -o %s",
                candidate, saved.step, newest_step, path, candidate,
            )  # fmt: skip
        return saved
    saved = next(newest_valid(path, skip={best(path)} - {None}), None)
    if saved is None:
        raise TmtError(f"{path}: the run has no complete checkpoint")
    logger.info("%s: using its newest checkpoint %s", path, saved.path)
    return saved
