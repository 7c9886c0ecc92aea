"""What train_state.pt holds, and putting it back: Adam's state, the learning-rate schedule, the
fp16 loss scaler, the trainer's progress, and per rank its random generator states and its metrics
since the last record. Everything is a tensor or a plain value, so torch.load(weights_only=True)
reads it. checkpoint.py writes and verifies the file; this module knows what is in it.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from transformer_mt.common.exits import TmtError

logger = logging.getLogger(__name__)


def collect(
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


def check(state: Any, parameters: list[torch.nn.Parameter], where: Path) -> None:
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


def restore(
    state: dict[str, Any],
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    scaler: torch.amp.GradScaler,
    rank: int,
    world_size: int,
    where: Path,
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Load a training state (train_state.pt at `where`) into the optimizer, schedule and scaler
    and restore this rank's RNG states; returns the saved progress and this rank's metrics since
    the last record (None when the world size changed or the checkpoint predates them)."""
    try:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        scaler.load_state_dict(state["scaler"])
        same_world = len(state["rng"]) == world_size
        if same_world:
            restore_rng(state["rng"][rank])
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as err:
        reason = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
        raise TmtError(f"{where}: cannot be restored ({reason})") from None
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
