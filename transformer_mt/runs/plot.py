"""Training curves from metrics.jsonl: loss, validation BLEU, learning rate and tokens/s against
updates, for one run or several overlaid (a colour per run). matplotlib draws them headless (the
Agg canvas, no pyplot state); the file is written atomically, so a kill never leaves half a PNG.
"""

from __future__ import annotations

import io
import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from transformer_mt.common import files, textio
from transformer_mt.common.exits import TmtError
from transformer_mt.runs.metrics import METRICS_FILE, read_log, warn_damaged

RUN_CURVES = "curves.png"  # what training draws into its run directory (RunCurves)
FORMATS = (".png", ".svg", ".pdf")
# (title, y label, [(metrics.jsonl key, line style, legend suffix)]) per panel, in reading order.
PANELS = (
    (
        "loss",
        "label-smoothed loss per token",
        [("loss", "-", "train"), ("val_loss", "--o", "valid")],
    ),
    ("validation BLEU", "BLEU", [("val_bleu", "-o", "")]),
    ("learning rate", "lr", [("lr", "-", "")]),
    ("throughput", "target tokens/s", [("tokens_per_s", "-", "")]),
)


logger = logging.getLogger(__name__)


class NoMatplotlib(TmtError):
    """matplotlib is an optional extra: training goes on without curves, `tmt plot` says so."""


