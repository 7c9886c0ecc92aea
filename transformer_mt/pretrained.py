"""`tmt import`: a published Hugging Face MarianMTModel directory (OPUS-MT) as a tmt model.

    HF_DIR/config.json                 MarianConfig: sizes, activation, special ids
    HF_DIR/generation_config.json      generate's settings (else those of config.json)
    HF_DIR/model.safetensors           the weights (or pytorch_model.bin; either may be sharded)
    HF_DIR/source.spm, target.spm      the tokenizer: two sentencepiece models ...
    HF_DIR/vocab.json                  ... the vocabulary of their pieces (+ target_vocab.json)
    HF_DIR/tokenizer_config.json       the languages, special tokens, separate_vocabs

become a tmt model directory that every command takes with -m:

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
import shutil
from pathlib import Path
from typing import Any

import torch

from transformer_mt import checkpoint, files, huggingface, marian_tokenizer, textio
from transformer_mt.config import Config, config_from_dict, to_yaml
from transformer_mt.exits import TmtError, first_line
from transformer_mt.model import Transformer

logger = logging.getLogger(__name__)

REPORT_FILE = "import.json"
CONFIG_FILE = files.CONFIG_FILE
_JSON_LIMIT = 1 << 24  # a config or vocabulary of OPUS-MT is a few MB; more is not one
_ACTIVATIONS = {"relu": "relu", "swish": "swish", "silu": "swish", "gelu": "gelu"}
# generate's defaults (transformers.GenerationConfig) for what a directory does not say.
_GENERATE_DEFAULTS = {"num_beams": 1, "max_length": 20, "length_penalty": 1.0,
                      "early_stopping": False}  # fmt: skip
# Settings of generate that tmt's decoding does not have, with the value that means "off".
_NOT_REPRODUCED = {
    "min_length": 0, "min_new_tokens": None, "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0, "repetition_penalty": 1.0, "do_sample": False,
    "renormalize_logits": False, "suppress_tokens": None, "begin_suppress_tokens": None,
    "forced_bos_token_id": None, "num_beam_groups": 1, "diversity_penalty": 0.0,
    "exponential_decay_length_penalty": None, "num_return_sequences": 1,
}  # fmt: skip
# The fine-tuning recipe of an imported model (README "Start from a published model").
FINE_TUNING = {
    "optim": {"schedule": "budget", "warmup_steps": 200, "decay_fraction": 0.2},
    "train": {"max_steps": 2000, "valid_every": 200, "save_every": 200, "save_every_minutes": 0,
              "keep_last": 5, "average_last": 5, "bleu_every": 200, "best_metric": "val_bleu",
              "patience": 3},
}  # fmt: skip
PEAK_LR = 5e-5  # the recipe's peak learning rate: optim.lr_scale is set to reach it


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
    if not source.is_dir():
        raise TmtError(f"{source}: no such directory (a MarianMTModel directory)", param="model")
    _check_destination(source, output, overwrite)
    _check_native(source)
    hf_config = _read_json(source / "config.json")
    _check_architecture(source, hf_config)
    tokenizer = read_tokenizer(source)
    cfg, generation = _config(source, hf_config, tokenizer, src_lang, tgt_lang)
    weights, weight_files = _read_weights(source)
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
            name: files.sha256_plain(source / name)
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
        cfg.model, tokenizer.vocab_size, tokenizer.pad_id, tokenizer.source_vocab_size
    )


# --- what the directory holds ------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(files.read_plain(path, limit=_JSON_LIMIT))
    except FileNotFoundError:
        raise TmtError(f"{path}: no such file (a MarianMTModel directory has it)") from None
    except (OSError, ValueError, RecursionError) as err:
        raise TmtError(f"{path}: unreadable JSON ({first_line(err)[:160]})") from None
    if not isinstance(value, dict):
        raise TmtError(f"{path}: expected a JSON object")
    return value


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
    except (OSError, ValueError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise TmtError(f"{path}: not a Marian model ({first_line(err)[:160]})") from None
    return spec if isinstance(spec, dict) else {}


def _check_architecture(source: Path, hf: dict[str, Any]) -> None:
    """Refuse, in one line, what is not a Transformer MarianMTModel that tmt's model computes."""
    where = source / "config.json"
    kind = hf.get("model_type")
    architectures = hf.get("architectures") or ["MarianMTModel"]
    if kind != "marian" or "MarianMTModel" not in architectures:
        named = f"model_type {kind!r}" + (f" ({', '.join(map(str, architectures))})"
                                           if hf.get("architectures") else "")  # fmt: skip
        raise TmtError(
            f"{where}: {named} is not a MarianMTModel; tmt imports Marian (OPUS-MT) translation"
            " models"
        )
    for key, wanted, what in (
        ("normalize_before", False, "pre-norm layers"),
        ("normalize_embedding", False, "a layer norm of the embeddings"),
        ("add_final_layer_norm", False, "final layer norms"),
        ("scale_embedding", True, "embeddings not scaled by √d_model"),
        ("tie_word_embeddings", True, "an output projection apart from the target embedding"),
    ):
        if key in hf and hf[key] != wanted:
            raise TmtError(f"{where}: {key}={hf[key]} ({what}): not a Marian model tmt reads")
    if _ACTIVATIONS.get(str(hf.get("activation_function", "gelu"))) is None:
        raise TmtError(
            f"{where}: activation_function={hf.get('activation_function')!r}; tmt has"
            f" {', '.join(sorted(_ACTIVATIONS))}"
        )
    for side in ("attention_heads", "ffn_dim"):
        if hf.get(f"encoder_{side}") != hf.get(f"decoder_{side}"):
            raise TmtError(
                f"{where}: encoder_{side}={hf.get(f'encoder_{side}')} and decoder_{side}="
                f"{hf.get(f'decoder_{side}')}; tmt's two stacks have one size"
            )


