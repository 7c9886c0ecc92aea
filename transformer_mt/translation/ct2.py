"""CTranslate2 as a decoding engine: tmt's weights converted to a CTranslate2 model, the directory
that holds it, and decoding with it.

An export directory (`tmt export --format ctranslate2`, or the cache `tmt translate --engine
ctranslate2` makes beside a model) holds the CTranslate2 model (model.bin, config.json,
shared_vocabulary.json), the sentencepiece model (sentencepiece.model) and tmt_export.json: what
was exported, the SHA-256 of those files and tmt's config. Reading it back verifies the files
against their checksums first: a directory tmt wrote is checked, not trusted.

Decoding keeps tmt's rules where CTranslate2 has them: the source is the line's pieces + EOS
(add_source_eos), pad and bos are never output, an empty output is allowed
(min_decoding_length=0), and a line's output has at most a · |x| + b - 1 tokens (+ its EOS).
Beam search is CTranslate2's own: score / |Y|^α and its stopping rule.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from transformer_mt.common import files
from transformer_mt.common.exits import TmtError
from transformer_mt.config import Config, DecodeConfig, apply_overrides, config_from_dict, to_dict
from transformer_mt.data.marian_tokenizer import MarianTokenizer, pack
from transformer_mt.data.tokenizer import Tokenizer
from transformer_mt.network.model import Transformer
from transformer_mt.network.search import Hypothesis

REPORT_FILE = "tmt_export.json"
SENTENCEPIECE_FILE = "sentencepiece.model"
MODEL_FILES = ("model.bin", "config.json", "shared_vocabulary.json", SENTENCEPIECE_FILE)
# An imported Marian model: its vocabularies (one shared, or one a side) and its tokenizer files.
VOCABULARY_FILES = ("shared_vocabulary.json", "source_vocabulary.json", "target_vocabulary.json")
MARIAN_FILES = ("source.spm", "target.spm", "vocab.json", "target_vocab.json")
# A lexical shortlist as CTranslate2's vocabulary map (tmt export --shortlist): "source piece<TAB>
# target pieces", the line with no source listing the pieces always allowed.
VMAP_FILE = "vmap.txt"
# CTranslate2's activations for tmt's model.activation (gelu: the exact erf, as tmt's).
ACTIVATIONS = {"relu": "RELU", "swish": "SWISH", "gelu": "GELU"}
EXTRA = 'pip install "transformer_mt[export]"'
logger = logging.getLogger(__name__)
# decode.precision -> CTranslate2's compute type (what the weights are computed in once loaded)
COMPUTE_TYPES = {"fp32": "float32", "int8": "int8", "fp16": "float16", "bf16": "bfloat16"}


def require() -> Any:
    """The ctranslate2 package, or one line saying how to install it."""
    try:
        import ctranslate2
    except ImportError:
        raise TmtError(
            f"decode.engine=ctranslate2 needs the ctranslate2 package: {EXTRA}"
        ) from None
    return ctranslate2


def is_export(path: Path) -> bool:
    """Whether `path` is a CTranslate2 export directory (tmt's or the cache's)."""
    return path.is_dir() and (path / REPORT_FILE).is_file() and (path / "model.bin").is_file()


# --- writing -----------------------------------------------------------------------------------


def save(
    directory: Path, model: Transformer, tokenizer: Tokenizer, cfg: Config, quantization: str | None
) -> None:
    """Write the CTranslate2 model (weights stored in `quantization`, None: float32) and the
    sentencepiece model into `directory` (created)."""
    spec = convert(model, tokenizer, cfg)
    if quantization:
        spec.optimize(quantization=quantization)
    directory.mkdir(parents=True)
    spec.save(str(directory))
    for name, content in tokenizer_files(tokenizer).items():
        files.atomic_write(directory / name, content)


def tokenizer_files(tokenizer: Tokenizer) -> dict[str, bytes]:
    """What turns text into an export's pieces and back: the sentencepiece model, or an imported
    Marian model's two and their vocabularies (the export's README reads them)."""
    if tokenizer.kind == "marian":
        return dict(tokenizer.files)
    return {SENTENCEPIECE_FILE: tokenizer.model_bytes}


def write_report(
    directory: Path, report: dict[str, Any], cfg: Config, tokenizer: Tokenizer
) -> dict[str, Any]:
    """tmt_export.json: `report`, tmt's config (what the engine needs to decode as tmt) and the
    SHA-256 of each model file (what reading it back verifies)."""
    names = ["model.bin", "config.json", *VOCABULARY_FILES, SENTENCEPIECE_FILE, *MARIAN_FILES,
             VMAP_FILE]  # fmt: skip
    checksums = {
        name: files.sha256_file(directory / name) for name in names if (directory / name).is_file()
    }
    full = {**report, "sha256": checksums, "config": to_dict(cfg)}
    if tokenizer.kind == "marian":  # its settings (its files have their checksums above)
        full["tokenizer_settings"] = tokenizer.settings
    files.atomic_write(directory / REPORT_FILE, json.dumps(full, indent=1).encode())
    return full


def convert(model: Transformer, tokenizer: Tokenizer, cfg: Config) -> Any:
    """tmt's weights as a ctranslate2 TransformerSpec (float32, not yet optimized)."""
    require()
    from ctranslate2.converters.utils import fuse_linear
    from ctranslate2.specs import common_spec, transformer_spec

    m, tok, ours, d = cfg.model, tokenizer, model, cfg.model.d_model
    spec = transformer_spec.TransformerSpec.from_config(
        (m.n_encoder_layers, m.n_decoder_layers), m.n_heads, pre_norm=m.pre_norm,
        activation=getattr(common_spec.Activation, ACTIVATIONS[m.activation]),
    )  # fmt: skip

    def array(t: torch.Tensor) -> Any:
        return t.detach().float().cpu().numpy().copy()

    def linear(target: Any, weight: torch.Tensor, bias: torch.Tensor) -> None:
        target.weight, target.bias = array(weight), array(bias)

    def norm(target: Any, layer: torch.nn.LayerNorm) -> None:
        target.gamma, target.beta = array(layer.weight), array(layer.bias)

    def self_attention_and_ffn(layer_spec: Any, layer: Any, attn_norm: Any) -> None:
        # tmt's stacked in_proj (Q, K, V rows) is CTranslate2's fused self-attention input.
        attn = layer.self_attn
        linear(layer_spec.self_attention.linear[0], attn.in_proj.weight, attn.in_proj.bias)
        linear(layer_spec.self_attention.linear[1], attn.out_proj.weight, attn.out_proj.bias)
        norm(layer_spec.self_attention.layer_norm, attn_norm)
        linear(layer_spec.ffn.linear_0, layer.ffn.linear1.weight, layer.ffn.linear1.bias)
        linear(layer_spec.ffn.linear_1, layer.ffn.linear2.weight, layer.ffn.linear2.bias)
        norm(layer_spec.ffn.layer_norm, layer.ffn_sub.norm)

    source = ours.embedding if ours.source_embedding is None else ours.source_embedding
    for stack, final_norm in ((spec.encoder, ours.encoder_norm), (spec.decoder, ours.decoder_norm)):
        embeddings = stack.embeddings[0] if isinstance(stack.embeddings, list) else stack.embeddings
        # One matrix, 3-way tied (§3.4); the source's own with model.share_embeddings false.
        embeddings.weight = array((source if stack is spec.encoder else ours.embedding).weight)
        stack.position_encodings.encodings = array(ours.embedding.positions[: m.max_positions])
        stack.scale_embeddings = True
        if m.pre_norm:
            norm(stack.layer_norm, final_norm)
    spec.decoder.projection.weight = array(ours.embedding.weight)
    if ours.output_projection.bias is not None:  # model.output_bias
        spec.decoder.projection.bias = array(ours.output_projection.bias)
    for layer_spec, layer in zip(spec.encoder.layer, ours.encoder_layers, strict=True):
        self_attention_and_ffn(layer_spec, layer, layer.attn_sub.norm)
    for layer_spec, layer in zip(spec.decoder.layer, ours.decoder_layers, strict=True):
        self_attention_and_ffn(layer_spec, layer, layer.self_sub.norm)
        cross = layer.cross_attn
        w, b = cross.in_proj.weight, cross.in_proj.bias
        linear(layer_spec.attention.linear[0], w[:d], b[:d])  # W^Q
        kv = common_spec.LinearSpec()
        linear(kv, w[d:], b[d:])  # W^K, W^V: CTranslate2's fused key/value projection
        fuse_linear(layer_spec.attention.linear[1], [kv])
        linear(layer_spec.attention.linear[2], cross.out_proj.weight, cross.out_proj.bias)
        norm(layer_spec.attention.layer_norm, layer.cross_sub.norm)
    _vocabularies(spec, tok, m.decoder_start)
    spec.validate()
    return spec


