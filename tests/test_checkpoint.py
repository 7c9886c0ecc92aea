"""One checkpoint: round trip, atomic writes, corruption detection, no unsafe unpickling."""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import model_parts
from torch.torch_version import TorchVersion

from transformer_mt.common.exits import TmtError
from transformer_mt.config import load_config
from transformer_mt.runs import checkpoint, run, train_state

CFG = load_config("tiny")


@pytest.fixture
def weights(tiny_spm: bytes) -> Callable[..., dict[str, torch.Tensor]]:
    """The weights of a tiny model initialised from `seed`."""
    return lambda seed=0: model_parts(CFG, tiny_spm, seed)[0]


@pytest.fixture
def save(tiny_spm: bytes) -> Callable[..., Path]:
    """Write a training checkpoint of a tiny model where a run directory keeps step `step`."""

    def save(run_dir: Path, step: int, seed: int = 0) -> Path:
        model, state = model_parts(CFG, tiny_spm, seed)
        return checkpoint.write(
            run.checkpoint_dir(run_dir, step), step, CFG, model, tiny_spm, state
        )

    return save


def test_round_trip(tmp_path: Path, save, weights, tiny_spm: bytes) -> None:
    path = save(tmp_path, 7)
    assert path == tmp_path / "checkpoints" / "step_00000007"
    model = checkpoint.read(path)
    assert model.step == 7 and model.config == CFG and model.tokenizer_bytes == tiny_spm
    assert all(torch.equal(model.state_dict[k], v) for k, v in weights().items())
    state = checkpoint.read(path, train_state=True).train_state
    assert state["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.98)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["step"] == 7 and set(manifest["files"]) == {"model.pt", "train_state.pt"}
    assert (
        manifest["files"]["model.pt"]
        == hashlib.sha256((path / "model.pt").read_bytes()).hexdigest()
    )
    assert manifest["tokenizer_sha256"] == hashlib.sha256(tiny_spm).hexdigest()


def test_exception_mid_save_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, save, weights
) -> None:
    good = save(tmp_path, 10)
    real_write = checkpoint._write_torch

    def failing_write(path: Path, payload: object, *args: object) -> str:
        if path.name == "train_state.pt":
            path.write_bytes(b"half a file")
            raise OSError(28, "No space left on device")
        return real_write(path, payload, *args)

    monkeypatch.setattr(checkpoint, "_write_torch", failing_write)
    with pytest.raises(OSError):
        save(tmp_path, 20, seed=1)
    assert not (tmp_path / "checkpoints" / "step_00000020").exists()  # nothing under the final name
    assert run.latest_valid(tmp_path) == good
    assert torch.equal(
        checkpoint.read(good).state_dict["embedding.weight"], weights()["embedding.weight"]
    )
    # The failed save removed its staging directory; a killed one is swept at the next start.
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))
    (tmp_path / "checkpoints" / ".tmp-step_00000030-999").mkdir()
    run.sweep(tmp_path)
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


def test_saving_the_same_step_again_replaces_it(tmp_path: Path, save, weights) -> None:
    save(tmp_path, 5, seed=0)
    path = save(tmp_path, 5, seed=1)
    assert torch.equal(
        checkpoint.read(path).state_dict["embedding.weight"], weights(1)["embedding.weight"]
    )
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_00000005"]


def flip_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (
            lambda p: (p / "model.pt").write_bytes((p / "model.pt").read_bytes()[:100]),
            "model.pt: does not match",
        ),
        (lambda p: (p / "model.pt").write_bytes(b""), "model.pt: does not match"),
        (lambda p: flip_bit(p / "model.pt"), "model.pt: does not match"),
        (lambda p: flip_bit(p / "train_state.pt"), "train_state.pt: does not match"),
        (lambda p: (p / "model.pt").unlink(), "cannot read"),
        (lambda p: (p / "manifest.json").unlink(), "not a complete checkpoint"),
        (lambda p: (p / "manifest.json").write_text("{"), "unreadable manifest"),
    ],
)
def test_corruption_is_detected_and_resume_falls_back(
    tmp_path: Path, damage, reason: str, save
) -> None:
    older = save(tmp_path, 1)
    newer = save(tmp_path, 2, seed=1)
    damage(newer)
    problem = checkpoint.verify(newer)
    assert problem is not None and reason in problem
    assert run.latest_valid(tmp_path) == older
    with pytest.raises(TmtError):  # reading it directly (translate, average) is refused as well
        checkpoint.read(newer, train_state="train_state" in reason)


