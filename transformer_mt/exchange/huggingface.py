"""tmt's model and tokenizer as Hugging Face transformers objects (what `tmt export --format
huggingface` writes, and what scripts/bench_decode.py measures as a peer).

A post-norm model is a MarianMTModel; a pre-norm one a PegasusForConditionalGeneration (pre-norm
sublayers, final layer norms, sinusoidal positions). Both lay their sinusoids out as [sin | cos]
where tmt interleaves them, so the conversion relabels the model dimension with that one
permutation through every weight: the same network. The tokenizer is the sentencepiece model
rebuilt with `tokenizers` (the same ids, </s> appended to the source as tmt does), so
`AutoTokenizer.from_pretrained` loads it. Needs the export extra (transformers, tokenizers).
"""

from __future__ import annotations

import logging
import tempfile
import warnings
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from transformer_mt.common.exits import TmtError
from transformer_mt.config import Config, ModelConfig
from transformer_mt.data.tokenizer import Tokenizer
from transformer_mt.network.model import sinusoidal_positions
from transformer_mt.translation.translate import Translator

logger = logging.getLogger(__name__)


def transformers_module() -> ModuleType:
    """transformers, with the model classes tmt uses loaded, minus what loading them prints:
    with torchao installed (the int8 extra) transformers imports it, and it logs the GPU kernels
    it cannot load on this machine, that it found no Triton, and torch's notes on its enums,
    none of which is the user's news."""
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import transformers

            # Their modules load lazily, on first use: now, while it is quiet.
            transformers.MarianMTModel, transformers.PegasusForConditionalGeneration  # noqa: B018
            transformers.AutoModelForSeq2SeqLM  # noqa: B018
    finally:
        logging.disable(logging.NOTSET)
    return transformers


def model(translator: Translator) -> tuple[Any, str]:
    """tmt's weights in MarianMTModel (post-norm) or PegasusForConditionalGeneration (pre-norm),
    with the model dimension relabelled from tmt's interleaved sinusoids to their [sin | cos]."""
    transformers = transformers_module()

    m, tok, cfg = translator.config.model, translator.tokenizer, translator.config
    start = tok.start_id(m.decoder_start)
    common = dict(
        vocab_size=tok.source_vocab_size, d_model=m.d_model, encoder_layers=m.n_encoder_layers,
        decoder_layers=m.n_decoder_layers, encoder_attention_heads=m.n_heads,
        decoder_attention_heads=m.n_heads, encoder_ffn_dim=m.d_ff, decoder_ffn_dim=m.d_ff,
        activation_function=m.activation, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, max_position_embeddings=m.max_positions, scale_embedding=True,
        pad_token_id=tok.pad_id, eos_token_id=tok.eos_id, bos_token_id=max(tok.bos_id, 0),
        decoder_start_token_id=start, forced_eos_token_id=None, tie_word_embeddings=True,
    )  # fmt: skip
    if m.pre_norm:
        architecture = "PegasusForConditionalGeneration"
        config = transformers.PegasusConfig(**common)
    else:
        architecture = "MarianMTModel"
        config = transformers.MarianConfig(
            **common, decoder_vocab_size=tok.vocab_size,
            share_encoder_decoder_embeddings=m.share_embeddings,
        )  # fmt: skip
    model = getattr(transformers, architecture)(config).eval()
    weights = to_transformers(translator.model.state_dict(), m)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or set(missing) - set(_IGNORED):
        raise TmtError(f"huggingface: {architecture} does not take {unexpected or missing}")
    model.generation_config = transformers.GenerationConfig(**generation_settings(cfg, tok))
    if cfg.decode.length_penalty_form != "power" and cfg.decode.beam_size > 1:
        logger.warning(
            "generate normalises beam scores by |Y|^α; this model's decode settings use the GNMT"
            " form: beam outputs may differ from tmt's (greedy ones do not)"
        )
    return model, architecture


# generate's early_stopping for each of tmt's rules (search.py), both ways.
EARLY_STOPPING = {"bound": "never", "current": False, "k_finished": True}


def generation_settings(cfg: Config, tok: Tokenizer) -> dict[str, Any]:
    """generate's defaults for this model: tmt's decode settings (the checkpoint's own). A model
    with a fixed maximum length (max_len_a 0, what an import of generate's settings gives) ends
    there with a forced </s>, as tmt does; tmt's own models keep the positions as the limit."""
    decode = cfg.decode
    settings: dict[str, Any] = {
        "decoder_start_token_id": tok.start_id(cfg.model.decoder_start),
        "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id, "bos_token_id": max(tok.bos_id, 0),
        "bad_words_ids": [[token] for token in tok.never_output],
        "max_length": cfg.model.max_positions,
    }  # fmt: skip
    if decode.max_len_a == 0:
        limit = min(decode.max_len_b, cfg.model.max_positions)  # the </s> included
        settings |= {"max_length": limit + 1, "forced_eos_token_id": tok.eos_id}
    if decode.beam_size > 1:
        settings |= {
            "num_beams": decode.beam_size, "length_penalty": decode.length_penalty,
            "early_stopping": EARLY_STOPPING[decode.early_stopping],
        }  # fmt: skip
    return settings


