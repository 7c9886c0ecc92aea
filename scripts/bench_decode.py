"""Decoding speed: tmt vs HF transformers `generate` vs CTranslate2, one model, the same batches.

A post-norm tmt model's weights are ported into a MarianMTModel (q/k/v split from tmt's stacked
in_proj, tmt's sinusoid table copied into Marian's position embeddings); matching greedy outputs
prove the port exact. A CTranslate2 model is built with ctranslate2.specs.TransformerSpec (ReLU,
the same weights) and run in float32. All systems decode the 1,000 sentences of test_2016_flickr
in the same length-sorted batches (tmt's decode.max_tokens source tokens each) with the same
length normalisation (score / |Y|^α, α = 0.6: the "power" form all three support) and 2 threads.
Needs the bench extra: pip install -e ".[bench]". MarianMTModel is post-norm only, hence:

    tmt train --set model.pre_norm=false --set train.max_minutes=10 \
              --set train.out_dir=runs/bench_decode
    python scripts/bench_decode.py --checkpoint runs/bench_decode/average

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from transformer_mt.allocator import keep_freed_memory

keep_freed_memory()  # as the tmt command does, before the models allocate


def port_to_marian(translator):
    from transformers import MarianConfig, MarianMTModel

    m, tok, ours = translator.config.model, translator.tokenizer, translator.model
    if m.pre_norm:
        raise SystemExit(
            "bench_decode: MarianMTModel is post-norm only; train with --set model.pre_norm=false"
        )
    config = MarianConfig(
        vocab_size=tok.vocab_size, decoder_vocab_size=tok.vocab_size, d_model=m.d_model,
        encoder_layers=m.n_encoder_layers, decoder_layers=m.n_decoder_layers,
        encoder_attention_heads=m.n_heads, decoder_attention_heads=m.n_heads,
        encoder_ffn_dim=m.d_ff, decoder_ffn_dim=m.d_ff, activation_function="relu",
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        max_position_embeddings=m.max_positions, scale_embedding=True,
        pad_token_id=tok.pad_id, eos_token_id=tok.eos_id, decoder_start_token_id=tok.bos_id,
        forced_eos_token_id=None, share_encoder_decoder_embeddings=True, tie_word_embeddings=True,
    )  # fmt: skip
    marian = MarianMTModel(config).eval()
    d = m.d_model
    with torch.no_grad():
        marian.model.shared.weight.copy_(ours.embedding.weight)
        for stack in (marian.model.encoder, marian.model.decoder):
            stack.embed_positions.weight.copy_(ours.embedding.positions[: m.max_positions])

        def attention(hf, tm) -> None:
            w, b = tm.in_proj.weight, tm.in_proj.bias
            for i, proj in enumerate((hf.q_proj, hf.k_proj, hf.v_proj)):
                proj.weight.copy_(w[i * d : (i + 1) * d])
                proj.bias.copy_(b[i * d : (i + 1) * d])
            hf.out_proj.load_state_dict(tm.out_proj.state_dict())

        for hf, tm in zip(marian.model.encoder.layers, ours.encoder_layers, strict=True):
            attention(hf.self_attn, tm.self_attn)
            hf.self_attn_layer_norm.load_state_dict(tm.attn_sub.norm.state_dict())
            hf.fc1.load_state_dict(tm.ffn.linear1.state_dict())
            hf.fc2.load_state_dict(tm.ffn.linear2.state_dict())
            hf.final_layer_norm.load_state_dict(tm.ffn_sub.norm.state_dict())
        for hf, tm in zip(marian.model.decoder.layers, ours.decoder_layers, strict=True):
            attention(hf.self_attn, tm.self_attn)
            hf.self_attn_layer_norm.load_state_dict(tm.self_sub.norm.state_dict())
            attention(hf.encoder_attn, tm.cross_attn)
            hf.encoder_attn_layer_norm.load_state_dict(tm.cross_sub.norm.state_dict())
            hf.fc1.load_state_dict(tm.ffn.linear1.state_dict())
            hf.fc2.load_state_dict(tm.ffn.linear2.state_dict())
            hf.final_layer_norm.load_state_dict(tm.ffn_sub.norm.state_dict())
        marian.final_logits_bias.zero_()
    return marian


def convert_to_ctranslate2(translator, out_dir: Path) -> Path:
    import ctranslate2
    from ctranslate2.converters.utils import fuse_linear
    from ctranslate2.specs import common_spec, transformer_spec

    m, tok, ours = translator.config.model, translator.tokenizer, translator.model
    layers = (m.n_encoder_layers, m.n_decoder_layers)
    spec = transformer_spec.TransformerSpec.from_config(layers, m.n_heads, pre_norm=m.pre_norm)
    d = m.d_model

    def array(t):
        return t.detach().numpy().copy()

    def linear(target, weight, bias) -> None:
        target.weight, target.bias = array(weight), array(bias)

    def norm(target, layer) -> None:
        target.gamma, target.beta = array(layer.weight), array(layer.bias)

    def self_attention_and_ffn(layer_spec, layer, attn_norm) -> None:
        # tmt's stacked in_proj (Q, K, V rows) is CTranslate2's fused self-attention input.
        attn = layer.self_attn
        linear(layer_spec.self_attention.linear[0], attn.in_proj.weight, attn.in_proj.bias)
        linear(layer_spec.self_attention.linear[1], attn.out_proj.weight, attn.out_proj.bias)
        norm(layer_spec.self_attention.layer_norm, attn_norm)
        linear(layer_spec.ffn.linear_0, layer.ffn.linear1.weight, layer.ffn.linear1.bias)
        linear(layer_spec.ffn.linear_1, layer.ffn.linear2.weight, layer.ffn.linear2.bias)
        norm(layer_spec.ffn.layer_norm, layer.ffn_sub.norm)

    for stack, final_norm in ((spec.encoder, ours.encoder_norm), (spec.decoder, ours.decoder_norm)):
        embeddings = stack.embeddings[0] if isinstance(stack.embeddings, list) else stack.embeddings
        embeddings.weight = array(ours.embedding.weight)  # one matrix, 3-way tied
        stack.position_encodings.encodings = array(ours.embedding.positions[: m.max_positions])
        stack.scale_embeddings = True
        if m.pre_norm:
            norm(stack.layer_norm, final_norm)
    spec.decoder.projection.weight = array(ours.embedding.weight)
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
    pieces = [tok._sp.id_to_piece(i) for i in range(tok.vocab_size)]
    spec.register_source_vocabulary(pieces)
    spec.register_target_vocabulary(pieces)
    spec.config.add_source_eos = True  # tmt's source is x + eos
    spec.config.decoder_start_token = pieces[tok.bos_id]
    spec.config.bos_token, spec.config.eos_token = pieces[tok.bos_id], pieces[tok.eos_id]
    spec.config.unk_token = pieces[tok.unk_id]
    spec.validate()
    spec.optimize(quantization=None)
    out_dir.mkdir(parents=True, exist_ok=True)
    spec.save(str(out_dir))
    assert ctranslate2.contains_model(str(out_dir))
    return out_dir


def batches_of(translator, lines):
    """tmt's own batching of these lines (sorted by length, decode.max_tokens): used by everyone."""
    from transformer_mt.data import TokenBucketSampler

    ids = translator.tokenizer.encode(lines)
    lengths = np.array([len(x) + 1 for x in ids])
    sampler = TokenBucketSampler(
        lengths, lengths, translator.config.decode.max_tokens, seed=0, shuffle=False
    )
    return ids, sampler.epoch_batches(0)


