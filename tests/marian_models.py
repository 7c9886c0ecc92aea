"""Small OPUS-MT-shaped checkpoints built the way transformers builds them, for the import tests
(no hub here): sentencepiece models trained on the bundled Multi30k, a Marian vocabulary, a
MarianTokenizer and a MarianMTModel written by their own save_pretrained, after a few hundred
training steps so that outputs are real decisions, with a non-zero output bias.

Two shapes cover what OPUS-MT publishes:
- `train_multi`: en -> de and fr with language tokens (>>deu<<, >>fra<<), one joint vocabulary
  whose </s> is not at id 0 (as in tc-big models), swish, weights in model.safetensors; trained
  (about 15 s);
- `derive_separate`: the same network with separate source and target vocabularies and
  embeddings, the target's ids shuffled (so that a side mixed up anywhere shows), relu, weights
  in pytorch_model.bin as transformers 4 wrote them; not trained again (relu on weights trained
  with swish still decides by its input: the tests check that their outputs are not vacuous).
"""

from __future__ import annotations

import gzip
import io
import json
import random
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MULTI30K = REPO / "transformer_mt" / "multi30k"


def multi30k(lang: str, split: str = "train", n: int | None = None) -> list[str]:
    with gzip.open(MULTI30K / f"{split}.{lang}.gz", "rt", encoding="utf-8") as lines:
        out = [line.rstrip("\n") for line in lines]
    return out[:n] if n else out


def _spm(sentences: list[str], vocab_size: int) -> bytes:
    import sentencepiece as spm

    buffer = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences), model_writer=buffer, vocab_size=vocab_size,
        model_type="unigram", character_coverage=1.0, minloglevel=2, num_threads=2,
    )  # fmt: skip
    return buffer.getvalue()


def _pieces(model: bytes) -> list[str]:
    import sentencepiece as spm

    processor = spm.SentencePieceProcessor()
    processor.LoadFromSerializedProto(model)
    # Marian's vocabulary holds the normal pieces; the specials are its own.
    return [processor.id_to_piece(i) for i in range(processor.get_piece_size())
            if not (processor.is_control(i) or processor.is_unknown(i))]  # fmt: skip


def _vocabulary(pieces: list[str], eos_at: int, codes: list[str], size: int = 0) -> dict[str, int]:
    """Marian's order: </s>, <unk>, the pieces (</s> moved to `eos_at` when asked), the
    language codes, unused entries up to `size`, <pad> last (as transformers' converter adds it)."""
    order = ["<unk>", *dict.fromkeys(pieces), *codes]
    order.insert(eos_at, "</s>")
    order += [f"<unused{i}>" for i in range(len(order), size)]
    return {piece: i for i, piece in enumerate([*order, "<pad>"])}


def _save_tokenizer(out: Path, separate: bool, langs: tuple[str, str]) -> None:
    import transformers

    transformers.MarianTokenizer(
        source_spm=str(out / "source.spm"), target_spm=str(out / "target.spm"),
        vocab=str(out / "vocab.json"), separate_vocabs=separate,
        target_vocab_file=str(out / "target_vocab.json") if separate else None,
        source_lang=langs[0], target_lang=langs[1],
    ).save_pretrained(str(out))  # fmt: skip


def _generation(model, pad: int, eos: int, max_length: int = 64) -> None:
    import transformers

    model.generation_config = transformers.GenerationConfig(
        bad_words_ids=[[pad]], bos_token_id=0, decoder_start_token_id=pad, eos_token_id=eos,
        forced_eos_token_id=eos, max_length=max_length, num_beams=4, pad_token_id=pad,
    )  # fmt: skip


