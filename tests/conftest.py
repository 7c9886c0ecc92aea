"""Shared fixtures: tiny config, a tiny generated parallel corpus, isolated caches, no network."""

from __future__ import annotations

import atexit
import dataclasses
import os
import random
import shutil
import signal
import tempfile
from pathlib import Path

# Before anything imports datasets: no hub access, and caches inside a throwaway directory.
_SCRATCH = Path(tempfile.mkdtemp(prefix="tmt-tests-"))
# Removed when this process ends (each xdist worker has its own scratch); in a forked child the
# inherited handler does nothing.
_OWNER = os.getpid()
atexit.register(lambda: os.getpid() == _OWNER and shutil.rmtree(_SCRATCH, ignore_errors=True))
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HOME"] = str(_SCRATCH / "hf")
os.environ["HF_DATASETS_CACHE"] = str(_SCRATCH / "hf" / "datasets")
os.environ["TMT_CACHE"] = str(_SCRATCH / "tmt-cache")

import pytest  # noqa: E402
import shared_fixtures  # noqa: E402

from transformer_mt.config import Config, load_config  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
WORDS = [
    "ka",
    "lo",
    "mi",
    "nu",
    "pe",
    "ri",
    "so",
    "tu",
    "va",
    "we",
    "xi",
    "yo",
    "za",
    "be",
    "co",
    "du",
    "fa",
    "gi",
]


def reverse_pairs(n: int, seed: int) -> list[tuple[str, str]]:
    """A reverse task: the target is the source's words in reverse order."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        words = [rng.choice(WORDS) + rng.choice(WORDS) for _ in range(rng.randint(2, 7))]
        pairs.append((" ".join(words), " ".join(reversed(words))))
    return pairs


def write_parallel(
    prefix: Path, pairs: list[tuple[str, str]], src: str = "de", tgt: str = "en"
) -> Path:
    prefix.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{prefix}.{src}").write_text("".join(s + "\n" for s, _ in pairs), encoding="utf-8")
    Path(f"{prefix}.{tgt}").write_text("".join(t + "\n" for _, t in pairs), encoding="utf-8")
    return prefix


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Prefixes of a 300-pair train and 40-pair valid reverse-task corpus (files source, de→en)."""
    root = tmp_path_factory.mktemp("tiny_corpus")
    return {
        "train": write_parallel(root / "train", reverse_pairs(300, seed=1)),
        "valid": write_parallel(root / "valid", reverse_pairs(40, seed=2)),
    }


@pytest.fixture(scope="session")
def tiny_cfg(tiny_corpus: dict[str, Path]) -> Config:
    """configs/tiny.yaml on the tiny corpus, with a vocabulary that corpus can fill."""
    cfg = load_config(REPO / "configs" / "tiny.yaml")
    return dataclasses.replace(
        cfg,
        data=dataclasses.replace(
            cfg.data,
            source="files",
            train=str(tiny_corpus["train"]),
            valid=str(tiny_corpus["valid"]),
        ),
        tokenizer=dataclasses.replace(cfg.tokenizer, vocab_size=64, byte_fallback=False),
    )


def with_data(cfg: Config, **changes: object) -> Config:
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, **changes))


@pytest.fixture(scope="session")
def trained_run(tiny_cfg: Config, request: pytest.FixtureRequest) -> Path:
    """A tiny model trained for 30 steps, a checkpoint every 10 (all kept), validated every 10;
    trained once for all workers."""
    from transformer_mt.training.train import train

    def build(out: Path) -> None:
        changes = {"out_dir": str(out), "max_steps": 30, "save_every": 10, "valid_every": 10}
        train(dataclasses.replace(
            tiny_cfg, train=dataclasses.replace(tiny_cfg.train, keep_last=5, **changes)
        ))  # fmt: skip

    return shared_fixtures.shared(request, "trained_run", build)


@pytest.fixture(scope="session")
def tiny_spm(tiny_cfg: Config) -> bytes:
    """The sentencepiece model of the tiny corpus (64 pieces), as bytes."""
    from transformer_mt.data.batches import prepare_data

    return prepare_data(tiny_cfg).tokenizer.model_bytes