def read_tokenizer(source: Path) -> marian_tokenizer.MarianTokenizer:
    """The directory's tokenizer files and settings, as one tmt tokenizer."""
    settings = _read_json(source / "tokenizer_config.json") if (
        source / "tokenizer_config.json").exists() else {}  # fmt: skip
    chosen: dict[str, Any] = {}
    for key in marian_tokenizer.DEFAULTS:
        value = settings.get(key, marian_tokenizer.DEFAULTS[key])
        if isinstance(value, dict):  # an AddedToken as JSON
            value = value.get("content")
        if key == "additional_special_tokens":
            value = [v.get("content") if isinstance(v, dict) else v for v in value or []]
        chosen[key] = value
    wanted = [marian_tokenizer.SOURCE_SPM, marian_tokenizer.TARGET_SPM, marian_tokenizer.VOCAB]
    if chosen["separate_vocabs"]:
        wanted.append(marian_tokenizer.TARGET_VOCAB)
    content = {}
    for name in wanted:
        try:
            content[name] = files.read_plain(source / name, limit=1 << 28)
        except FileNotFoundError:
            exported = (source / "tmt_export.json").is_file() and (
                source / "tokenizer.json"
            ).exists()
            raise TmtError(
                f"{source / name}: no such file (Marian's tokenizer: source.spm, target.spm,"
                " vocab.json, and target_vocab.json with separate_vocabs)"
                + ("; this is tmt's export of its own model: use that model" if exported else "")
            ) from None
        except OSError as err:
            raise TmtError(f"{source / name}: cannot read ({err.strerror or err})") from None
    return marian_tokenizer.MarianTokenizer(
        marian_tokenizer.pack(content, chosen), origin=str(source)
    )


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
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise TmtError(f"{index}: no weight_map")
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
            digests[shard] = files.sha256_plain(path)
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
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
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


# --- the tmt config of the model ---------------------------------------------------------------


def _config(
    source: Path,
    hf: dict[str, Any],
    tokenizer: marian_tokenizer.MarianTokenizer,
    src_lang: str | None,
    tgt_lang: str | None,
) -> tuple[Config, dict[str, Any]]:
    """The tmt config of the model: its shape, its languages, decoding as generate decodes it,
    the fine-tuning recipe; and what of generate's settings tmt reproduces and what it does not."""
    where = source / "config.json"
    _check_ids(where, hf, tokenizer)
    settings = _read_json(source / "tokenizer_config.json") if (
        source / "tokenizer_config.json").exists() else {}  # fmt: skip
    langs = [src_lang or settings.get("source_lang"), tgt_lang or settings.get("target_lang")]
    for lang, flag in zip(langs, ("src_lang", "tgt_lang"), strict=True):
        if not lang or not isinstance(lang, str):
            raise TmtError(
                f"{source / 'tokenizer_config.json'}: no {flag.replace('_lang', 'ce_lang')}"
                f" (the model's languages); give it with {{{flag}}}", mentions=[flag],
            )  # fmt: skip
    d_model, positions = int(hf.get("d_model", 0)), int(hf.get("max_position_embeddings", 0))
    model = {
        "d_model": d_model, "d_ff": hf.get("encoder_ffn_dim"),
        "n_heads": hf.get("encoder_attention_heads"),
        "n_encoder_layers": hf.get("encoder_layers"),
        "n_decoder_layers": hf.get("decoder_layers"), "dropout": hf.get("dropout", 0.1),
        "attention_dropout": hf.get("attention_dropout", 0.0), "max_positions": positions,
        "pre_norm": False, "activation": _ACTIVATIONS[str(hf.get("activation_function", "gelu"))],
        "output_bias": True, "decoder_start": "pad",
        "share_embeddings": bool(hf.get("share_encoder_decoder_embeddings", True)),
    }  # fmt: skip
    decode, generation = _decoding(source, hf, tokenizer)
    warmup = FINE_TUNING["optim"]["warmup_steps"]
    tree = {
        "model": model,
        "tokenizer": {"vocab_size": max(tokenizer.vocab_size, 8), "model_type": "unigram"},
        "data": {
            "src_lang": langs[0],
            "tgt_lang": langs[1],
            "max_len": min(256, max(positions - 1, 1)),
        },
        "optim": {
            **FINE_TUNING["optim"],
            "lr_scale": round(PEAK_LR * (max(d_model, 1) * warmup) ** 0.5, 6),
        },
        "train": {**FINE_TUNING["train"], "out_dir": f"runs/{source.resolve().name}-finetuned"},
        "decode": decode,
    }
    try:
        cfg = config_from_dict(tree, origin=str(where))
    except TmtError as err:
        raise TmtError(f"{where}: not a model tmt can hold ({err})") from None
    return cfg, generation