def train_multi(out: Path, steps: int = 250, d_model: int = 48, seed: int = 0) -> Path:
    """The multi-target model (en -> de, fr), trained with transformers and saved by it."""
    import torch
    import transformers

    out.mkdir(parents=True)
    random.seed(seed)
    torch.manual_seed(seed)
    n = 3000
    en = multi30k("en", n=n)
    pairs = [(f">>deu<< {s}", t) for s, t in zip(en, multi30k("de", n=n), strict=True)]
    pairs += [(f">>fra<< {s}", t) for s, t in zip(en, multi30k("fr", n=n), strict=True)]
    source = _spm(en, 400)
    target = _spm(multi30k("de", n=n) + multi30k("fr", n=n), 500)
    vocab = _vocabulary(_pieces(source) + _pieces(target), 37, [">>deu<<", ">>fra<<"])
    (out / "source.spm").write_bytes(source)
    (out / "target.spm").write_bytes(target)
    (out / "vocab.json").write_text(json.dumps(vocab))
    _save_tokenizer(out, separate=False, langs=("en", "mul"))
    tokenizer = transformers.MarianTokenizer.from_pretrained(str(out))
    pad, eos = vocab["<pad>"], vocab["</s>"]
    config = transformers.MarianConfig(
        vocab_size=len(vocab), d_model=d_model, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=4 * d_model,
        decoder_ffn_dim=4 * d_model, activation_function="swish", max_position_embeddings=128,
        scale_embedding=True, pad_token_id=pad, eos_token_id=eos, decoder_start_token_id=pad,
        forced_eos_token_id=eos, bos_token_id=0, dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    model = transformers.MarianMTModel(config)
    with torch.no_grad():  # Marian's output bias: non-zero in every OPUS-MT model (a buffer)
        model.final_logits_bias.normal_(0.0, 0.5)
    _train(model, tokenizer, pairs, steps)
    model.eval()
    _generation(model, pad, eos)
    model.save_pretrained(str(out))  # model.safetensors
    return out


def derive_separate(multi: Path, out: Path, seed: int = 0) -> Path:
    """`multi`'s network with separate vocabularies (the target's ids shuffled, its embedding
    and output bias rows with them), relu, saved as pytorch_model.bin."""
    import shutil

    import torch
    import transformers
    from safetensors.torch import load_file

    out.mkdir(parents=True)
    for name in ("source.spm", "target.spm", "vocab.json"):
        shutil.copy(multi / name, out / name)
    vocab = json.loads((multi / "vocab.json").read_text())
    fixed = {vocab[t] for t in ("</s>", "<unk>", "<pad>")}
    moved = [i for i in range(len(vocab)) if i not in fixed]
    shuffled = moved[:]
    random.Random(seed).shuffle(shuffled)
    new_id = dict(zip(moved, shuffled, strict=True)) | {i: i for i in fixed}
    target_vocab = {piece: new_id[i] for piece, i in vocab.items()}
    (out / "target_vocab.json").write_text(json.dumps(target_vocab))
    _save_tokenizer(out, separate=True, langs=("en", "mul"))
    config = transformers.MarianConfig.from_pretrained(str(multi))
    config.share_encoder_decoder_embeddings = False
    config.decoder_vocab_size = len(target_vocab)
    config.activation_function = "relu"
    model = transformers.MarianMTModel(config).eval()
    weights = load_file(str(multi / "model.safetensors"))
    old_of = torch.tensor([i for _, i in sorted((n, o) for o, n in new_id.items())])
    shared = weights.pop("model.shared.weight")
    decoder, bias = shared[old_of].clone(), weights["final_logits_bias"][:, old_of].clone()
    return _save_separate(model, weights, shared, decoder, bias, vocab, out)


def _save_separate(model, weights, source, target, bias, vocab, out: Path) -> Path:
    """A separate-vocabulary MarianMTModel with these embeddings and output bias, written as
    transformers 4 wrote one: config, generation config, pytorch_model.bin (the state dict, tied
    copies included, pickled)."""
    import torch

    weights["model.encoder.embed_tokens.weight"] = source
    weights["model.decoder.embed_tokens.weight"] = target
    weights["final_logits_bias"] = bias
    model.load_state_dict(weights, strict=False)
    model.tie_weights()
    _generation(model, vocab["<pad>"], vocab["</s>"])
    model.generation_config.save_pretrained(str(out))
    model.config.save_pretrained(str(out))
    torch.save(model.state_dict(), out / "pytorch_model.bin")
    return out


def _train(model, tokenizer, pairs: list[tuple[str, str]], steps: int, batch: int = 48) -> None:
    """Adam with a short warmup on batches of short pairs: a model that reads its source (and
    its language token) within a few hundred steps."""
    import torch

    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 30))
    short = [pair for pair in pairs if len(pair[1].split()) <= 12]
    random.shuffle(short)
    used = short[: steps * batch]
    encoded = tokenizer([s for s, _ in used], text_target=[t for _, t in used])
    rows = list(zip(encoded["input_ids"], encoded["labels"], strict=True))
    for step in range(steps):
        chosen = rows[(step * batch) % len(rows) :][:batch]
        src = torch.full((len(chosen), max(len(s) for s, _ in chosen)), tokenizer.pad_token_id)
        labels = torch.full((len(chosen), max(len(t) for _, t in chosen)), -100)
        for i, (s, t) in enumerate(chosen):
            src[i, : len(s)], labels[i, : len(t)] = torch.tensor(s), torch.tensor(t)
        mask = src != tokenizer.pad_token_id
        loss = model(input_ids=src, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()


def random_marian(
    out: Path,
    src: str = "de",
    tgt: str = "en",
    d_model: int = 512,
    layers: int = 6,
    heads: int = 8,
    ffn: int = 2048,
    vocab_size: int = 58101,
    seed: int = 0,
) -> Path:
    """A MarianMTModel directory of this shape with random weights and output bias, written by
    transformers: sentencepiece models of the bundled Multi30k (7,000 and 6,000 pieces), their
    joint vocabulary padded with unused entries to `vocab_size`, opus-mt-de-en's generation
    config (beam 4, max_length 512). The defaults are opus-mt-de-en's shape (74M parameters)."""
    import torch
    import transformers

    out.mkdir(parents=True)
    source, target = _spm(multi30k(src), 7000), _spm(multi30k(tgt), 6000)
    (out / "source.spm").write_bytes(source)
    (out / "target.spm").write_bytes(target)
    vocab = _vocabulary(_pieces(source) + _pieces(target), 0, [], vocab_size - 1)
    (out / "vocab.json").write_text(json.dumps(vocab))
    _save_tokenizer(out, separate=False, langs=(src, tgt))
    pad, eos = vocab["<pad>"], vocab["</s>"]
    config = transformers.MarianConfig(
        vocab_size=len(vocab), d_model=d_model, encoder_layers=layers, decoder_layers=layers,
        encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=ffn,
        decoder_ffn_dim=ffn, activation_function="swish", max_position_embeddings=512,
        scale_embedding=True, pad_token_id=pad, eos_token_id=eos, decoder_start_token_id=pad,
        forced_eos_token_id=eos, bos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.MarianMTModel(config)
    with torch.no_grad():
        model.final_logits_bias.normal_(0.0, 0.1)
    _generation(model, pad, eos, max_length=512)
    model.save_pretrained(str(out))
    return out


def derive_apart(multi: Path, out: Path, seed: int = 0, extra: int = 40) -> Path:
    """`multi`'s network as an OPUS-MT tc-big checkpoint with separate vocabularies whose
    specials stand apart: the target vocabulary holds `extra` more entries (so its <pad>, the
    last, is another id than the source's) and its </s> at another id (5); the config names the
    source side's ids, as transformers' converter writes them (pad_token_id: the encoder's
    vocabulary's last id; eos_token_id: the tokenizer's </s>, the source's), and generate decodes
    with those: it starts from, bans and stops on those ids of the target vocabulary. Each target
    piece keeps its embedding row; the extra rows are small random ones."""
    import shutil

    import torch
    import transformers
    from safetensors.torch import load_file

    out.mkdir(parents=True)
    for name in ("source.spm", "target.spm", "vocab.json"):
        shutil.copy(multi / name, out / name)
    vocab = json.loads((multi / "vocab.json").read_text())
    pieces = sorted(vocab, key=vocab.get)
    unused = [f"<unused{i}>" for i in range(extra)]
    order = [p for p in pieces if p not in ("</s>", "<pad>")]
    order.insert(5, "</s>")
    order += [*unused, "<pad>"]
    target_vocab = {piece: i for i, piece in enumerate(order)}
    (out / "target_vocab.json").write_text(json.dumps(target_vocab))
    _save_tokenizer(out, separate=True, langs=("en", "mul"))
    config = transformers.MarianConfig.from_pretrained(str(multi))
    config.share_encoder_decoder_embeddings = False
    config.decoder_vocab_size = len(target_vocab)
    model = transformers.MarianMTModel(config).eval()
    weights = load_file(str(multi / "model.safetensors"))
    generator = torch.Generator().manual_seed(seed)
    shared = weights.pop("model.shared.weight")
    bias = weights["final_logits_bias"]
    rows = torch.randn(len(order), shared.size(1), generator=generator) * 0.02
    new_bias = torch.full((1, len(order)), -4.0)
    for piece, i in target_vocab.items():
        if piece in vocab:
            rows[i], new_bias[0, i] = shared[vocab[piece]], bias[0, vocab[piece]]
    rows[vocab["<pad>"]] = shared[vocab["<pad>"]]  # what generate starts from: the pad's row
    return _save_separate(model, weights, shared, rows, new_bias, vocab, out)