def _vocabularies(spec: Any, tok: Tokenizer, decoder_start: str) -> None:
    """The pieces of each side (one joint list, or Marian's two) and the special pieces."""
    pieces = tok.pieces("target")
    spec.register_source_vocabulary(tok.pieces("source"))
    spec.register_target_vocabulary(pieces)
    spec.config.add_source_eos = True  # tmt's source is x + eos
    start = pieces[tok.start_id(decoder_start)]  # <s>, or <pad> (Marian's: it has no <s>)
    spec.config.decoder_start_token = start
    spec.config.bos_token = pieces[tok.bos_id] if tok.bos_id >= 0 else start
    spec.config.eos_token, spec.config.unk_token = pieces[tok.eos_id], pieces[tok.unk_id]


# --- reading -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Export:
    """An export directory read back and verified: what decoding with it needs."""

    directory: Path
    tokenizer: Tokenizer
    config: Config  # tmt's config of the exported model
    report: dict[str, Any]  # tmt_export.json
    fingerprint: str  # SHA-256 over the model files' checksums: the model, as a job knows it

    @property
    def has_vmap(self) -> bool:
        return VMAP_FILE in self.report.get("sha256", {})


def read(directory: Path) -> Export:
    """The export at `directory`, its files verified against tmt_export.json."""
    where = directory / REPORT_FILE
    try:
        report = json.loads(files.read_plain(where, limit=1 << 22, follow_links=True))
    except (OSError, ValueError, RecursionError) as err:
        raise TmtError(f"{where}: unreadable ({_reason(err)}); export the model again") from None
    checksums = report.get("sha256") if isinstance(report, dict) else None
    if not isinstance(checksums, dict) or "config" not in report:
        raise TmtError(
            f"{where}: no checksums or config (an export of an earlier tmt); export the model"
            " again with this one"
        )
    marian = "source.spm" in checksums
    required = ["model.bin", "config.json", *(MARIAN_FILES[:3] if marian else [SENTENCEPIECE_FILE])]
    allowed = {"model.bin", "config.json", *VOCABULARY_FILES, SENTENCEPIECE_FILE, *MARIAN_FILES,
               VMAP_FILE}  # fmt: skip
    if not set(required) <= set(checksums) <= allowed:
        raise TmtError(f"{where}: lists other files than an export has; export the model again")
    for name in checksums:
        try:
            found = files.sha256_plain(directory / name, follow_links=True)
        except OSError as err:
            raise TmtError(f"{directory / name}: unreadable ({_reason(err)})") from None
        if found != checksums.get(name):
            raise TmtError(
                f"{directory / name}: does not match its checksum in {REPORT_FILE} (changed or"
                " damaged); export the model again"
            )
    cfg = config_from_dict(report["config"], origin=f"{where} config")
    if marian:
        content = {name: (directory / name).read_bytes() for name in MARIAN_FILES
                   if name in checksums}  # fmt: skip
        settings = report.get("tokenizer_settings")
        tokenizer = MarianTokenizer(pack(content, settings if isinstance(settings, dict) else {}),
                                    str(directory))  # fmt: skip
    else:
        tokenizer = Tokenizer((directory / SENTENCEPIECE_FILE).read_bytes(), str(directory))
    digest = hashlib.sha256(json.dumps(checksums, sort_keys=True).encode()).hexdigest()
    return Export(directory, tokenizer, cfg, report, digest)