# --- the name map: every weight of a tmt model and its name in transformers, read both ways ---


@dataclass(frozen=True)
class Weight:
    """A weight of tmt's model (`ours`) and the one it is in MarianMTModel or Pegasus (`theirs`).
    `axis` says where the model dimension is, which the sinusoids' two layouts number apart:
    "in" (the columns), "out" (the rows, or the vector), "" (none). tmt stacks W^Q, W^K, W^V in
    one in_proj; `part` is a third of it (0, 1, 2), -1 the whole tensor."""

    ours: str
    theirs: str
    axis: str
    part: int = -1


# transformers' names that hold a copy of another (tied) weight, and the sinusoid tables it
# recomputes when it loads: written by the export, checked by the import, never a weight.
_IGNORED = ("model.encoder.embed_positions.weight", "model.decoder.embed_positions.weight")


def weight_map(m: ModelConfig) -> list[Weight]:
    """Every weight of a tmt model of `m` with its transformers name (post-norm: MarianMTModel;
    pre-norm: Pegasus, which adds the stacks' final norms)."""

    def attention(ours: str, theirs: str) -> list[Weight]:
        return [
            *(Weight(f"{ours}.in_proj.weight", f"{theirs}.{n}_proj.weight", "in", i)
              for i, n in enumerate("qkv")),
            *(Weight(f"{ours}.in_proj.bias", f"{theirs}.{n}_proj.bias", "", i)
              for i, n in enumerate("qkv")),
            Weight(f"{ours}.out_proj.weight", f"{theirs}.out_proj.weight", "out"),
            Weight(f"{ours}.out_proj.bias", f"{theirs}.out_proj.bias", "out"),
        ]  # fmt: skip

    def norm(ours: str, theirs: str) -> list[Weight]:
        return [Weight(f"{ours}.{p}", f"{theirs}.{q}", "out")
                for p, q in (("weight", "weight"), ("bias", "bias"))]  # fmt: skip

    def ffn(ours: str, theirs: str) -> list[Weight]:
        return [
            Weight(f"{ours}.ffn.linear1.weight", f"{theirs}.fc1.weight", "in"),
            Weight(f"{ours}.ffn.linear1.bias", f"{theirs}.fc1.bias", ""),
            Weight(f"{ours}.ffn.linear2.weight", f"{theirs}.fc2.weight", "out"),
            Weight(f"{ours}.ffn.linear2.bias", f"{theirs}.fc2.bias", "out"),
            *norm(f"{ours}.ffn_sub.norm", f"{theirs}.final_layer_norm"),
        ]

    if m.share_embeddings:
        weights = [Weight("embedding.weight", "model.shared.weight", "in")]
    else:
        weights = [
            Weight("source_embedding.weight", "model.encoder.embed_tokens.weight", "in"),
            Weight("embedding.weight", "model.decoder.embed_tokens.weight", "in"),
        ]
    for i in range(m.n_encoder_layers):
        ours, theirs = f"encoder_layers.{i}", f"model.encoder.layers.{i}"
        weights += attention(f"{ours}.self_attn", f"{theirs}.self_attn")
        weights += norm(f"{ours}.attn_sub.norm", f"{theirs}.self_attn_layer_norm")
        weights += ffn(ours, theirs)
    for i in range(m.n_decoder_layers):
        ours, theirs = f"decoder_layers.{i}", f"model.decoder.layers.{i}"
        weights += attention(f"{ours}.self_attn", f"{theirs}.self_attn")
        weights += norm(f"{ours}.self_sub.norm", f"{theirs}.self_attn_layer_norm")
        weights += attention(f"{ours}.cross_attn", f"{theirs}.encoder_attn")
        weights += norm(f"{ours}.cross_sub.norm", f"{theirs}.encoder_attn_layer_norm")
        weights += ffn(ours, theirs)
    if m.pre_norm:
        weights += norm("encoder_norm", "model.encoder.layer_norm")
        weights += norm("decoder_norm", "model.decoder.layer_norm")
    if m.output_bias:
        weights.append(Weight("output_projection.bias", "final_logits_bias", ""))
    return weights


