"""The joint sentencepiece model: round trip, special ids read from the model, clear failures."""

from __future__ import annotations

import io
import pickle
import re

import pytest
import sentencepiece as spm
from conftest import reverse_pairs

from transformer_mt.common.exits import TmtError
from transformer_mt.config import TokenizerConfig
from transformer_mt.data.tokenizer import Tokenizer, train_tokenizer

SENTENCES = [s for pair in reverse_pairs(300, seed=1) for s in pair]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return train_tokenizer(iter(SENTENCES), TokenizerConfig(vocab_size=64, byte_fallback=False))


def test_round_trip_on_training_text(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(SENTENCES[:50])
    assert tokenizer.decode(ids) == SENTENCES[:50]
    assert all(0 <= i < tokenizer.vocab_size for seq in ids for i in seq)


def test_special_ids_come_from_the_model(tokenizer: Tokenizer) -> None:
    specials = (tokenizer.pad_id, tokenizer.unk_id, tokenizer.bos_id, tokenizer.eos_id)
    assert len(set(specials)) == 4
    proc = spm.SentencePieceProcessor(model_proto=tokenizer.model_bytes)
    assert [proc.id_to_piece(i) for i in specials] == ["<pad>", "<unk>", "<s>", "</s>"]
    assert tokenizer.vocab_size == 64


def test_a_model_with_other_ids_is_read_as_it_is() -> None:
    buffer = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(SENTENCES), model_writer=buffer, vocab_size=60,
        unk_id=0, bos_id=1, eos_id=2, pad_id=3, minloglevel=2,
    )  # fmt: skip
    other = Tokenizer(buffer.getvalue())
    assert (other.unk_id, other.bos_id, other.eos_id, other.pad_id) == (0, 1, 2, 3)


def test_a_model_without_pad_is_refused() -> None:
    buffer = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(SENTENCES), model_writer=buffer, vocab_size=60, minloglevel=2
    )  # sentencepiece's own default has pad_id = -1
    with pytest.raises(TmtError, match="no <pad> piece"):
        Tokenizer(buffer.getvalue(), origin="user.model")


def test_vocab_too_large_for_the_corpus_is_explained() -> None:
    with pytest.raises(
        TmtError,
        match=r"tokenizer.vocab_size=5000 is too large for this corpus: sentencepiece can build at most \d+",
    ):
        train_tokenizer(iter(SENTENCES), TokenizerConfig(vocab_size=5000, byte_fallback=False))


@pytest.mark.parametrize("byte_fallback", [True, False])
def test_vocab_too_small_for_the_characters_is_explained_in_tmt_settings(
    byte_fallback: bool,
) -> None:
    """sentencepiece's advice names its command-line flag (--character_coverage), which tmt
    has not; the error names the settings a tmt user changes, and the size they need."""
    with pytest.raises(TmtError) as caught:
        train_tokenizer(iter(SENTENCES), TokenizerConfig(vocab_size=8, byte_fallback=byte_fallback))
    message = str(caught.value)
    needed = int(re.search(r"need at least (\d+);", message).group(1))
    assert message.startswith("tokenizer.vocab_size=8 is too small for this corpus")
    assert "--" not in message and "tokenizer.character_coverage" in message
    assert ("256 byte pieces" in message) == byte_fallback
    # The size named is enough: a tokenizer of that many pieces trains.
    enough = TokenizerConfig(vocab_size=needed, byte_fallback=byte_fallback)
    assert train_tokenizer(iter(SENTENCES), enough).vocab_size == needed


def test_no_training_text_is_explained() -> None:
    with pytest.raises(TmtError, match="tokenizer"):
        train_tokenizer(iter(["", "  "]), TokenizerConfig(vocab_size=64))


def test_garbage_bytes_are_not_a_model() -> None:
    with pytest.raises(TmtError, match="x.model: not a sentencepiece model"):
        Tokenizer(b"definitely not a protobuf", origin="x.model")


def test_byte_fallback_round_trips_unseen_characters() -> None:
    tok = train_tokenizer(iter(SENTENCES), TokenizerConfig(vocab_size=300, byte_fallback=True))
    text = "kalo 東京 ☃"
    ids = tok.encode([text])[0]
    assert tok.unk_id not in ids
    assert tok.decode([ids]) == [text]


def test_pickle_round_trip_keeps_the_model(tokenizer: Tokenizer) -> None:
    copy = pickle.loads(pickle.dumps(tokenizer))
    assert copy.sha256 == tokenizer.sha256
    assert copy.encode(SENTENCES[:3]) == tokenizer.encode(SENTENCES[:3])


def test_file_round_trip(tokenizer: Tokenizer, tmp_path) -> None:
    (tmp_path / "spm.model").write_bytes(tokenizer.model_bytes)
    assert Tokenizer.from_file(tmp_path / "spm.model").sha256 == tokenizer.sha256
    with pytest.raises(TmtError, match="cannot read tokenizer"):
        Tokenizer.from_file(tmp_path / "missing.model")


def test_few_lines_one_by_one_equal_many_lines_pooled(tokenizer: Tokenizer) -> None:
    """Below tokenizer._POOLED lines are encoded and decoded one by one (sentencepiece's
    thread pool costs more than the work); the ids and texts are the same either way."""
    import random

    from transformer_mt.data import tokenizer as module

    rng = random.Random(0)
    texts = ["", " ", "\x00", "ü" * 40] + [
        " ".join(rng.choice(["ab", "cd", "xyz", "Ünï", "ko"]) for _ in range(rng.randrange(12)))
        for _ in range(2 * module._POOLED)
    ]
    ids = tokenizer.encode(texts)  # pooled
    assert [tokenizer.encode([t])[0] for t in texts] == ids
    assert [tokenizer.decode([i])[0] for i in ids] == tokenizer.decode(ids)
    assert tokenizer.encode(texts[:5]) == ids[:5] and tokenizer.decode(ids[:5]) == [
        tokenizer.decode([i])[0] for i in ids[:5]
    ]