def load(export: Export, device: torch.device, precision: str, threads: int) -> Any:
    """A ctranslate2.Translator of `export` on `device`, computing in `precision`."""
    ctranslate2 = require()
    kind = "cuda" if device.type == "cuda" else "cpu"
    compute_type = COMPUTE_TYPES[precision]
    supported = ctranslate2.get_supported_compute_types(kind)
    if compute_type not in supported:
        raise TmtError(
            f"decode.precision={precision}: CTranslate2 has no {compute_type} on this {kind}"
            f" (it has {', '.join(sorted(supported))}); choose another precision or device"
        )
    try:
        return ctranslate2.Translator(
            str(export.directory), device=kind, device_index=device.index or 0,
            compute_type=compute_type, intra_threads=threads if kind == "cpu" else 0,
        )  # fmt: skip
    except (RuntimeError, ValueError) as err:
        raise TmtError(f"{export.directory}: CTranslate2 cannot load it ({err})") from None


def _reason(err: BaseException) -> str:
    return (err.strerror if isinstance(err, OSError) else None) or str(err).split("\n")[0]


def write_vmap(directory: Path, table: Any, tokenizer: Tokenizer) -> int:
    """A lexical shortlist (shortlist.Shortlist) as CTranslate2's vocabulary map; its lines."""
    never = set(tokenizer.never_output)

    def pieces(ids: Any) -> str:
        return " ".join(tokenizer.id_to_piece(int(t)) for t in ids if int(t) not in never)

    rows = ["\t" + pieces(table.frequent)]
    for source in range(len(table.offsets) - 1):
        targets = table.targets[table.offsets[source] : table.offsets[source + 1]]
        if len(targets):
            rows.append(f"{tokenizer.id_to_piece(source, side='source')}\t{pieces(targets)}")
    files.atomic_write(directory / VMAP_FILE, ("\n".join(rows) + "\n").encode("utf-8"))
    return len(rows)


