"""Source-target alignments from the cross-attention (tmt translate --alignment; fairseq's
--print-alignment, Marian's --alignment), in the Pharaoh format: "i-j" pairs, source index first.

After the search, each hypothesis is read again by the model with teacher forcing, and at one
decoder layer (decode.alignment_layer, -2: the penultimate) its cross-attention probabilities are
averaged over the heads. Target token j is aligned to the source token the position that predicts
it attends to most; the source's EOS and the target's EOS are not aligned. Why this layer and this
rule: Garg et al. 2019 ("Jointly Learning to Align and Translate with Transformer Models") found
the penultimate layer's head-averaged attention the best-aligned of a vanilla Transformer, and
fairseq's and Marian's hard alignments take the argmax the same way. A second pass over the
finished hypotheses, rather than attention kept during the search, leaves the search (and its
speed without alignments) untouched and gives every hypothesis, n-best or sampled, the same
treatment. An ensemble aligns with its first model.

Word alignments join subwords into words: a piece that starts with sentencepiece's "▁" starts a
word, so words are the line's whitespace-separated words; a word pair is kept once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from transformer_mt.common.exits import TmtError
from transformer_mt.data.tokenizer import Tokenizer
from transformer_mt.network.model import Transformer, make_src_mask

Pairs = tuple[tuple[int, int], ...]


def check_layer(model: Transformer, layer: int) -> int:
    """The decoder layer `layer` names (negative: from the top; -2 is the last of one layer)."""
    count = len(model.decoder_layers)
    if count == 1 and layer == -2:
        return 0
    if not -count <= layer < count:
        raise TmtError(
            f"decode.alignment_layer={layer}: the decoder has {count} layers"
            f" (use {-count} .. {count - 1})"
        )
    return layer % count


@torch.inference_mode()
def cross_attention(
    model: Transformer, src: torch.Tensor, tgt_in: torch.Tensor, pad_id: int, layer: int
) -> torch.Tensor:
    """Teacher-forced cross-attention probabilities of decoder layer `layer`, heads averaged:
    src (B, S), tgt_in (B, T) BOS + target -> (B, T, S)."""
    src_mask = make_src_mask(src, pad_id)  # (B, 1, 1, S)
    memory = model.encode(src, src_mask)
    y = model.embedding(tgt_in)
    for decoder_layer in model.decoder_layers[:layer]:
        y = decoder_layer(y, memory, src_mask)
    chosen = model.decoder_layers[layer]
    # The first half of DecoderLayer.forward: self-attention, then the cross-attention's queries.
    q, k, v = chosen.self_attn.project_self(chosen.self_sub.input(y))
    y = chosen.self_sub.output(y, chosen.self_attn.attend(q, k, v, is_causal=True))
    q = chosen.cross_attn.project_query(chosen.cross_sub.input(y))  # (B, H, T, K)
    keys, _ = chosen.cross_attn.project_key_value(memory)  # (B, H, S, K)
    scores = (q.float() * q.size(-1) ** -0.5) @ keys.float().transpose(-2, -1)  # (B, H, T, S)
    scores = scores.masked_fill(~src_mask, float("-inf"))
    return scores.softmax(dim=-1).mean(dim=1)  # (B, T, S)


def align(
    model: Transformer,
    tokenizer: Tokenizer,
    sources: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
    layer: int,
    device: torch.device,
) -> list[Pairs]:
    """Subword alignments of each (source, output) pair of token ids (no EOS): (i, j) with i a
    source token and j an output token, sorted by j."""
    found: list[Pairs] = [() for _ in sources]
    rows = [r for r, (x, y) in enumerate(zip(sources, outputs, strict=True)) if x and y]
    if not rows:
        return found
    pad, start = tokenizer.pad_id, tokenizer.start_id(model.cfg.decoder_start)
    src = torch.full((len(rows), max(len(sources[r]) for r in rows) + 1), tokenizer.source_pad_id,
                     dtype=torch.long)  # fmt: skip
    tgt = torch.full((len(rows), max(len(outputs[r]) for r in rows)), pad, dtype=torch.long)
    for b, r in enumerate(rows):
        src[b, : len(sources[r])] = torch.tensor(list(sources[r]))
        src[b, len(sources[r])] = tokenizer.source_eos_id
        tgt[b, 0] = start  # position j reads token j - 1 and predicts token j
        tgt[b, 1 : len(outputs[r])] = torch.tensor(list(outputs[r][:-1]))
    probs = cross_attention(model, src.to(device), tgt.to(device), tokenizer.source_pad_id,
                            check_layer(model, layer))  # fmt: skip
    for b, r in enumerate(rows):
        length = len(sources[r])  # the EOS column and the padding are never chosen
        best = probs[b, : len(outputs[r]), :length].argmax(dim=-1).tolist()
        found[r] = tuple((i, j) for j, i in enumerate(best))
    return found


def word_indices(tokenizer: Tokenizer, ids: Sequence[int], side: str = "target") -> list[int]:
    """The word of each piece: a piece starting with "▁" starts a new word. A language token
    (>>xxx<<, put first by decode.target_lang) is no word of the line: -1."""
    words, index = [], -1
    for token in ids:
        piece = tokenizer.id_to_piece(token, side=side)
        if piece in tokenizer.language_codes:
            words.append(-1)
            continue
        if piece.startswith("▁") or index < 0:
            index += 1
        words.append(index)
    return words


def to_words(
    tokenizer: Tokenizer, source: Sequence[int], output: Sequence[int], pairs: Pairs
) -> Pairs:
    """Subword pairs as word pairs, each once, sorted by target word then source word."""
    src_words = word_indices(tokenizer, source, side="source")
    tgt_words = word_indices(tokenizer, output)
    found = {(src_words[i], tgt_words[j]) for i, j in pairs if src_words[i] >= 0}
    return tuple(sorted(found, key=lambda p: (p[1], p[0])))


def pharaoh(pairs: Pairs) -> str:
    """ "i-j i-j ...": Moses' and fast_align's format."""
    return " ".join(f"{i}-{j}" for i, j in pairs)