class RunCurves:
    """A training run's curves.png (train.curves), drawn at its validations while drawing costs
    at most `share` of the session's time, and always at its end.

    matplotlib draws on the training thread: ~0.5 s a figure, and the first one imports it and,
    on a machine without its font cache, builds that cache. A short GPU run validates every few
    seconds: an H200's 96-second Multi30k run drew five figures before its last (a few seconds,
    by its log's throughput). A run of hours draws at every validation as before."""

    FIRST_GUESS_S = 2.0  # the first figure's cost, before one is timed

    def __init__(
        self,
        run_dir: Path,
        enabled: bool,
        start: float | None = None,
        share: float = 0.02,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`start`: when the session's time began on `clock` (by default, now)."""
        self.run_dir, self.enabled, self.share, self.clock = run_dir, enabled, share, clock
        self.start = clock() if start is None else start
        self.spent_s, self.last_s = 0.0, self.FIRST_GUESS_S

    def draw(self, final: bool = False) -> bool:
        """Draws curves.png unless disabled or, before the end, over the share; whether it drew.
        A failed figure never stops training: logged, and the next one tried."""
        if not self.enabled:
            return False
        began = self.clock()
        if not final and self.spent_s + self.last_s > self.share * (began - self.start):
            return False
        drawn = False
        try:
            draw_curves([self.run_dir], self.run_dir / RUN_CURVES)
            drawn = True
        except NoMatplotlib:
            self.enabled = False
            logger.info("curves.png is not drawn: pip install 'transformer_mt[plot]' for it")
        except (TmtError, OSError) as err:
            logger.warning("curves.png not drawn: %s", err)
        self.last_s = self.clock() - began
        self.spent_s += self.last_s
        return drawn


def check_run_dir(run_dir: Path) -> Path:
    """The metrics file of `run_dir`, or why `run_dir` is no run to plot."""
    if not run_dir.is_dir():
        what = "a file" if run_dir.exists() else "no such directory"
        raise TmtError(f"{run_dir}: {what}; name a run directory (train.out_dir)")
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise TmtError(f"{run_dir}: no {METRICS_FILE} (not a tmt run directory, or not started)")
    return path


def read_curves(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Each metric's (step, value) points from a run's metrics.jsonl, in step order. Lines that
    do not read are skipped: a torn last line (a kill mid-write) quietly, any other with a
    warning naming them (the log was damaged: its curves miss those points)."""
    path = check_run_dir(Path(run_dir))
    points: dict[str, list[tuple[int, float]]] = {}
    try:
        raw = read_log(path)
    except OSError as err:
        raise TmtError(f"{path}: cannot read: {err.strerror or err}") from None
    warn_damaged(path, raw, "skipped")
    lines = [line for line in raw if line]
    for line in lines:
        try:
            record = json.loads(line)
            step = int(record["step"])
        except (ValueError, KeyError, TypeError, OverflowError, RecursionError):
            continue
        for name, value in record.items():
            number = isinstance(value, int | float) and not isinstance(value, bool)
            if number and name not in ("step", "epoch") and math.isfinite(value):
                points.setdefault(name, []).append((step, float(value)))
    if not points:
        raise TmtError(f"{path}: no records to plot ({len(lines)} lines, none readable)")
    return {name: sorted(values) for name, values in points.items()}


def plot(
    run_dirs: Sequence[Path], output: Path | None = None, overwrite: bool = False
) -> dict[str, Any]:
    """`tmt plot`: the runs' curves into `output` (default: the one run's own curves.png, which is
    refreshed as training refreshes it, or ./curves.png for several). Another existing file is
    replaced only with `overwrite`, and never a run's own files (textio.check_output)."""
    if not run_dirs:
        raise TmtError("no run directories to plot: name them with {model}", mentions=["model"])
    for run_dir in run_dirs:  # before the output's lock makes a directory named as a run
        check_run_dir(Path(run_dir))
    own = output is None and len(run_dirs) == 1
    if output is None:
        output = run_dirs[0] / RUN_CURVES if own else Path(RUN_CURVES)
    textio.check_path(output)
    with textio.OutputLock(output):
        textio.check_output(output, run_dirs, overwrite=overwrite or own)
        return draw_curves(run_dirs, output)


def draw_curves(run_dirs: Sequence[Path], output: Path) -> dict[str, Any]:
    """Draw the runs' curves into `output` (.png, .svg or .pdf); what was drawn: the number of
    curves in each panel."""
    output = Path(output)
    if output.suffix.lower() not in FORMATS:
        raise TmtError(f"{output}: the plot is written as {', '.join(FORMATS)}; name it so")
    image, counts = render_curves(run_dirs, output.suffix.lower().lstrip("."))
    files.atomic_write(output, image)
    return {"output": str(output), "runs": len(run_dirs), "curves": counts}


def render_curves(run_dirs: Sequence[Path], fmt: str = "png") -> tuple[bytes, dict[str, int]]:
    """The runs' curves as an image in `fmt` (png, svg or pdf), and the curves of each panel."""
    runs = [(Path(run_dir), read_curves(Path(run_dir))) for run_dir in run_dirs]
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise NoMatplotlib(
            "plotting needs matplotlib: pip install 'transformer_mt[plot]'"
        ) from None

    figure = Figure(figsize=(11, 7.5), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    names = _labels([run_dir for run_dir, _ in runs])
    # Every panel spans the whole run, from 0 to its last update: a validation BLEU point or two
    # at the end sits where it was measured, not on an axis of their own.
    last = max(step for _, points in runs for series in points.values() for step, _ in series)
    counts = {}
    for axes, (title, ylabel, series) in zip(figure.subplots(2, 2).flat, PANELS, strict=True):
        drawn = 0
        for colour, ((_, points), name) in enumerate(zip(runs, names, strict=True)):
            for key, style, suffix in series:
                if key not in points:
                    continue
                steps, values = zip(*points[key], strict=True)
                label = f"{name} {suffix}".strip()
                axes.plot(steps, values, style, color=f"C{colour}", label=label, markersize=3)
                drawn += 1
        counts[title] = drawn
        axes.set_title(title)
        axes.set_xlabel("updates")
        axes.set_xlim(0, max(last, 1))
        axes.set_ylabel(ylabel)
        axes.grid(alpha=0.3)
        if drawn:
            axes.legend(fontsize="small")
        else:
            keys = ", ".join(key for key, _, _ in series)
            axes.text(0.5, 0.5, f"no {keys} recorded", ha="center", transform=axes.transAxes)
    buffer = io.BytesIO()
    figure.savefig(buffer, format=fmt)
    return buffer.getvalue(), counts


def _labels(run_dirs: list[Path]) -> list[str]:
    """Short names for the legend: the directory names, or the paths when those collide."""
    names = [run_dir.name or str(run_dir) for run_dir in run_dirs]
    return names if len(set(names)) == len(names) else [str(d) for d in run_dirs]
