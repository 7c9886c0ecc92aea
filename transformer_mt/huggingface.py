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
from typing import Any

import torch

from transformer_mt.exits import TmtError
from transformer_mt.translate import Translator

logger = logging.getLogger(__name__)


def model(translator: Translator) -> tuple[Any, str]:
    """tmt's weights in MarianMTModel (post-norm) or PegasusForConditionalGeneration (pre-norm),
    with the model dimension relabelled from tmt's interleaved sinusoids to their [sin | cos]."""
    import transformers

    m, tok, ours = translator.config.model, translator.tokenizer, translator.model
    decode = translator.config.decode
    common = dict(
        vocab_size=tok.vocab_size, d_model=m.d_model, encoder_layers=m.n_encoder_layers,
        decoder_layers=m.n_decoder_layers, encoder_attention_heads=m.n_heads,
        decoder_attention_heads=m.n_heads, encoder_ffn_dim=m.d_ff, decoder_ffn_dim=m.d_ff,
        activation_function="relu", dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        max_position_embeddings=m.max_positions, scale_embedding=True, pad_token_id=tok.pad_id,
        eos_token_id=tok.eos_id, bos_token_id=tok.bos_id, decoder_start_token_id=tok.bos_id,
        forced_eos_token_id=None, tie_word_embeddings=True,
    )  # fmt: skip
    if m.pre_norm:
        architecture = "PegasusForConditionalGeneration"
        config = transformers.PegasusConfig(**common)
    else:
        architecture = "MarianMTModel"
        config = transformers.MarianConfig(
            **common, decoder_vocab_size=tok.vocab_size, share_encoder_decoder_embeddings=True
        )
    model = getattr(transformers, architecture)(config).eval()
    model.load_state_dict(_state_dict(ours, m.pre_norm), strict=False)
    # generate's defaults for this model: tmt's decode settings (the checkpoint's own).
    beam = (
        {
            "num_beams": decode.beam_size,
            "length_penalty": decode.length_penalty,
            "early_stopping": {"bound": "never", "current": False, "k_finished": True}[
                decode.early_stopping
            ],
        }
        if decode.beam_size > 1
        else {}
    )
    model.generation_config = transformers.GenerationConfig(
        decoder_start_token_id=tok.bos_id, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id,
        bos_token_id=tok.bos_id, bad_words_ids=[[tok.pad_id], [tok.bos_id]],
        max_length=m.max_positions, **beam,
    )  # fmt: skip
    if decode.length_penalty_form != "power":
        logger.warning(
            "generate normalises beam scores by |Y|^α; this model's decode settings use the GNMT"
            " form: beam outputs may differ from tmt's (greedy ones do not)"
        )
    return model, architecture


def _state_dict(ours: Any, pre_norm: bool) -> dict[str, torch.Tensor]:
    d = ours.cfg.d_model
    perm = torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])  # HF dim j is tmt dim perm[j]
    out: dict[str, torch.Tensor] = {}

    def put(name: str, tensor: torch.Tensor) -> None:
        out[name] = tensor.detach().float().clone()

    def attention(prefix: str, attn: Any) -> None:
        w, b = attn.in_proj.weight, attn.in_proj.bias
        for i, name in enumerate(("q_proj", "k_proj", "v_proj")):
            put(f"{prefix}.{name}.weight", w[i * d : (i + 1) * d][:, perm])  # input: the model dim
            put(f"{prefix}.{name}.bias", b[i * d : (i + 1) * d])
        put(f"{prefix}.out_proj.weight", attn.out_proj.weight[perm])  # output: the model dim
        put(f"{prefix}.out_proj.bias", attn.out_proj.bias[perm])

    def norm(prefix: str, layer: torch.nn.LayerNorm) -> None:
        put(f"{prefix}.weight", layer.weight[perm])
        put(f"{prefix}.bias", layer.bias[perm])

    def ffn(prefix: str, layer: Any) -> None:
        put(f"{prefix}.fc1.weight", layer.ffn.linear1.weight[:, perm])
        put(f"{prefix}.fc1.bias", layer.ffn.linear1.bias)
        put(f"{prefix}.fc2.weight", layer.ffn.linear2.weight[perm])
        put(f"{prefix}.fc2.bias", layer.ffn.linear2.bias[perm])
        norm(f"{prefix}.final_layer_norm", layer.ffn_sub.norm)

    embedding = ours.embedding.weight[:, perm]
    for name in ("model.shared", "model.encoder.embed_tokens", "model.decoder.embed_tokens",
                 "lm_head"):  # fmt: skip
        put(f"{name}.weight", embedding)
    positions = ours.embedding.positions[: ours.cfg.max_positions][:, perm]
    for stack in ("encoder", "decoder"):
        put(f"model.{stack}.embed_positions.weight", positions)
    for i, layer in enumerate(ours.encoder_layers):
        attention(f"model.encoder.layers.{i}.self_attn", layer.self_attn)
        norm(f"model.encoder.layers.{i}.self_attn_layer_norm", layer.attn_sub.norm)
        ffn(f"model.encoder.layers.{i}", layer)
    for i, layer in enumerate(ours.decoder_layers):
        attention(f"model.decoder.layers.{i}.self_attn", layer.self_attn)
        norm(f"model.decoder.layers.{i}.self_attn_layer_norm", layer.self_sub.norm)
        attention(f"model.decoder.layers.{i}.encoder_attn", layer.cross_attn)
        norm(f"model.decoder.layers.{i}.encoder_attn_layer_norm", layer.cross_sub.norm)
        ffn(f"model.decoder.layers.{i}", layer)
    if pre_norm:
        norm("model.encoder.layer_norm", ours.encoder_norm)
        norm("model.decoder.layer_norm", ours.decoder_norm)
    out["final_logits_bias"] = torch.zeros(1, ours.vocab_size)
    return out


def tokenizer(translator: Translator) -> Any:
    """The sentencepiece model as a Hugging Face fast tokenizer with the same ids: the BPE merges
    ranked by the score of the piece they make (sentencepiece's order), its normalization table,
    its whitespace rules and byte fallback, and </s> appended to every source."""
    from sentencepiece import sentencepiece_model_pb2
    from tokenizers import AddedToken, decoders, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

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
