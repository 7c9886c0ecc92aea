"""Batches: collate shift and padding, filter counts, the encoded cache, and
subword regularization (BPE-dropout) of training batches."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import reverse_pairs, with_data, write_parallel

from transformer_mt.common.exits import TmtError
from transformer_mt.config import Config
from transformer_mt.data import corpus
from transformer_mt.data.batches import SubwordSampling, collate, prepare_data

# --- collate -----------------------------------------------------------------------------------


def test_collate_shifts_targets_and_pads() -> None:
    pad, bos, eos = 0, 2, 3
    batch = collate([[10, 11, 12], [13]], [[20], [21, 22]], pad, bos, eos)
    assert batch.src.tolist() == [[10, 11, 12, 3], [13, 3, 0, 0]]
    assert batch.tgt_in.tolist() == [[2, 20, 0], [2, 21, 22]]
    assert batch.tgt_out.tolist() == [[20, 3, 0], [21, 22, 3]]
    assert batch.src.dtype == torch.int64
    assert batch.n_tokens == 5
    # tgt_in[t + 1] == tgt_out[t] wherever both are real tokens: the shift is exactly one.
    assert torch.equal(
        batch.tgt_in[:, 1:][batch.tgt_in[:, 1:] != pad],
        batch.tgt_out[:, :-1][batch.tgt_in[:, 1:] != pad],
    )


# --- prepare_data: filters, counts, cache ------------------------------------------------------


def test_encoded_batches_decode_to_the_original_text(tiny_cfg: Config) -> None:
    data = prepare_data(tiny_cfg)
    sampler = data.train.sampler(tiny_cfg.data.max_tokens, seed=1)
    positions = sampler.epoch_batches(0)[0]
    batch = data.train.batch(positions, data.tokenizer)
    texts = dict(reverse_pairs(300, seed=1))  # source -> target
    for src_row, tgt_row in zip(batch.src.tolist(), batch.tgt_out.tolist()):
        source = data.tokenizer.decode([[i for i in src_row if i != data.tokenizer.pad_id]])[0]
        target = data.tokenizer.decode([[i for i in tgt_row if i != data.tokenizer.pad_id]])[0]
        assert texts[source] == target


def test_filters_are_counted_per_filter(tmp_path: Path, tiny_cfg: Config) -> None:
    good = reverse_pairs(30, seed=5)
    bad = [
        ("", "kalo"),  # empty source
        ("   ", "kalo"),  # whitespace-only source
        ("kalo", "\t "),  # whitespace-only target
        (" ".join(["kalo"] * 60), " ".join(["kalo"] * 60)),  # too long (> max_len tokens)
        ("ka", " ".join(["loka mi"] * 6)),  # length ratio
    ]
    prefix = write_parallel(tmp_path / "train", good + bad)
    cfg = with_data(tiny_cfg, train=str(prefix), max_len=40, max_len_ratio=3.0)
    counts = prepare_data(cfg).counts["data.train"]
    assert (counts.read, counts.empty, counts.too_long, counts.ratio, counts.kept) == (
        35,
        3,
        1,
        1,
        30,
    )
    assert counts.invalid_utf8 == counts.replaced == 0


def test_a_line_past_what_any_model_reads_is_encoded_from_its_head_and_dropped(
    tmp_path: Path, tiny_cfg: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A side past READ_TOKENS (65,536: no model reads more) is encoded from a head that long:
    data.max_len drops it all the same (a 50 MB line took 2.6 GB to be encoded whole). Here
    READ_TOKENS is 60, so the heads are short and the rest of the corpus is as it was."""
    from transformer_mt.data import batches

    good = reverse_pairs(30, seed=5)
    giant = " ".join(["kalo"] * 20_000)
    prefix = write_parallel(tmp_path / "train", [*good, (giant, "kalo"), ("kalo", giant)])
    cfg = with_data(tiny_cfg, train=str(prefix), max_len=40, max_len_ratio=3.0)
    whole = prepare_data(cfg)
    monkeypatch.setattr(batches, "READ_TOKENS", 60)
    lengths = []  # what the encoder made of each side
    encode = batches.encode_heads

    def spy(*args):
        found = encode(*args)
        lengths.extend(len(ids) for ids in found[0])
        return found

    monkeypatch.setattr(batches, "encode_heads", spy)
    cfg = dataclasses.replace(
        cfg, data=dataclasses.replace(cfg.data, cache_dir=str(tmp_path / "c"))
    )
    headed = prepare_data(cfg)
    for prepared in (whole, headed):
        counts = prepared.counts["data.train"]
        assert (counts.read, counts.too_long, counts.kept) == (32, 2, 30)
    assert max(lengths) < 20_000 and sorted(lengths)[-2] > 60  # the giants: heads of 60 and more
    kept = range(len(whole.train))
    for a, b in zip(headed.train.ids(kept), whole.train.ids(kept), strict=True):
        assert [x.tolist() for x in a] == [x.tolist() for x in b]