def tied_copies(m: ModelConfig) -> dict[str, str]:
    """transformers' names of the tied copies of an embedding, each with the name it copies."""
    target = "model.shared.weight" if m.share_embeddings else "model.decoder.embed_tokens.weight"
    copies = {"lm_head.weight": target}
    if m.share_embeddings:
        copies |= {f"model.{s}.embed_tokens.weight": target for s in ("encoder", "decoder")}
    return copies


def _permutation(d: int) -> torch.Tensor:
    """transformers' dimension j is tmt's dimension perm[j]: sines first, then cosines (§3.5's
    PE(pos, 2i) and PE(pos, 2i+1), which tmt interleaves)."""
    return torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])


def _relabel(tensor: torch.Tensor, axis: str, order: torch.Tensor) -> torch.Tensor:
    if axis == "in":
        return tensor[:, order]
    return tensor[order] if axis == "out" else tensor


def to_transformers(state: dict[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
    """A tmt state dict in transformers' names and layout (tied copies and sinusoids included;
    a zero output bias for a model without one, as MarianMTModel always has one)."""
    perm, d = _permutation(m.d_model), m.d_model
    out: dict[str, torch.Tensor] = {}
    for w in weight_map(m):
        tensor = state[w.ours].detach().float()
        if w.part >= 0:
            tensor = tensor[w.part * d : (w.part + 1) * d]
        out[w.theirs] = _relabel(tensor, w.axis, perm).clone()
    for copy, original in tied_copies(m).items():
        out[copy] = out[original]
    vocab = state["embedding.weight"].size(0)
    bias = out.get("final_logits_bias", torch.zeros(vocab))
    out["final_logits_bias"] = bias.reshape(1, vocab)
    table = sinusoidal_positions(m.max_positions, d)  # not a weight: the same formula
    for name in _IGNORED:
        out[name] = table[:, perm].clone()
    return out


def from_transformers(
    weights: MutableMapping[str, torch.Tensor],
    m: ModelConfig,
    shapes: Mapping[str, tuple[int, ...]],
    origin: str,
) -> dict[str, torch.Tensor]:
    """transformers' weights as a tmt state dict whose tensors have `shapes` (the model `m`
    describes): each mapped back, its model dimension relabelled; a tied copy must equal its
    original. Refused in one line: a missing, unknown or misshapen weight. `weights` is emptied
    as it is read, so that the model is in memory about once."""
    inverse, d = torch.argsort(_permutation(m.d_model)), m.d_model
    known = {w.theirs for w in weight_map(m)} | set(tied_copies(m)) | set(_IGNORED)
    unknown = sorted(set(weights) - known)
    if unknown:
        raise TmtError(f"{origin}: weights tmt does not know: {', '.join(unknown[:4])}")
    missing = [w.theirs for w in weight_map(m) if w.theirs not in weights]
    if missing:
        raise TmtError(f"{origin}: no {missing[0]}")
    for copy, original in tied_copies(m).items():
        if copy in weights and not torch.equal(
            weights.pop(copy).float(), weights[original].float()
        ):
            raise TmtError(
                f"{origin}: {copy} differs from {original}: tmt ties them (§3.4), this model"
                " does not"
            )
    for name in _IGNORED:  # Marian recomputes them; stored ones must be those sinusoids
        stored = weights.pop(name, None)
        if stored is None:
            continue
        # The shape first: the table a config describes is computed only once a stored tensor
        # of its size shows the config is the weights' (a config.json's d_model of 10^7 alone
        # made tmt compute a 41 GB table).
        same = tuple(stored.shape) == (m.max_positions, d)
        if not same or not torch.allclose(
            stored.float(), sinusoidal_positions(m.max_positions, d)[:, _permutation(d)], atol=1e-4
        ):
            raise TmtError(f"{origin}: {name} is not Marian's sinusoid table (learned positions?)")
    out: dict[str, torch.Tensor] = {}
    for w in weight_map(m):
        tensor = weights.pop(w.theirs).float()
        if w.theirs == "final_logits_bias":
            tensor = tensor.reshape(-1)
        whole = shapes[w.ours]
        expected = (d, *whole[1:]) if w.part >= 0 else whole
        if tuple(tensor.shape) != tuple(expected):
            raise TmtError(
                f"{origin}: {w.theirs} has shape {tuple(tensor.shape)}, its config says"
                f" {tuple(expected)}"
            )
        tensor = _relabel(tensor, w.axis, inverse)
        if w.part < 0:
            out[w.ours] = tensor.contiguous()
            continue
        out.setdefault(w.ours, torch.empty(whole))[w.part * d : (w.part + 1) * d] = tensor
    return out


def save_tokenizer(translator: Translator, directory: Path) -> None:
    """The model's tokenizer as transformers loads it, written into `directory`: Marian's files
    for an imported model (MarianTokenizer: its two sentencepiece models and vocabularies, as
    they came), else tmt's sentencepiece model as a fast tokenizer (tokenizer.json)."""
    tok = translator.tokenizer
    if tok.kind == "sentencepiece":
        tokenizer(translator).save_pretrained(str(directory))
        return
    transformers = transformers_module()

    data, settings = translator.config.data, tok.settings
    with tempfile.TemporaryDirectory() as scratch:  # MarianTokenizer reads files by name
        for name, content in tok.files.items():
            (Path(scratch) / name).write_bytes(content)
        separate = bool(settings["separate_vocabs"])
        marian = transformers.MarianTokenizer(
            source_spm=f"{scratch}/source.spm", target_spm=f"{scratch}/target.spm",
            vocab=f"{scratch}/vocab.json", separate_vocabs=separate,
            target_vocab_file=f"{scratch}/target_vocab.json" if separate else None,
            source_lang=data.src_lang, target_lang=data.tgt_lang,
            eos_token=settings["eos_token"], unk_token=settings["unk_token"],
            pad_token=settings["pad_token"],
            clean_up_tokenization_spaces=settings["clean_up_tokenization_spaces"],
            **({"additional_special_tokens": settings["additional_special_tokens"]}
               if settings["additional_special_tokens"] else {}),
        )  # fmt: skip
        marian.save_pretrained(str(directory))


def tokenizer(translator: Translator) -> Any:
    """The sentencepiece model as a Hugging Face fast tokenizer with the same ids: the BPE merges
    ranked by the score of the piece they make (sentencepiece's order), its normalization table,
    its whitespace rules and byte fallback, and </s> appended to every source."""
    from sentencepiece import sentencepiece_model_pb2
    from tokenizers import AddedToken, decoders, pre_tokenizers, processors

    PreTrainedTokenizerFast = transformers_module().PreTrainedTokenizerFast

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(translator.tokenizer.model_bytes)
    if proto.trainer_spec.model_type != 2:
        raise TmtError("huggingface: the tokenizer is not a BPE model", param="fmt")
    tokenizer = _bpe(proto)
    tokenizer.normalizer = _normalizer(proto.normalizer_spec)
    tokenizer.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    tok = translator.tokenizer
    eos = proto.pieces[tok.eos_id].piece
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"$A {eos}", special_tokens=[(eos, tok.eos_id)]
    )
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tokenizer.add_tokens(
        [AddedToken(p.piece, special=p.type == 3, normalized=False) for p in proto.pieces
         if p.type in (3, 4)]
    )  # fmt: skip
    piece = tok._sp.id_to_piece
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, split_special_tokens=True,  # "<s>" typed in text is text
        eos_token=piece(tok.eos_id), pad_token=piece(tok.pad_id), unk_token=piece(tok.unk_id),
        bos_token=piece(tok.bos_id),
    )  # fmt: skip


