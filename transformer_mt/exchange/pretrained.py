"""`tmt import`: a published Hugging Face MarianMTModel directory (OPUS-MT) as a tmt model.

    HF_DIR/config.json                 MarianConfig: sizes, activation, special ids
    HF_DIR/generation_config.json      generate's settings (else those of config.json)
    HF_DIR/model.safetensors           the weights (or pytorch_model.bin; either may be sharded)
    HF_DIR/source.spm, target.spm      the tokenizer: two sentencepiece models ...
    HF_DIR/vocab.json                  ... the vocabulary of their pieces (+ target_vocab.json)
    HF_DIR/tokenizer_config.json       the languages, special tokens, separate_vocabs

(or OWNER/NAME: a Hugging Face model id, from the cache or fetched from the Hub, from_hub) become
a tmt model directory that every command takes with -m:

    DIR/model.pt, DIR/manifest.json    a checkpoint (checkpoint.py): the weights, the config, the
                                       tokenizer (marian_tokenizer.py), verified when read
    DIR/config.yaml                    the tmt config of the model, what fine-tuning starts from
    DIR/import.json                    what was imported: the files and their SHA-256, the
                                       generation settings tmt reproduces and those it does not

Weights are read without running code (safetensors, or torch.load(weights_only=True)), every
name and shape is checked against the config (huggingface.py's map, the export's read the other
way), and the model dimension is relabelled from Marian's [sin | cos] sinusoids to tmt's
interleaved ones. The import is deterministic (the same directory gives the same bytes) and
atomic: it is written in a staging directory renamed into place, so an interrupted import
leaves nothing under DIR.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from transformer_mt.common import files, textio
from transformer_mt.common.exits import TmtError, first_line
from transformer_mt.config import Config, to_yaml
from transformer_mt.data import marian_tokenizer
from transformer_mt.exchange import foreign, huggingface, marian_config
from transformer_mt.network.model import Transformer
from transformer_mt.runs import checkpoint

logger = logging.getLogger(__name__)

REPORT_FILE = "import.json"
CONFIG_FILE = files.CONFIG_FILE


def import_model(
    source: Path,
    output: Path,
    src_lang: str | None = None,
    tgt_lang: str | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Import the MarianMTModel directory `source` into `output` (a new directory, or an earlier
    import with `overwrite`); the report of what was imported."""
    source, output = Path(source), Path(output)
    name = None if source.is_dir() else hub_id(source)
    textio.check_path(output)
    if name is not None:
        _check_destination(source, output, overwrite)  # refused before anything is fetched
        source = from_hub(name)
    with textio.OutputLock(output):  # one writer: the checks below hold while it writes
        return _import(source, output, src_lang, tgt_lang, overwrite)


# A Hugging Face model id, OWNER/NAME (huggingface_hub's rule for each part, one slash).
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
# What an import reads, and no more of a model repository (OPUS-MT's hold TensorFlow, Flax and
# Rust weights too): the weights as safetensors, or where a repository has none, as PyTorch's.
_HUB_FILES = ["config.json", "generation_config.json", "tokenizer_config.json",
              "special_tokens_map.json", *marian_tokenizer.FILES]  # fmt: skip
_HUB_WEIGHTS = (
    ["model.safetensors", "model.safetensors.index.json", "model-*.safetensors"],
    ["pytorch_model.bin", "pytorch_model.bin.index.json", "pytorch_model-*.bin"],
)


def hub_id(source: Path) -> str:
    """`-m` that is no directory here as a Hugging Face model id, OWNER/NAME; else one line."""
    name = str(source)
    if source.exists() or not _HUB_ID.fullmatch(name) or ".." in name or "--" in name:
        raise TmtError(f"{source}: no such directory (a MarianMTModel directory, or a Hugging"
                       " Face model id OWNER/NAME)", param="model")  # fmt: skip
    return name


def from_hub(name: str) -> Path:
    """The Hugging Face model `name` (OWNER/NAME) as transformers' from_pretrained finds it (its
    cache, else the Hub; HF_HUB_OFFLINE=1: the cache alone), only the files an import reads: a
    snapshot of the cache, read as any directory."""
    import httpx
    from huggingface_hub import snapshot_download

    try:
        for weights in _HUB_WEIGHTS:
            snapshot = Path(snapshot_download(name, allow_patterns=_HUB_FILES + weights))
            if any(path for pattern in weights for path in snapshot.glob(pattern)):
                break
    # No network and no copy, no such repository, a gated one, offline mode without a copy.
    except (OSError, ValueError, httpx.HTTPError) as err:
        raise TmtError(
            f"{name}: no such directory, and no Hugging Face model {name} in the cache or on"
            f" the Hub ({type(err).__name__}: {first_line(err)})",
            param="model",
        ) from None
    logger.info("%s: the Hugging Face model, from %s", name, snapshot)
    return snapshot