def _check_ids(
    where: Path, hf: dict[str, Any], tokenizer: marian_tokenizer.MarianTokenizer
) -> None:
    """The config's special ids and vocabulary sizes are the tokenizer's (read from its files)."""
    expected = {
        "pad_token_id": tokenizer.pad_id, "eos_token_id": tokenizer.eos_id,
        "decoder_start_token_id": tokenizer.pad_id, "vocab_size": tokenizer.source_vocab_size,
        "decoder_vocab_size": tokenizer.vocab_size,
    }  # fmt: skip
    for key, value in expected.items():
        found = hf.get(key, value)
        if key == "decoder_vocab_size" and found is None:
            found = hf.get("vocab_size")
        if found != value:
            what = "vocabulary" if key.endswith("vocab_size") else "tokenizer"
            raise TmtError(f"{where}: {key}={found}, but its {what} says {value}")


def _decoding(
    source: Path, hf: dict[str, Any], tokenizer: marian_tokenizer.MarianTokenizer
) -> tuple[dict[str, Any], dict[str, Any]]:
    """tmt's decode settings for generate's: beam, maximum length, length penalty (|Y|^α, </s>
    counted), its stopping rule; and the generation settings tmt does not reproduce."""
    path = source / "generation_config.json"
    settings = _read_json(path) if path.exists() else {k: v for k, v in hf.items()
                                                        if k in _GENERATE_DEFAULTS}  # fmt: skip
    given = {**_GENERATE_DEFAULTS, **{k: v for k, v in settings.items() if v is not None}}
    beams = given["num_beams"]
    if not isinstance(beams, int) or beams < 1:
        raise TmtError(f"{path}: num_beams={beams!r}: expected a number >= 1")
    limit = given.get("max_new_tokens") or int(given["max_length"]) - 1  # </s> included
    if limit < 1:
        raise TmtError(f"{path}: max_length={given['max_length']}: leaves no room for a token")
    stopping = {value: rule for rule, value in huggingface.EARLY_STOPPING.items()}
    if given["early_stopping"] not in stopping:
        raise TmtError(f"{path}: early_stopping={given['early_stopping']!r}: expected"
                       " true, false or \"never\"")  # fmt: skip
    decode = {
        "beam_size": beams, "length_penalty": float(given["length_penalty"]),
        "length_penalty_form": "power", "early_stopping": stopping[given["early_stopping"]],
        "max_len_a": 0.0, "max_len_b": int(limit),
    }  # fmt: skip
    ignored = {k: v for k, v in settings.items() if k in _NOT_REPRODUCED
               and v not in (_NOT_REPRODUCED[k], None, [])}  # fmt: skip
    banned = settings.get("bad_words_ids")
    if banned not in (None, [[tokenizer.pad_id]]):
        ignored["bad_words_ids"] = banned
    if settings.get("forced_eos_token_id") not in (None, tokenizer.eos_id):
        ignored["forced_eos_token_id"] = settings["forced_eos_token_id"]
    if ignored:
        logger.warning(
            "%s: tmt does not reproduce %s", path.name,
            ", ".join(f"{k}={v}" for k, v in sorted(ignored.items())),
        )  # fmt: skip
    return decode, {"generation": {k: given[k] for k in sorted(given)},
                    "not_reproduced": ignored}  # fmt: skip


# --- writing -----------------------------------------------------------------------------------


def _check_destination(source: Path, output: Path, overwrite: bool) -> None:
    """A new or empty directory, or an earlier import with `overwrite`; never the source."""
    if output.exists() and not (output.is_dir() and not output.is_symlink()):
        raise TmtError(f"{output}: exists and is not a directory; choose another output",
                       param="output")  # fmt: skip
    if output.is_dir() and any(output.iterdir()) and not (output / REPORT_FILE).is_file():
        raise TmtError(
            f"{output}: exists and is not an empty directory nor a tmt import; choose another"
            " output", param="output",
        )  # fmt: skip
    if output.resolve() == source.resolve() or source.resolve() in output.resolve().parents:
        raise TmtError(f"{output}: inside the directory imported; choose another output",
                       param="output")  # fmt: skip
    textio.check_output(output, [source], overwrite)


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