# --- decoding ----------------------------------------------------------------------------------


def decode(
    engine: Any,
    tokenizer: Tokenizer,
    sources: Sequence[Sequence[int]],
    limits: Sequence[int],
    decode_cfg: DecodeConfig,
    prefixes: Sequence[Sequence[int]] = (),
    use_vmap: bool = False,
) -> list[list[Hypothesis]]:
    """The n-best of each source (ids, without EOS) by CTranslate2; `limits`: each output's
    maximum length, its EOS included (sources.output_limits); `prefixes`: target prefixes each
    output starts with (CTranslate2's target_prefix), or none.

    CTranslate2 takes one maximum length per call: the batch is decoded to its largest limit and
    each row is cut at its own. Greedy rows do not depend on each other, so this is exactly tmt's
    forced end of sentence; a beam row that reaches its limit (a looping output, ~1 % of lines)
    keeps the best hypothesis CTranslate2 found, cut. Decoding those rows again, one call per
    limit, cost more than the whole batch (measured: 10 one-sentence calls of ~70 steps, 1.5 s
    against 1.7 s for 1,000 sentences)."""

    def piece(token: int, side: str = "target") -> str:
        return tokenizer.id_to_piece(token, side=side)

    index = tokenizer.piece_to_id
    results = engine.translate_batch(
        [[piece(t, "source") for t in seq] for seq in sources],
        target_prefix=[[piece(t) for t in seq] for seq in prefixes] or None,
        max_batch_size=len(sources),
        max_decoding_length=max(max(limits) - 1, 1),
        beam_size=decode_cfg.beam_size,
        num_hypotheses=decode_cfg.nbest,
        length_penalty=decode_cfg.length_penalty,
        min_decoding_length=0,  # an empty output is allowed, as in tmt
        return_scores=True,
        suppress_sequences=[[piece(token)] for token in tokenizer.never_output],
        **({"use_vmap": True} if use_vmap else {}),  # the batch's union of candidates
    )
    # CTranslate2 gives the normalised score only: it stands for the log-probability too.
    return [
        [Hypothesis([index(p) for p in hyp[: limit - 1]], float(score), float(score))
         for hyp, score in zip(result.hypotheses, result.scores, strict=True)]
        for result, limit in zip(results, limits, strict=True)
    ]  # fmt: skip