def _import(
    source: Path, output: Path, src_lang: str | None, tgt_lang: str | None, overwrite: bool
) -> dict[str, Any]:
    _check_destination(source, output, overwrite)
    _check_native(source)
    hf_config = marian_config.read(source / "config.json")
    marian_config.check_architecture(source, hf_config)
    tokenizer = marian_config.decoder_side(
        source / "config.json", hf_config, marian_config.read_tokenizer(source)
    )
    cfg, generation = marian_config.tmt_config(source, hf_config, tokenizer, src_lang, tgt_lang)
    weights, weight_files = _read_weights(source)
    checkpoint.check_size(cfg, tokenizer, weights, source)  # config.json's sizes, checked first
    with torch.random.fork_rng(devices=[]), torch.device("meta"):  # shapes only
        shapes = {k: tuple(t.shape) for k, t in _model(cfg, tokenizer).state_dict().items()}
    state = huggingface.from_transformers(weights, cfg.model, shapes, str(source))
    del weights
    shared = {"embedding.weight": "output_projection.weight"}  # §3.4: one tensor, two names
    state.update({alias: state[name] for name, alias in shared.items()})
    missing = sorted(set(shapes) - set(state))
    if missing:  # huggingface.weight_map covers the model: a bug if this fires
        raise TmtError(f"{source}: no weights for {', '.join(missing[:4])}")
    report = {
        "source": str(source.resolve()),
        "files": {
            name: files.sha256_plain(source / name, follow_links=True)
            for name in _source_files(source)
            if name not in weight_files
        }
        | weight_files,
        "architecture": "MarianMTModel",
        "languages": [cfg.data.src_lang, cfg.data.tgt_lang],
        "language_codes": [code[2:-2] for code in tokenizer.language_codes],
        **generation,
    }
    _write(output, cfg, state, tokenizer.model_bytes, report)
    logger.info("imported %s into %s (%s -> %s)", source, output, *report["languages"])
    return {"output": str(output), **report}


def _model(cfg: Config, tokenizer: Any) -> Transformer:
    return Transformer(
        cfg.model, tokenizer.vocab_size, tokenizer.pad_id, tokenizer.source_vocab_size,
        tokenizer.source_pad_id,
    )  # fmt: skip


# --- what the directory holds ------------------------------------------------------------------


def _check_native(source: Path) -> None:
    """A Marian-native model (an .npz and decoder.yml, as OPUS-MT's zips hold them) is not a
    MarianMTModel directory; one with an RNN decoder (OPUS-MT's tiny and small students) cannot
    become one."""
    if (source / "config.json").exists():
        return
    models = sorted(source.glob("*.npz"))
    if not models and not (source / "decoder.yml").exists():
        return  # reading config.json names what is missing
    for path in models:
        spec = _marian_spec(path)
        if spec.get("transformer-decoder-autoreg") == "rnn" or spec.get("dec-cell") == "ssru":
            raise TmtError(
                f"{path}: a Marian model with an RNN (SSRU) decoder (OPUS-MT's tiny and small"
                " models); neither MarianMTModel nor tmt has that decoder"
            )
    raise TmtError(
        f"{source}: a Marian-native model (.npz, decoder.yml), not a MarianMTModel directory;"
        " convert it with transformers' convert_marian_to_pytorch.py, then import that"
    )


def _marian_spec(path: Path) -> dict[str, Any]:
    """The model.yml a Marian .npz carries (its architecture), {} when it has none."""
    import numpy as np
    import yaml

    try:
        with np.load(path, allow_pickle=False) as archive:
            if "special:model.yml" not in archive.files:
                return {}
            text = archive["special:model.yml"].tobytes().rstrip(b"\0").decode("utf-8")
        spec = yaml.safe_load(text)
    except (OSError, ValueError, UnicodeDecodeError, yaml.YAMLError, RecursionError) as err:
        raise TmtError(f"{path}: not a Marian model ({first_line(err)[:160]})") from None
    return spec if isinstance(spec, dict) else {}


def _source_files(source: Path) -> list[str]:
    names = ["config.json", "generation_config.json", "tokenizer_config.json",
             "special_tokens_map.json", *marian_tokenizer.FILES]  # fmt: skip
    return [name for name in names if (source / name).is_file()]