def _bpe(proto: Any) -> Any:
    """A `tokenizers` BPE model with sentencepiece's pieces as its vocabulary (same ids) and a
    merge for every split of a piece into two pieces, ranked by the merged piece's score."""
    from tokenizers import Tokenizer, models

    pieces = [(p.piece, p.score) for p in proto.pieces]
    vocab = {piece: i for i, (piece, _) in enumerate(pieces)}
    merges = sorted(
        (-score, vocab[piece], piece[:cut], piece[cut:])
        for piece, score in pieces
        for cut in range(1, len(piece))
        if piece[:cut] in vocab and piece[cut:] in vocab
    )
    spec = proto.trainer_spec
    return Tokenizer(
        models.BPE(
            vocab=vocab, merges=[(left, right) for _, _, left, right in merges],
            unk_token=proto.pieces[spec.unk_id].piece, fuse_unk=True,
            byte_fallback=spec.byte_fallback,
        )
    )  # fmt: skip


def _normalizer(norm: Any) -> Any:
    """sentencepiece's normalization (its compiled table, whitespace rules, word-start mark) as a
    `tokenizers` normalizer."""
    from tokenizers import Regex, normalizers

    steps = []
    if norm.precompiled_charsmap:
        steps.append(normalizers.Precompiled(norm.precompiled_charsmap))
    if norm.remove_extra_whitespaces:
        steps += [
            normalizers.Replace(Regex("^ +| +$"), ""),
            normalizers.Replace(Regex(" {2,}"), " "),
        ]
    steps.append(normalizers.Replace(" ", "▁"))
    if norm.add_dummy_prefix:
        steps.append(normalizers.Prepend("▁"))
    return normalizers.Sequence(steps)