def test_other_format_version_is_refused(tmp_path: Path, save) -> None:
    path = save(tmp_path, 3)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["format_version"] = 99
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(TmtError, match="checkpoint format version 99, this tmt reads 1"):
        checkpoint.read(path)


@pytest.mark.parametrize(
    ("version", "refused"),
    [("2.9.1", True), ("2.6.0+cu124", True), ("1.13.1", True), ("2.10.0", False),
     ("2.11.0+cu130", False), ("2.13.0+cpu", False), ("3.0.0a0", False)],
)  # fmt: skip
def test_a_torch_older_than_the_safe_loader_is_refused_by_number(
    tmp_path: Path, save, monkeypatch: pytest.MonkeyPatch, version: str, refused: bool
) -> None:
    """2.9 is older than 2.10 (as strings it is not): torch.__version__ is a TorchVersion, which
    compares by number, so an older torch never reads checkpoints with a weights_only loader that
    a crafted file bypasses (CVE-2026-24747)."""
    path = save(tmp_path, 3)
    monkeypatch.setattr(torch, "__version__", TorchVersion(version))
    if refused:
        with pytest.raises(TmtError, match=f"torch {re.escape(version)}: .* torch >= 2.10 only"):
            checkpoint.read(path)
    else:
        assert checkpoint.read(path).step == 3


class _Payload:
    """Pickles as a call to os.system: what a malicious checkpoint carries."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_is_refused_and_never_runs(tmp_path: Path, save) -> None:
    path = save(tmp_path, 4)
    marker = tmp_path / "pwned"
    torch.save(
        {"format_version": 1, "step": 4, "config": {}, "tokenizer": b"", "model": _Payload(marker)},
        path / "model.pt",
    )
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["model.pt"] = hashlib.sha256(
        (path / "model.pt").read_bytes()
    ).hexdigest()  # a forged manifest
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(TmtError, match="refused: holds more than tensors"):
        checkpoint.read(path)
    assert not marker.exists()


def test_rng_states_round_trip_as_plain_tensors(tmp_path: Path) -> None:
    random.seed(1)
    np.random.seed(2)
    np.random.standard_normal()  # leaves a cached Gaussian in NumPy's state
    torch.manual_seed(3)
    state = train_state.capture_rng()
    expected = (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist())
    torch.save(state, tmp_path / "rng.pt")
    train_state.restore_rng(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert (
        random.random(),
        np.random.standard_normal(3).tolist(),
        torch.rand(3).tolist(),
    ) == expected


def test_unknown_config_key_in_checkpoint_is_reported(tmp_path: Path, save) -> None:
    path = save(tmp_path, 5)
    payload = torch.load(path / "model.pt", weights_only=True)
    payload["config"]["model"]["d_modle"] = 3
    torch.save(payload, path / "model.pt")
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["model.pt"] = hashlib.sha256((path / "model.pt").read_bytes()).hexdigest()
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(TmtError, match="unknown key model.d_modle"):
        checkpoint.read(path)


def test_saved_config_is_the_resolved_config(tmp_path: Path, weights, tiny_spm: bytes) -> None:
    cfg = load_config("tiny", ["optim.eps=1e-8"])
    path = checkpoint.write(tmp_path / "model", 1, cfg, weights(), tiny_spm)
    assert checkpoint.read(path).config == cfg
