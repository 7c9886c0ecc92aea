"""Reading parallel text: every source gives the same pairs; bad input names file and line."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from conftest import reverse_pairs, with_data, write_parallel

from transformer_mt.common.exits import TmtError
from transformer_mt.config import Config, DataConfig
from transformer_mt.data import corpus

# Awkward but legal text: a lone CR, U+2028 and U+0085 are not line breaks; quotes and non-ASCII.
PAIRS = [
    ("Ein Mann\rläuft.", "A man\rruns."),
    ('Sie sagt "hallo"\u2028heute.', "She says 'hello'\u2028today."),
    ("Zwei\x85Hunde", "Two\x85dogs"),
    ("", "empty source"),
    ("Grüße aus Köln – 東京", "Greetings from Cologne – Tokyo"),
]


def read(cfg: DataConfig, tmp_path: Path, key: str = "data.train") -> list[tuple[str, str]]:
    dataset = corpus.open_split(cfg, key).load(tmp_path / "work")
    return list(zip(dataset["src"], dataset["tgt"]))


def test_plain_and_gzip_files_read_identically(tmp_path: Path) -> None:
    prefix = write_parallel(tmp_path / "plain" / "train", PAIRS)
    for lang in ("de", "en"):
        data = Path(f"{prefix}.{lang}").read_bytes()
        (tmp_path / "gz").mkdir(exist_ok=True)
        (tmp_path / "gz" / f"train.{lang}.gz").write_bytes(gzip.compress(data))
    plain = read(DataConfig(source="files", train=str(prefix)), tmp_path)
    zipped = read(DataConfig(source="files", train=str(tmp_path / "gz" / "train")), tmp_path)
    assert plain == zipped == PAIRS


def test_all_sources_give_identical_pairs(tmp_path: Path) -> None:
    import datasets

    pairs = [p for p in PAIRS if "\t" not in p[0] + p[1]]
    prefix = write_parallel(tmp_path / "txt" / "train", pairs)
    (tmp_path / "plain.tsv").write_text("".join(f"{s}\t{t}\n" for s, t in pairs))
    (tmp_path / "named.tsv").write_text(
        "id\ten\tde\n" + "".join(f"{i}\t{t}\t{s}\n" for i, (s, t) in enumerate(pairs))
    )
    records = [{"translation": {"de": s, "en": t}} for s, t in pairs]
    (tmp_path / "tr.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    flat = [{"source": s, "target": t, "id": i} for i, (s, t) in enumerate(pairs)]
    (tmp_path / "flat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in flat))
    hub_like = tmp_path / "hub_like"  # a local directory that load_dataset reads like a hub dataset
    hub_like.mkdir()
    (hub_like / "train.jsonl").write_text((tmp_path / "tr.jsonl").read_text())
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(records)}).save_to_disk(str(saved))
    columns = tmp_path / "columns"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(flat)}).save_to_disk(str(columns))

    sources = {
        "files": DataConfig(source="files", train=str(prefix)),
        "tsv": DataConfig(source="tsv", train=str(tmp_path / "plain.tsv")),
        "tsv header": DataConfig(
            source="tsv", train=str(tmp_path / "named.tsv"), src_field="de", tgt_field="en"
        ),
        "tsv indices": DataConfig(
            source="tsv", train=str(tmp_path / "plain.tsv"), src_field="0", tgt_field="1"
        ),
        "jsonl translation": DataConfig(source="jsonl", train=str(tmp_path / "tr.jsonl")),
        "jsonl fields": DataConfig(
            source="jsonl",
            train=str(tmp_path / "flat.jsonl"),
            src_field="source",
            tgt_field="target",
        ),
        "hf load_dataset": DataConfig(source="hf", path=str(hub_like), train="train"),
        "hf_disk translation": DataConfig(source="hf_disk", path=str(saved), train="train"),
        "hf_disk columns": DataConfig(
            source="hf_disk", path=str(columns), src_field="source", tgt_field="target"
        ),
    }
    results = {name: read(cfg, tmp_path / name.replace(" ", "_")) for name, cfg in sources.items()}
    for name, got in results.items():
        assert got == pairs, name


def test_line_semantics_bom_crlf_and_hidden_separators(tmp_path: Path) -> None:
    # BOM at the start, a CRLF ending, a lone CR, U+0085 and U+2028 inside lines, no final newline.
    (tmp_path / "c.de").write_bytes(b"\xef\xbb\xbfa\rb\r\nc\xc2\x85d\ne\xe2\x80\xa8f")
    (tmp_path / "c.en").write_bytes(b"one\r\ntwo\nthree\n")
    pairs = read(DataConfig(source="files", train=str(tmp_path / "c")), tmp_path)
    assert pairs == [("a\rb", "one"), ("c\x85d", "two"), ("e\u2028f", "three")]


def test_line_count_mismatch_names_both_files_and_counts(tmp_path: Path) -> None:
    (tmp_path / "m.de").write_text("a\nb\nc\n")
    (tmp_path / "m.en").write_text("x\ny\n")
    with pytest.raises(TmtError) as err:
        read(DataConfig(source="files", train=str(tmp_path / "m")), tmp_path)
    message = str(err.value)
    assert f"{tmp_path / 'm.de'} has 3 lines" in message
    assert f"{tmp_path / 'm.en'} has 2" in message


def test_hidden_separator_cannot_fake_a_line_count_match(tmp_path: Path) -> None:
    # wc -l says 2 and 2, Python's text mode would say 3 and 2: the pair stays aligned here.
    (tmp_path / "h.de").write_bytes(b"a\rb\nc\n")
    (tmp_path / "h.en").write_bytes(b"x\ny\n")
    assert read(DataConfig(source="files", train=str(tmp_path / "h")), tmp_path) == [
        ("a\rb", "x"),
        ("c", "y"),
    ]


def test_invalid_utf8_strict_names_file_and_line(tmp_path: Path) -> None:
    (tmp_path / "u.de").write_bytes(b"gut\nschl\xff\xfecht\n")
    (tmp_path / "u.en").write_bytes(b"good\nbad\n")
    with pytest.raises(TmtError, match=rf"{tmp_path / 'u.de'}:2: invalid UTF-8 at byte offset 4"):
        read(DataConfig(source="files", train=str(tmp_path / "u")), tmp_path)


def test_invalid_utf8_replace_and_skip_policies(tmp_path: Path) -> None:
    (tmp_path / "u.de").write_bytes(b"gut\nschl\xffcht\n")
    (tmp_path / "u.en").write_bytes(b"good\nbad\n")
    replaced = corpus.open_split(
        DataConfig(source="files", train=str(tmp_path / "u"), encoding_errors="replace"),
        "data.train",
    )
    dataset = replaced.load(tmp_path / "r")
    assert dataset["src"] == ["gut", "schl\ufffdcht"] and dataset["invalid"] == [False, True]
    skipped = corpus.open_split(
        DataConfig(source="files", train=str(tmp_path / "u"), encoding_errors="skip"), "data.train"
    )
    dataset = skipped.load(tmp_path / "s")
    assert dataset["src"] == ["gut", ""] and dataset["invalid"] == [
        False,
        True,
    ]  # dropped later, counted


def test_missing_files_name_what_was_tried(tmp_path: Path) -> None:
    with pytest.raises(
        TmtError, match=rf"data.train: neither {tmp_path}/nope.de nor {tmp_path}/nope.de.gz exists"
    ):
        corpus.open_split(DataConfig(source="files", train=str(tmp_path / "nope")), "data.train")
    with pytest.raises(TmtError, match="data.valid: no such file"):
        corpus.open_split(
            DataConfig(source="jsonl", valid=str(tmp_path / "none.jsonl")), "data.valid"
        )


def test_a_side_that_is_there_but_no_file_says_what_it_is(tmp_path: Path) -> None:
    """It said "neither X.de nor X.de.gz exists" of a link to a device, a FIFO and a directory."""
    import os

    (tmp_path / "dev.de").symlink_to("/dev/zero")
    os.mkfifo(tmp_path / "fifo.de")
    (tmp_path / "dir.de").mkdir()
    kinds = {"dev": "a device", "fifo": r"a FIFO \(a named pipe\)", "dir": "a directory"}
    for name, kind in kinds.items():
        (tmp_path / f"{name}.en").write_text("a\n")
        with pytest.raises(TmtError, match=rf"^data.train: {tmp_path}/{name}.de: is {kind},"):
            corpus.open_split(DataConfig(source="files", train=str(tmp_path / name)), "data.train")


def test_corrupt_gzip_is_reported(tmp_path: Path) -> None:
    good = gzip.compress(b"a\nb\nc\n" * 1000)
    (tmp_path / "z.de.gz").write_bytes(good[: len(good) // 2])
    (tmp_path / "z.en.gz").write_bytes(good)
    with pytest.raises(TmtError, match=rf"{tmp_path / 'z.de.gz'}:\d+: corrupt gzip data"):
        read(DataConfig(source="files", train=str(tmp_path / "z")), tmp_path)


@pytest.mark.parametrize(
    ("text", "cfg", "message"),
    [
        ("a\tb\nc\td\te\n", {}, ":2: expected 2 tab-separated columns, found 3"),
        (
            "de\ten\na\tb\nc\n",
            {"src_field": "de", "tgt_field": "en"},
            ":3: expected 2 tab-separated columns, found 1",
        ),
        ("xx\tyy\na\tb\n", {"src_field": "de", "tgt_field": "en"}, ":1: header has no column 'de'"),
    ],
)
def test_tsv_errors_name_the_line(
    tmp_path: Path, text: str, cfg: dict[str, str], message: str
) -> None:
    path = tmp_path / "bad.tsv"
    path.write_text(text)
    with pytest.raises(TmtError, match=f"{path}{message}"):
        read(DataConfig(source="tsv", train=str(path), **cfg), tmp_path)


@pytest.mark.parametrize(
    ("line", "cfg", "message"),
    [
        ('{"translation": {"de": "a", "en": "b"}', {}, ":2: invalid JSON"),
        ("[1, 2]", {}, ":2: expected a JSON object, found list"),
        ('{"de": "a", "en": "b"}', {}, ':2: no "translation" object'),
        ('{"translation": {"de": "a", "fr": "b"}}', {}, ":2: no field 'en'"),
        (
            '{"s": "a", "t": 3}',
            {"src_field": "s", "tgt_field": "t"},
            ":2: field 't' is int, expected a string",
        ),
        ("", {}, ":2: invalid JSON"),
    ],
)
def test_jsonl_errors_name_the_line(
    tmp_path: Path, line: str, cfg: dict[str, str], message: str
) -> None:
    path = tmp_path / "bad.jsonl"
    first = '{"s": "x", "t": "y"}' if cfg else '{"translation": {"de": "x", "en": "y"}}'
    path.write_text(first + "\n" + line + "\n")
    with pytest.raises(TmtError, match=f"{path}{message}"):
        read(DataConfig(source="jsonl", train=str(path), **cfg), tmp_path)


def test_jsonl_null_text_reads_as_empty(tmp_path: Path) -> None:
    path = tmp_path / "n.jsonl"
    path.write_text('{"translation": {"de": null, "en": "b"}}\n')
    assert read(DataConfig(source="jsonl", train=str(path)), tmp_path) == [("", "b")]


def test_bundled_multi30k_splits_and_languages(tmp_path: Path) -> None:
    cfg = DataConfig(source="multi30k", src_lang="en", tgt_lang="fr", valid="val")
    pairs = read(cfg, tmp_path, "data.valid")
    assert len(pairs) == 1014
    assert all(s and t for s, t in pairs)
    with pytest.raises(
        TmtError, match="data.test='test2017': Multi30k splits are train, val, test_2016_flickr"
    ):
        corpus.open_split(DataConfig(test="test2017"), "data.test")
    with pytest.raises(TmtError, match="data.tgt_lang='cs': Multi30k has en, de, fr"):
        corpus.open_split(DataConfig(tgt_lang="cs"), "data.train")


def test_hf_errors_name_the_problem(tmp_path: Path) -> None:
    import datasets

    saved = tmp_path / "saved"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list([{"a": "x", "b": "y"}])}
    ).save_to_disk(str(saved))
    with pytest.raises(TmtError, match="data.valid='validation': .* has splits train"):
        corpus.open_split(
            DataConfig(source="hf_disk", path=str(saved), valid="validation"), "data.valid"
        )
    with pytest.raises(
        TmtError, match="no 'translation' column .*set data.src_field and data.tgt_field"
    ):
        read(DataConfig(source="hf_disk", path=str(saved)), tmp_path)
    with pytest.raises(TmtError, match="no column 'c'"):
        read(DataConfig(source="hf_disk", path=str(saved), src_field="a", tgt_field="c"), tmp_path)
    with pytest.raises(TmtError, match="not a saved dataset"):
        corpus.open_split(
            DataConfig(source="hf_disk", path=str(tmp_path / "missing")), "data.train"
        )
    with pytest.raises(TmtError, match="needs data.path"):
        corpus.open_split(DataConfig(source="hf"), "data.train")
    with pytest.raises(TmtError, match="cannot load"):
        corpus.open_split(DataConfig(source="hf", path=str(tmp_path / "no_such_dir")), "data.train")


def test_fingerprint_follows_content_and_reading_options(tmp_path: Path, tiny_cfg: Config) -> None:
    prefix = write_parallel(tmp_path / "f" / "train", reverse_pairs(5, seed=3))
    cfg = with_data(tiny_cfg, train=str(prefix)).data
    first = corpus.open_split(cfg, "data.train").fingerprint
    assert corpus.open_split(cfg, "data.train").fingerprint == first
    assert (
        corpus.open_split(
            with_data(tiny_cfg, train=str(prefix), encoding_errors="replace").data, "data.train"
        ).fingerprint
        != first
    )
    Path(f"{prefix}.en").write_text(Path(f"{prefix}.en").read_text() + "one more\n")
    assert corpus.open_split(cfg, "data.train").fingerprint != first