# --- the export `--engine ctranslate2` keeps beside a model --------------------------------------


def cache_name(precision: str, fingerprint: str) -> str:
    """One export per model (its weights' fingerprint) and stored precision."""
    stored = "int8" if precision == "int8" else "float32"
    return f"ctranslate2-{stored}-{fingerprint[:16]}"


def writable(directory: Path) -> bool:
    return os.access(directory, os.W_OK | os.X_OK)


@contextlib.contextmanager
def cache_lock(root: Path) -> Iterator[None]:
    """Held while a cache in `root` is checked or made: a second process waits for the first."""
    with open(root / ".ctranslate2.lock", "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def read_cache(final: Path, made_from: str) -> Export | None:
    """The cache at `final`, or None when there is none, it is damaged, or it was not made from
    the model whose fingerprint is `made_from` (its report names the model; a name alone proves
    nothing): then it is removed, and made again, not trusted."""
    if not final.is_dir():
        return None
    try:
        export = read(final)
    except TmtError as err:
        logger.warning("%s; making it again", err)
        shutil.rmtree(final, ignore_errors=True)
        return None
    if export.report.get("made_from") != made_from:
        logger.warning(
            "%s: not made from this model (its report names another, or none); making it again",
            final,
        )
        shutil.rmtree(final, ignore_errors=True)
        return None
    return export


@dataclass(frozen=True)
class Check:
    """What a cache must reproduce: tmt's greedy output ids of `lines` (sources `ids`, maximum
    output lengths `limits`)."""

    lines: list[str]
    ids: list[list[int]]
    limits: list[int]
    expected: list[list[int]]


def make_cache(
    final: Path,
    model: Transformer,
    tokenizer: Tokenizer,
    cfg: Config,
    report: dict[str, Any],
    check: Check,
) -> None:
    """Convert, check the float32 conversion's greedy outputs against `check`, then store it in
    cfg.decode.precision (int8 or float32), in a staging directory renamed into place."""
    stored = apply_overrides(cfg, ["decode.engine=ctranslate2", "decode.device=auto",
                                   "decode.precision=fp32"])  # fmt: skip
    greedy = dataclasses.replace(cfg.decode, beam_size=1, nbest=1)
    staging = final.parent / f".tmp-{final.name}-{os.getpid()}"
    files.recover(final.parent, live_writers=True, names=[final.name])
    shutil.rmtree(staging, ignore_errors=True)
    try:
        save(staging, model, tokenizer, cfg, None)
        write_report(staging, report, stored, tokenizer)
        engine = load(read(staging), torch.device("cpu"), "fp32", torch.get_num_threads())
        found = decode(engine, tokenizer, check.ids, check.limits, greedy)
        for i, (ours, theirs) in enumerate(zip(check.expected, found, strict=True)):
            if ours != theirs[0].tokens:
                raise TmtError(
                    f"{report['source']}: its CTranslate2 conversion differs from tmt on line"
                    f" {i + 1} of the check ({check.lines[i][:60]!r}); use decode.engine=torch"
                )
        if cfg.decode.precision == "int8":  # stored in int8 once the float32 conversion matched
            shutil.rmtree(staging)
            save(staging, model, tokenizer, cfg, "int8")
            write_report(staging, report | {"quantization": "int8"}, stored, tokenizer)
        files.swap_into_place(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