def run_tmt(
    translator, lines, beam: int, early_stopping: str = "bound"
) -> tuple[float, list[list[int]]]:
    import dataclasses

    from transformer_mt import evaluate

    decode = dataclasses.replace(
        translator.config.decode, beam_size=beam, nbest=1, early_stopping=early_stopping
    )
    t = dataclasses.replace(
        translator, config=dataclasses.replace(translator.config, decode=decode)
    )
    start = time.perf_counter()
    outputs = [hyps[0].tokens if hyps else [] for hyps in evaluate.translate_lines(t, lines)]
    return time.perf_counter() - start, outputs


@torch.inference_mode()
def run_hf(
    marian, translator, lines, beam: int, early_stopping: bool | str = False
) -> tuple[float, list[list[int]]]:
    tok = translator.tokenizer
    ids, batches = batches_of(translator, lines)
    outputs: list[list[int]] = [[] for _ in lines]
    start = time.perf_counter()
    for batch in batches:
        rows = [ids[i] + [tok.eos_id] for i in batch]
        width = max(map(len, rows))
        src = torch.tensor([r + [tok.pad_id] * (width - len(r)) for r in rows])
        generated = marian.generate(
            input_ids=src, attention_mask=(src != tok.pad_id).long(),
            num_beams=beam, do_sample=False, early_stopping=early_stopping,
            length_penalty=translator.config.decode.length_penalty, max_new_tokens=width + 50,
        )  # fmt: skip
        for i, row in zip(batch, generated.tolist(), strict=True):
            row = row[1:]  # drop the decoder start token
            outputs[i] = (
                row[: row.index(tok.eos_id)]
                if tok.eos_id in row
                else [t for t in row if t != tok.pad_id]
            )
    return time.perf_counter() - start, outputs