def test_encoding_policies_are_counted(tmp_path: Path, tiny_cfg: Config) -> None:
    prefix = write_parallel(tmp_path / "train", reverse_pairs(30, seed=5))
    Path(f"{prefix}.de").write_bytes(Path(f"{prefix}.de").read_bytes().replace(b"ka", b"k\xff", 1))
    skip = prepare_data(with_data(tiny_cfg, train=str(prefix), encoding_errors="skip")).counts[
        "data.train"
    ]
    assert (skip.invalid_utf8, skip.kept, skip.replaced) == (1, 29, 0)
    replace = prepare_data(
        with_data(tiny_cfg, train=str(prefix), encoding_errors="replace")
    ).counts["data.train"]
    assert (replace.invalid_utf8, replace.kept, replace.replaced) == (0, 30, 1)
    with pytest.raises(TmtError, match=r"train.de:\d+: invalid UTF-8"):
        prepare_data(with_data(tiny_cfg, train=str(prefix)))


def test_nothing_left_after_filtering_names_the_filters(tmp_path: Path, tiny_cfg: Config) -> None:
    (tmp_path / "spm.model").write_bytes(prepare_data(tiny_cfg).tokenizer.model_bytes)
    cfg = dataclasses.replace(
        tiny_cfg,
        tokenizer=dataclasses.replace(tiny_cfg.tokenizer, model_path=str(tmp_path / "spm.model")),
    )
    prefix = write_parallel(tmp_path / "train", [(" ".join(["kalo"] * 60), "mi")] * 3 + [("", "x")])
    with pytest.raises(TmtError) as err:
        prepare_data(with_data(cfg, train=str(prefix), max_len=40))
    message = str(err.value)
    assert "no pairs left after filtering" in message
    assert "4 read" in message and "1 empty" in message and "3 over data.max_len" in message


def test_second_run_reuses_tokenizer_and_encoding(
    tiny_cfg: Config, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    cfg = with_data(tiny_cfg, cache_dir=str(tmp_path / "cache"))
    first = prepare_data(cfg)

    def no_reading(*args: object, **kwargs: object) -> None:
        raise AssertionError("a warm cache must not read or encode the corpus again")

    monkeypatch.setattr(corpus.RawSplit, "load", no_reading)
    second = prepare_data(cfg)
    assert second.tokenizer.sha256 == first.tokenizer.sha256
    assert np.array_equal(second.train.src_lengths, first.train.src_lengths)
    # A filter change is applied to the cached lengths: still no re-encoding, new counts.
    stricter = prepare_data(with_data(cfg, max_len=6))
    assert stricter.counts["data.train"].too_long > 0
    assert len(stricter.train) < len(first.train)
    assert not list((tmp_path / "cache").glob(".work.*"))  # scratch space is cleaned up


def test_a_different_tokenizer_re_encodes(tiny_cfg: Config, tmp_path: Path) -> None:
    cfg = with_data(tiny_cfg, cache_dir=str(tmp_path / "cache"))
    prepare_data(cfg)
    bigger = dataclasses.replace(cfg, tokenizer=dataclasses.replace(cfg.tokenizer, vocab_size=80))
    data = prepare_data(bigger)
    assert data.tokenizer.vocab_size == 80
    assert (
        len(list((tmp_path / "cache" / "encoded").iterdir())) == 4
    )  # (train, valid) × 2 tokenizers
    assert len(list((tmp_path / "cache" / "tokenizers").glob("*.model"))) == 2


def test_parallel_encoding_matches_serial(tiny_cfg: Config, tmp_path: Path) -> None:
    serial = prepare_data(with_data(tiny_cfg, cache_dir=str(tmp_path / "a")))
    parallel = prepare_data(with_data(tiny_cfg, cache_dir=str(tmp_path / "b"), num_proc=2))
    positions = np.arange(len(serial.train))
    assert (
        serial.train.ids(positions)[0][5].tolist() == parallel.train.ids(positions)[0][5].tolist()
    )
    assert all(
        np.array_equal(a, b)
        for a, b in zip(serial.train.ids(positions)[1], parallel.train.ids(positions)[1])
    )


def test_given_tokenizer_model_path_is_used(tiny_cfg: Config, tmp_path: Path) -> None:
    trained = prepare_data(tiny_cfg).tokenizer
    (tmp_path / "mine.model").write_bytes(trained.model_bytes)
    cfg = dataclasses.replace(
        tiny_cfg,
        tokenizer=dataclasses.replace(
            tiny_cfg.tokenizer, model_path=str(tmp_path / "mine.model"), vocab_size=999
        ),
    )
    assert prepare_data(cfg).tokenizer.sha256 == trained.sha256


def test_leftovers_of_killed_runs_are_removed(tiny_cfg: Config, tmp_path: Path) -> None:
    import os

    cache = tmp_path / "cache"
    cfg = with_data(tiny_cfg, cache_dir=str(cache))
    prepare_data(cfg)
    stale = [
        cache / ".work.dead",
        cache / "encoded" / ".abc.dead",
        cache / "tokenizers" / ".x.model.tmp",
    ]
    fresh = cache / ".work.live"
    for path in [*stale[:2], fresh]:
        path.mkdir()
    stale[2].write_bytes(b"partial")
    for path in stale:
        os.utime(path, (0, 0))
    prepare_data(cfg)
    assert not any(p.exists() for p in stale)
    assert fresh.exists()  # a build that may still be running is left alone


# --- subword regularization: BPE-dropout of training batches ----------------------------------


def sampled_cfg(cfg: Config, alpha: float = 0.3, **train: object) -> Config:
    cfg = with_data(cfg, subword_alpha=alpha, subword_sides="both")
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **train))