def _read_weights(source: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The weights (float32) of model.safetensors or pytorch_model.bin, sharded or not, read
    without running code; and each file's SHA-256."""
    for name, reader in (("model.safetensors", _safetensors), ("pytorch_model.bin", _pickle)):
        index = source / f"{name}.index.json"
        if index.is_file():
            weight_map = foreign.read(index).mapping("weight_map")
            if not weight_map or not all(isinstance(v, str) for v in weight_map.values()):
                raise TmtError(f"{index}: weight_map: expected a JSON object of name: file")
            shards = sorted(set(map(str, weight_map.values())))
        elif (source / name).is_file():
            shards = [name]
        else:
            continue
        weights: dict[str, torch.Tensor] = {}
        digests = {}
        for shard in shards:
            path = source / shard
            if Path(shard).name != shard or not path.is_file():
                raise TmtError(f"{index}: names {shard!r}, not a file of {source}")
            weights.update(reader(path))
            digests[shard] = files.sha256_plain(path, follow_links=True)
        return weights, digests
    raise TmtError(f"{source}: no model.safetensors nor pytorch_model.bin")


def _safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        from safetensors import SafetensorError
        from safetensors.torch import load_file
    except ImportError:
        raise TmtError(
            f"{path}: reading safetensors needs the safetensors package:"
            ' pip install "transformer_mt[export]"'
        ) from None
    try:
        return {name: _float(t, path, name) for name, t in load_file(str(path)).items()}
    except (SafetensorError, OSError, ValueError) as err:
        raise TmtError(f"{path}: not a safetensors file ({first_line(err)[:160]})") from None


def _pickle(path: Path) -> dict[str, torch.Tensor]:
    """pytorch_model.bin read by torch's safe unpickler (weights_only): memory-mapped when it is
    in torch's zip format, read whole when it is in the legacy format (which has no mmap)."""
    try:
        try:
            loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as err:
            if "mmap" not in str(err):
                raise
            loaded = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise TmtError(
            f"{path}: refused: holds more than tensors and plain values ({first_line(err)[:160]})"
        ) from None
    except (RuntimeError, EOFError, ValueError, OSError) as err:
        raise TmtError(f"{path}: unreadable ({first_line(err)[:160]})") from None
    if not isinstance(loaded, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in loaded.items()
    ):
        raise TmtError(f"{path}: refused: not a mapping of names to tensors")
    return {name: _float(t, path, name) for name, t in loaded.items()}


def _float(tensor: torch.Tensor, path: Path, name: str) -> torch.Tensor:
    """A weight as float32 (tc-big models are stored in float16; tmt computes in float32)."""
    if not tensor.is_floating_point():
        raise TmtError(f"{path}: {name} holds {tensor.dtype}, not a floating-point weight")
    return tensor.float()


# --- writing -----------------------------------------------------------------------------------


def _check_destination(source: Path, output: Path, overwrite: bool) -> None:
    """A new or empty directory, or an earlier import with `overwrite`: one whose manifest
    verifies and that holds nothing tmt did not write there; never the source."""
    if output.exists() and not (output.is_dir() and not output.is_symlink()):
        raise TmtError(f"{output}: exists and is not a directory; choose another output",
                       param="output")  # fmt: skip
    if output.is_dir() and any(output.iterdir()):
        try:
            listed = checkpoint.read_manifest(output)["files"] if (output / REPORT_FILE).is_file(
            ) else None  # fmt: skip
        except TmtError:
            listed = None
        if listed is None:
            raise TmtError(
                f"{output}: exists and is not an empty directory nor a tmt import; choose another"
                " output", param="output",
            )  # fmt: skip
        ours = {*listed, checkpoint.MANIFEST_FILE, CONFIG_FILE, REPORT_FILE}
        foreign = files.foreign_entries(output, ours)
        if foreign:
            raise TmtError(
                f"{output}: holds {foreign[0]}, which tmt did not write there: an import replaces"
                " only its own files; move it, or choose another output", param="output",
            )  # fmt: skip
    if output.resolve() == source.resolve() or source.resolve() in output.resolve().parents:
        raise TmtError(f"{output}: inside the directory imported; choose another output",
                       param="output")  # fmt: skip
    textio.check_output(output, [source], overwrite, directory=True)


def _write(
    output: Path, cfg: Config, state: dict[str, torch.Tensor], tokenizer: bytes,
    report: dict[str, Any],
) -> None:  # fmt: skip
    """The model directory, written whole in a staging directory and renamed into place."""
    root = output.parent
    root.mkdir(parents=True, exist_ok=True)
    files.recover(root, live_writers=True, names=[f"import-{output.name}", output.name])
    staging = root / f".tmp-import-{output.name}-{os.getpid()}"  # all of it, swept if killed
    shutil.rmtree(staging, ignore_errors=True)
    model = staging / output.name
    try:
        # No date in the manifest: the same directory imports to the same bytes.
        checkpoint.write(model, 0, cfg, state, tokenizer, info={"created": "", "imported": True})
        files.atomic_write(model / CONFIG_FILE, to_yaml(cfg).encode())
        files.atomic_write(model / REPORT_FILE, json.dumps(report, indent=1).encode())
        files.swap_into_place(model, output)
    except OSError as err:
        raise TmtError(f"{output}: cannot write the import ({err.strerror or err});"
                       " nothing was left there", exit_code=4) from None  # fmt: skip
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def format_report(report: dict[str, Any]) -> str:
    """The import for people: where it went, the languages, the decoding it reproduces."""
    decode = report["generation"]
    text = (
        f"imported {report['source']} into {report['output']}: {report['languages'][0]} →"
        f" {report['languages'][1]}, decoding as generate does (beam {decode['num_beams']},"
        f" length penalty {decode['length_penalty']}, max_length {decode['max_length']})"
    )
    if report["language_codes"]:
        codes = ", ".join(report["language_codes"][:12])
        text += f"; target languages (--target-lang): {codes}"
    if report["not_reproduced"]:
        text += "; not reproduced: " + ", ".join(sorted(report["not_reproduced"]))
    return text