def run_ct2(model_dir: Path, translator, lines, beam: int) -> tuple[float, list[list[int]]]:
    import ctranslate2

    tok = translator.tokenizer
    ct2 = ctranslate2.Translator(
        str(model_dir), device="cpu", compute_type="float32", intra_threads=torch.get_num_threads()
    )
    ids, batches = batches_of(translator, lines)
    outputs: list[list[int]] = [[] for _ in lines]
    start = time.perf_counter()
    for batch in batches:
        source = [[tok._sp.id_to_piece(t) for t in ids[i]] for i in batch]
        results = ct2.translate_batch(
            source, beam_size=beam, length_penalty=translator.config.decode.length_penalty,
            max_decoding_length=max(map(len, source)) + 50, max_batch_size=len(source),
        )  # fmt: skip
        for i, result in zip(batch, results, strict=True):
            outputs[i] = [tok._sp.piece_to_id(p) for p in result.hypotheses[0]]
    return time.perf_counter() - start, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--checkpoint", default="runs/bench_decode/average", help="a post-norm model"
    )
    parser.add_argument("--lines", type=int, default=1000)
    args = parser.parse_args()

    from transformer_mt import evaluate

    # Same normalisation for everyone: score / |Y|^α (HF and CTranslate2 cannot do GNMT's).
    translator = evaluate.load_translator(
        args.checkpoint, ["decode.length_penalty_form=power"], device="cpu"
    )
    sources, references = evaluate.read_split(translator.config, "data.test")
    sources, references = sources[: args.lines], references[: args.lines]
    marian = port_to_marian(translator)
    results: dict[str, dict] = {}
    outputs: dict[str, list[list[int]]] = {}
    with tempfile.TemporaryDirectory(prefix="tmt-ct2-") as ct2_dir:
        convert_to_ctranslate2(translator, Path(ct2_dir) / "model")
        runs = {
            "tmt_greedy": lambda: run_tmt(translator, sources, 1),
            "tmt_beam4": lambda: run_tmt(translator, sources, 4),
            "tmt_beam4_current": lambda: run_tmt(translator, sources, 4, "current"),
            "hf_greedy": lambda: run_hf(marian, translator, sources, 1),
            "hf_beam4_never": lambda: run_hf(marian, translator, sources, 4, "never"),
            "hf_beam4": lambda: run_hf(marian, translator, sources, 4),
            "ct2_greedy": lambda: run_ct2(Path(ct2_dir) / "model", translator, sources, 1),
            "ct2_beam4": lambda: run_ct2(Path(ct2_dir) / "model", translator, sources, 4),
        }
        for name, run in runs.items():
            run()  # warm-up pass: caches, allocator, lazy initialisation
            seconds, out = min((run() for _ in range(2)), key=lambda r: r[0])
            outputs[name] = out
            texts = translator.tokenizer.decode(out)
            tokens = sum(len(o) + 1 for o in out)  # EOS included
            results[name] = {
                "seconds": round(seconds, 3),
                "sentences_per_s": round(len(sources) / seconds, 1),
                "target_tokens_per_s": round(tokens / seconds, 1),
                "bleu": evaluate.score(texts, references)["bleu"],
            }
            r = results[name]
            print(
                f"{name:<18} {r['sentences_per_s']:>8.1f} sent/s"
                f" {r['target_tokens_per_s']:>9.1f} tok/s  BLEU {r['bleu']:.2f}",
                flush=True,
            )

    def agree(a: str, b: str) -> float:
        """Share of sentences whose outputs are identical token for token."""
        same = sum(x == y for x, y in zip(outputs[a], outputs[b], strict=True))
        return round(same / len(sources), 4)

    def ratio(a: str, b: str) -> float:
        return round(results[a]["sentences_per_s"] / results[b]["sentences_per_s"], 3)

    summary = {
        "checkpoint": args.checkpoint,
        "sentences": len(sources),
        "threads": torch.get_num_threads(),
        "results": results,
        "ratios": {
            # The same stopping rule on both sides: tensor2tensor's exact bound (tmt's default,
            # HF early_stopping="never"), then the current-length heuristic (HF's default).
            "tmt_beam4_over_hf_beam4_never": ratio("tmt_beam4", "hf_beam4_never"),
            "tmt_beam4_current_over_hf_beam4": ratio("tmt_beam4_current", "hf_beam4"),
            "tmt_greedy_over_hf_greedy": ratio("tmt_greedy", "hf_greedy"),
            "ct2_beam4_over_tmt_beam4_current": ratio("ct2_beam4", "tmt_beam4_current"),
            "ct2_greedy_over_tmt_greedy": ratio("ct2_greedy", "tmt_greedy"),
        },
        "identical_outputs": {
            "tmt_greedy_vs_hf": agree("tmt_greedy", "hf_greedy"),
            "tmt_greedy_vs_ct2": agree("tmt_greedy", "ct2_greedy"),
            "tmt_beam4_vs_hf_never": agree("tmt_beam4", "hf_beam4_never"),
            "tmt_beam4_current_vs_hf": agree("tmt_beam4_current", "hf_beam4"),
            "tmt_beam4_current_vs_ct2": agree("tmt_beam4_current", "ct2_beam4"),
            "tmt_beam4_vs_tmt_beam4_current": agree("tmt_beam4", "tmt_beam4_current"),
        },
    }
    for key, value in summary["ratios"].items():
        print(f"{key}: {value:.2f}x")
    for key, value in summary["identical_outputs"].items():
        print(f"identical outputs, {key}: {value:.1%}")
    print(json.dumps(summary))


if __name__ == "__main__":
    sys.exit(main())