def test_bpe_dropout_without_dropout_is_sentencepieces_own_segmentation(
    multi30k_cfg_data: tuple[Config, object],
) -> None:
    # A 500-piece model of the bundled Multi30k, 2,000 pairs: merging each word again from its
    # characters, best score first, gives exactly what sentencepiece's encoder gave.
    _, data = multi30k_cfg_data
    src, tgt = data.train.ids(np.arange(2000))
    for ids in src + tgt:
        assert data.tokenizer.bpe_dropout(ids, 0.0, seed=1) == ids.tolist()


@pytest.fixture(scope="module")
def multi30k_cfg_data() -> tuple[Config, object]:
    from transformer_mt.config import load_config

    cfg = load_config(Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml")
    return cfg, prepare_data(cfg)  # the data of conftest's multi30k_run: one cache entry


def test_sampled_batches_keep_the_text_vary_by_epoch_and_repeat_by_seed(
    multi30k_cfg_data: tuple[Config, object],
) -> None:
    cfg, data = multi30k_cfg_data
    tokenizer, positions = data.tokenizer, np.arange(100, 400)
    sampling = SubwordSampling.of(sampled_cfg(cfg, 0.1), tokenizer)
    src, _ = data.train.ids(positions)
    epoch0 = sampling.resegment(src, positions, tokenizer, epoch=0, side=0)
    again = sampling.resegment(src, positions, tokenizer, epoch=0, side=0)
    epoch1 = sampling.resegment(src, positions, tokenizer, epoch=1, side=0)
    assert all(np.array_equal(a, b) for a, b in zip(epoch0, again, strict=True))
    assert tokenizer.decode(epoch0) == tokenizer.decode(epoch1) == tokenizer.decode(src)
    changed = sum(not np.array_equal(a, b) for a, b in zip(epoch0, src, strict=True))
    assert changed > 150  # most sentences of ~12 words lose a merge or more at 0.1
    assert sum(map(len, epoch0)) > sum(map(len, src))  # dropped merges: more, shorter pieces
    assert sum(not np.array_equal(a, b) for a, b in zip(epoch0, epoch1, strict=True)) > 150
    # The pair, not its place in a batch, fixes its draw: a batch of one draws the same.
    alone = sampling.resegment([src[7]], positions[7:8], tokenizer, epoch=0, side=0)
    assert np.array_equal(alone[0], epoch0[7])


def test_validation_batches_and_the_defaults_are_never_sampled(tiny_cfg: Config) -> None:
    data = prepare_data(tiny_cfg)
    assert SubwordSampling.of(tiny_cfg, data.tokenizer) is None  # §5.1: one segmentation
    sampling = SubwordSampling.of(sampled_cfg(tiny_cfg, 0.5), data.tokenizer)
    positions = np.arange(30)
    plain = data.train.batch(positions, data.tokenizer)
    drawn = data.train.batch(positions, data.tokenizer, sampling, epoch=0)
    assert (
        drawn.src.shape[1] > plain.src.shape[1] and drawn.tgt_out.shape[1] > plain.tgt_out.shape[1]
    )
    # a draw longer than data.max_len keeps the cached segmentation
    short = dataclasses.replace(sampling, max_len=int(data.train.src_lengths[:30].max()))
    capped = data.train.batch(positions, data.tokenizer, short, epoch=0)
    assert capped.src.shape[1] <= short.max_len + 1


def test_tags_stay_whole_under_dropout(tiny_cfg: Config, tmp_path: Path) -> None:
    from transformer_mt.config import Corpus

    cfg = with_data(
        tiny_cfg, train=(Corpus(split=tiny_cfg.data.train, tag="<bt>"),), cache_dir=str(tmp_path)
    )
    data = prepare_data(cfg)
    tag = data.tokenizer.tag_ids("<bt>")[-1]
    src, _ = data.train.ids(np.arange(50))
    for i, ids in enumerate(src):
        drawn = data.tokenizer.bpe_dropout(ids, 0.9, seed=i)
        assert tag in drawn and data.tokenizer.decode([drawn]) == data.tokenizer.decode([ids])


def test_a_unigram_tokenizer_is_refused_in_one_line(tiny_cfg: Config, tmp_path: Path) -> None:
    cfg = dataclasses.replace(
        sampled_cfg(tiny_cfg),
        tokenizer=dataclasses.replace(tiny_cfg.tokenizer, model_type="unigram"),
    )
    data = prepare_data(with_data(cfg, cache_dir=str(tmp_path)))
    assert data.tokenizer.model_type == "unigram"
    with pytest.raises(TmtError, match=r"data.subword_alpha=0.3: BPE-dropout needs a bpe"):
        SubwordSampling.of(cfg, data.tokenizer)