def model_parts(cfg: Config, spm: bytes, seed: int = 0) -> tuple[dict, dict]:
    """Weights and a training state of a real model of `cfg` (freshly initialised from `seed`):
    what checkpoint.read verifies a checkpoint against."""
    import torch

    from transformer_mt.data.tokenizer import Tokenizer
    from transformer_mt.network.model import Transformer
    from transformer_mt.runs import train_state
    from transformer_mt.training.optim import build_optimizer

    tokenizer = Tokenizer(spm)
    torch.manual_seed(seed)
    model = Transformer(cfg.model, tokenizer.vocab_size, tokenizer.pad_id)
    optimizer, scheduler = build_optimizer(model.parameters(), cfg.model, cfg.optim)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    ranks = [{"rng": train_state.capture_rng(), "metrics": {}}]
    state = train_state.collect(optimizer, scheduler, scaler, ranks, {"step": 0})
    return model.state_dict(), state


@pytest.fixture(scope="session")
def multi30k_run(request: pytest.FixtureRequest) -> Path:
    """configs/tiny.yaml widened to d_model 64 on the bundled Multi30k (de→en) for 300 updates
    (15-40 s on one core): a small model whose translations are varied English sentences that
    depend on the input, for tests that compare them (the 32-wide tiny model says nearly the same
    thing for every input, which would make such comparisons vacuous). Built once for all
    workers (tests/shared_fixtures.py): a test that writes beside it copies it first."""
    return shared_fixtures.shared(request, "multi30k_run", _train_multi30k_run)


def _train_multi30k_run(out: Path) -> None:
    from transformer_mt.training.train import train

    cfg = load_config(REPO / "configs" / "tiny.yaml")
    train(
        dataclasses.replace(
            cfg,
            model=dataclasses.replace(cfg.model, d_model=64, d_ff=256, n_heads=4, dropout=0.0),
            data=dataclasses.replace(cfg.data, max_tokens=2048),
            optim=dataclasses.replace(cfg.optim, warmup_steps=100, lr_scale=0.5),
            train=dataclasses.replace(
                cfg.train, out_dir=str(out), max_steps=300, save_every=100, valid_every=100
            ),
        )
    )


def multi30k_sentences(n: int, split: str = "test_2016_flickr") -> list[str]:
    """The first `n` German sentences of a bundled Multi30k split."""
    import gzip

    path = REPO / "transformer_mt" / "multi30k" / f"{split}.de.gz"
    with gzip.open(path, "rt", encoding="utf-8") as lines:
        return [next(lines).rstrip("\n") for _ in range(n)]


@pytest.fixture(scope="session")
def marian_dirs(request: pytest.FixtureRequest) -> dict[str, Path]:
    """Two MarianMTModel directories written by transformers (tests/marian_models.py): "multi"
    (en -> de/fr, language tokens, </s> at 37, swish, safetensors; trained about 15 s) and
    "separate" (the same network, separate vocabularies, relu, pytorch_model.bin). Built once
    for all workers."""
    root = shared_fixtures.shared(request, "marian_dirs", _train_marian_dirs)
    return {"multi": root / "multi", "separate": root / "separate"}


def _train_marian_dirs(root: Path) -> None:
    import marian_models

    multi = marian_models.train_multi(root / "multi")
    marian_models.derive_separate(multi, root / "separate")


@pytest.fixture(scope="session")
def imported(marian_dirs: dict[str, Path], request: pytest.FixtureRequest) -> dict[str, Path]:
    """The two MarianMTModel directories imported into tmt model directories."""
    root = shared_fixtures.shared(request, "imported", _import_marian_dirs)
    return {kind: root / kind for kind in marian_dirs}


def _import_marian_dirs(root: Path) -> None:
    from transformer_mt.exchange import pretrained

    # marian_dirs' builder first (a no-op once built): this one may run as a waiting worker's help
    marian = shared_fixtures.once(root.parent, "marian_dirs", _train_marian_dirs)
    for kind in ("multi", "separate"):
        pretrained.import_model(marian / kind, root / kind)


shared_fixtures.HELPERS.update(
    multi30k_run=_train_multi30k_run, marian_dirs=_train_marian_dirs, imported=_import_marian_dirs
)


@pytest.fixture
def bounded_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hang guard on each read of a file tmt wrote (files.read_plain, sha256_plain: where a
    FIFO or /dev/zero in its place would hang), never on the command around them: a slow, busy
    machine makes the command slow, not a read of a small file."""
    from transformer_mt.common import files

    for name in ("read_plain", "sha256_plain"):
        real = getattr(files, name)

        def guarded(*args, _real=real, **kwargs):
            def expire(signum, frame):
                raise TimeoutError(f"a read of a file tmt wrote still blocked after 20 s: {args}")

            previous = signal.signal(signal.SIGALRM, expire)
            signal.alarm(20)
            try:
                return _real(*args, **kwargs)
            finally:
                signal.alarm(0)
                signal.signal(signal.SIGALRM, previous)

        monkeypatch.setattr(files, name, guarded)
