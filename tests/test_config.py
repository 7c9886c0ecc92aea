"""Config: paper defaults, precedence defaults < YAML < --set, unknown keys, coercion, shipped files."""

from __future__ import annotations

import dataclasses
import functools
import re
import typing
from pathlib import Path

import pytest
import yaml

from transformer_mt import cli
from transformer_mt.common.exits import TmtError
from transformer_mt.config import (
    SECTIONS,
    Config,
    Corpus,
    DeviceName,
    Interval,
    NonEmpty,
    SamplingMethod,
    TagText,
    TrainSplits,
    config_from_dict,
    config_hash,
    load_config,
    presets,
    to_dict,
    to_yaml,
)

REPO = Path(__file__).resolve().parent.parent


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_defaults_are_the_papers_base_recipe() -> None:
    cfg = Config()
    m, o, d = cfg.model, cfg.optim, cfg.decode
    assert (m.d_model, m.d_ff, m.n_heads, m.n_encoder_layers, m.n_decoder_layers) == (
        512,
        2048,
        8,
        6,
        6,
    )
    assert (m.dropout, m.pre_norm) == (0.1, False)
    assert (o.beta1, o.beta2, o.eps, o.warmup_steps, o.label_smoothing) == (
        0.9,
        0.98,
        1e-9,
        4000,
        0.1,
    )
    assert (d.beam_size, d.length_penalty, d.max_len_a, d.max_len_b) == (4, 0.6, 1.0, 50)
    assert cfg.tokenizer.vocab_size == 37000


def test_precedence_defaults_then_yaml_then_set(tmp_path: Path) -> None:
    path = write(
        tmp_path, "optim:\n  warmup_steps: 8000\n  lr_scale: 2.0\nmodel:\n  d_model: 256\n"
    )
    cfg = load_config(path, ["optim.warmup_steps=16000"])
    assert cfg.optim.warmup_steps == 16000  # --set beats YAML
    assert cfg.optim.lr_scale == 2.0  # YAML beats default
    assert cfg.model.d_model == 256
    assert cfg.model.d_ff == 2048  # default kept
    assert load_config(None, ["train.seed=7"]).train.seed == 7  # --set beats defaults alone


def test_later_set_wins_over_earlier() -> None:
    assert load_config(None, ["train.seed=3", "train.seed=4"]).train.seed == 4


def test_yaml_exponent_without_dot_is_coerced_to_float(tmp_path: Path) -> None:
    assert isinstance(yaml.safe_load("eps: 1e-9")["eps"], str)  # the PyYAML quirk being handled
    cfg = load_config(write(tmp_path, "optim:\n  eps: 1e-9\n  lr_scale: 2\n"))
    assert cfg.optim.eps == 1e-9 and isinstance(cfg.optim.eps, float)
    assert cfg.optim.lr_scale == 2.0 and isinstance(cfg.optim.lr_scale, float)


@pytest.mark.parametrize(
    ("override", "field", "expected"),
    [
        ("train.max_steps=1e5", ("train", "max_steps"), 100000),
        ("optim.eps=1e-8", ("optim", "eps"), 1e-8),
        ("train.compile=true", ("train", "compile"), "on"),  # YAML 1.1's bool for on/off
        ("data.bucketing=off", ("data", "bucketing"), "off"),
        (
            "data.src_lang=no",
            ("data", "src_lang"),
            "no",
        ),  # str fields keep the text (no YAML 1.1 bool)
        ("data.hf_config=2016", ("data", "hf_config"), "2016"),
        ("train.precision=bf16", ("train", "precision"), "bf16"),
        ("data.cache_dir=", ("data", "cache_dir"), ""),
    ],
)
def test_set_values_take_the_field_type(
    override: str, field: tuple[str, str], expected: object
) -> None:
    value = getattr(getattr(load_config(None, [override]), field[0]), field[1])
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "optim.warmup_step=8000",
            "unknown key optim.warmup_step; valid keys in optim: lr_scale, warmup_steps",
        ),
        (
            "optimizer.lr_scale=2",
            "unknown section 'optimizer'; valid sections: model, tokenizer, data",
        ),
        ("train.max_steps=1.5", "train.max_steps = 1.5: expected an integer"),
        ("train.compile=maybe", "train.compile = 'maybe': expected one of 'auto', 'on', 'off'"),
        ("train.precision=fp8", "train.precision = 'fp8': expected one of 'fp32', 'bf16', 'fp16'"),
        ("optim.eps=tiny", "optim.eps = 'tiny': expected a number"),
        ("train.seed", "expected section.key=value"),
        ("seed=1", "expected section.key=value"),
    ],
)
def test_bad_overrides_name_the_key(override: str, message: str) -> None:
    with pytest.raises(TmtError) as err:
        load_config(None, [override])
    assert message in str(err.value)


def test_unknown_yaml_key_names_file_and_lists_valid_keys(tmp_path: Path) -> None:
    path = write(tmp_path, "model:\n  d_modle: 256\n")
    with pytest.raises(TmtError) as err:
        load_config(path)
    assert str(path) in str(err.value)
    assert "unknown key model.d_modle" in str(err.value)
    assert "d_model" in str(err.value)


def test_yaml_bool_where_a_string_belongs_asks_for_quotes(tmp_path: Path) -> None:
    with pytest.raises(TmtError, match="data.src_lang = False: expected a string \\(quote it"):
        load_config(write(tmp_path, "data:\n  src_lang: no\n"))


def test_invalid_yaml_names_the_line(tmp_path: Path) -> None:
    path = write(tmp_path, "model:\n  d_model: 256\n  d_ff: [1\n")
    with pytest.raises(TmtError, match=rf"{path}:\d+: invalid YAML"):
        load_config(path)


@pytest.mark.parametrize(
    ("text", "line", "key"),
    [
        ("model:\n  d_model: 256\nmodel:\n  d_ff: 1024\n", 3, "model"),
        ("model:\n  d_model: 256\n  dropout: 0.2\n  d_model: 512\n", 4, "d_model"),
    ],
)
def test_a_key_given_twice_is_refused_naming_its_line(
    tmp_path: Path, text: str, line: int, key: str
) -> None:
    """PyYAML keeps the second silently: one of the two settings would be lost without a word."""
    path = write(tmp_path, text)
    with pytest.raises(TmtError, match=rf"{path}:{line}: invalid YAML: '{key}' is given twice"):
        load_config(path)


def test_keys_written_over_a_merged_mapping_replace_its_keys(tmp_path: Path) -> None:
    """YAML's merge key is not a key given twice: what follows it replaces what it merged."""
    anchored = "x: &m {d_model: 256, dropout: 0.2}\nmodel:\n  <<: *m\n  d_model: 64\n"
    from transformer_mt.config import _read_yaml

    assert _read_yaml(write(tmp_path, anchored))["model"] == {"d_model": 64, "dropout": 0.2}


def test_missing_config_lists_presets() -> None:
    with pytest.raises(
        TmtError, match="no such file or preset .*base, big, multi30k, multi30k-gpu, student, tiny"
    ):
        load_config("nope.yaml")


def test_top_level_must_be_a_mapping(tmp_path: Path) -> None:
    with pytest.raises(TmtError, match="expected a mapping"):
        load_config(write(tmp_path, "- a\n- b\n"))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        # Each names the values it compares, so a user sees which side to change.
        ("model.n_heads=7", "model.d_model must be divisible by model.n_heads (512 and 7)"),
        ("data.max_tokens=100", "data.max_len + 1 must be <= data.max_tokens (256 + 1 and 100)"),
        ("model.max_positions=200", "data.max_len + 1 must be <= model.max_positions (256 + 1"),
        ("data.tgt_lang=de", "data.src_lang and data.tgt_lang must differ"),
        ("decode.nbest=5", "decode.nbest must be <= decode.beam_size (5 and 4;"),
        ("distill.nbest=9", "distill.nbest must be <= distill.beam_size (9 and"),
    ],
)
def test_cross_field_checks(override: str, message: str) -> None:
    with pytest.raises(TmtError, match=re.escape(message)):
        load_config(None, [override])


# --- every field has a range -------------------------------------------------------------------

# Text fields where "" means "none" or "the default"; every other text field must be non-empty.
MAY_BE_EMPTY = {
    "tokenizer.model_path",
    "data.path",
    "data.hf_config",
    "data.src_field",
    "data.tgt_field",
    "data.cache_dir",
    "train.init_from",
    "decode.target_lang",
    "data.terms.dictionary",
    "glossary.path",
    "serve.glossary_dir",
    "corpus.path",
    "corpus.hf_config",
    "corpus.src_field",
    "corpus.tgt_field",
}


def every_field() -> list[tuple[str, object]]:
    """(key, type) of every leaf of the tree: a nested section's keys (data.terms.annotate) too."""
    fields = []

    def leaves(prefix: str, cls: type) -> None:
        hints = typing.get_type_hints(cls, include_extras=True)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                leaves(f"{prefix}.{f.name}", hints[f.name])
            else:
                fields.append((f"{prefix}.{f.name}", hints[f.name]))

    for section, cls in [*typing.get_type_hints(Config).items(), ("corpus", Corpus)]:
        leaves(section, cls)
    return fields


def test_every_field_has_a_range() -> None:
    """Numbers carry an Interval, text is non-empty or listed as optional, the rest are choices."""
    assert {key.split(".")[0] for key, _ in every_field()} == {*SECTIONS, "corpus"}
    for key, kind in every_field():
        base, rule = kind, None
        if typing.get_origin(kind) is typing.Annotated:
            base, rule = typing.get_args(kind)
        if base in (int, float):
            assert isinstance(rule, Interval), f"{key}: a number without a range"
        elif base is str:
            ruled = isinstance(rule, NonEmpty | DeviceName | SamplingMethod | TagText)
            assert ruled != (key in MAY_BE_EMPTY), f"{key}: may it be empty?"
        elif key == "data.train":
            assert isinstance(rule, TrainSplits), key
        else:
            assert base is bool or typing.get_origin(base) is typing.Literal, key


def outside(rule: Interval, base: type) -> list[object]:
    """Values just outside the interval, and a non-finite one for floats."""
    step = 1 if base is int else 0.5
    values: list[object] = []
    if rule.low is not None:
        values.append(rule.low if rule.low_open else rule.low - step)
    if rule.high is not None:
        values.append(rule.high if rule.high_open else rule.high + step)
    if base is float:
        values.append(float("nan"))
    return values


@pytest.mark.parametrize(("key", "kind"), every_field(), ids=[k for k, _ in every_field()])
def test_out_of_range_values_are_one_line_errors_naming_key_value_and_range(key, kind) -> None:
    if typing.get_origin(kind) is not typing.Annotated:
        return  # bool and Literal fields: their choices are their range (test_bad_overrides_...)
    base, rule = typing.get_args(kind)
    if isinstance(rule, Interval):
        bad_values = outside(rule, base)
    else:
        bad_values = {
            DeviceName: ["", "gpu", "cuda:x"],
            SamplingMethod: ["", "beam", "topk:0", "topk:x", "topp:0", "topp:1.5"],
            TagText: ["a b", "<s>"],
        }.get(type(rule), [""])
    assert bad_values, key
    for bad in bad_values:
        named, override = key, f"{key}={bad}"
        if key.startswith("corpus."):  # a key of an item of the list data.train
            name = key.removeprefix("corpus.")
            named = f"data.train[0].{name}"
            override = f"data.train=[{{split: train, {name}: '{bad}'}}]"
        with pytest.raises(TmtError) as err:
            load_config("tiny", [override])
        message = str(err.value)  # the library names its parameter; the CLI, its flag
        assert message.startswith(f"overrides {override}: {named} = "), message
        assert err.value.render(cli._flag).startswith(f"--set {override}: {named} = ")
        expected = str(rule).removeprefix("in ")
        assert expected in message and "\n" not in message
        assert "a finite number a finite number" not in message  # said once (--lenpen nan)


def test_ranges_hold_for_configs_built_in_code() -> None:
    cfg = Config()
    with pytest.raises(TmtError, match=r"model.dropout = 1.5: expected in \[0, 1\)"):
        dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dropout=1.5))


def test_set_errors_blame_the_set_not_the_yaml(tmp_path: Path) -> None:
    path = write(tmp_path, "model:\n  d_model: 32\n")
    with pytest.raises(TmtError) as err:
        load_config(path, ["model.d_ff=abc"])
    assert err.value.render(cli._flag).startswith("--set model.d_ff=abc: model.d_ff = 'abc'")
    with pytest.raises(TmtError) as err:
        load_config(path, ["model.d_fff=3"])
    assert err.value.render(cli._flag).startswith("--set model.d_fff=3: unknown key model.d_fff")
    bad_file = write(tmp_path, "model:\n  d_ff: abc\n")
    with pytest.raises(TmtError) as err:
        load_config(bad_file, ["model.d_model=64"])
    assert str(err.value).startswith(f"{bad_file}: model.d_ff = 'abc'")


def test_config_is_frozen() -> None:
    cfg = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model.d_model = 1  # type: ignore[misc]


def test_yaml_round_trip_is_identity(tmp_path: Path) -> None:
    cfg = load_config("multi30k", ["optim.eps=1e-8", "train.seed=9"])
    path = tmp_path / "resolved.yaml"
    path.write_text(to_yaml(cfg))
    assert load_config(path) == cfg
    assert config_from_dict(to_dict(cfg)) == cfg
    assert config_hash(load_config(path)) == config_hash(cfg)
    assert config_hash(load_config(path, ["train.seed=10"])) != config_hash(cfg)


def test_every_shipped_config_loads() -> None:
    files = sorted((REPO / "configs").glob("**/*.yaml"))
    assert files, "no shipped configs found"
    assert {f.stem for f in files} >= {"tiny", "multi30k", "base", "big"}
    for path in files:
        cfg = load_config(path)
        # Every key in the file is a real field that took the file's value (nothing ignored).
        tree = yaml.safe_load(path.read_text())
        for section, values in tree.items():
            for key, value in values.items():
                assert getattr(getattr(cfg, section), key) == value, f"{path}: {section}.{key}"


def test_every_set_in_the_shipped_scripts_is_a_real_key_and_value() -> None:
    # The demo, the recipes and the Makefile pass their departures as --set: a renamed key must fail here, not
    # ten minutes into `make demo`. Values from shell variables are checked by name only.
    import re

    pattern = re.compile(r'--set\s+"?([a-z_]+)\.([a-z_.]+)=("?\$?[^\s")]*)')
    found = []
    for path in [*sorted((REPO / "scripts").glob("*.sh")), REPO / "Makefile"]:
        for section, key, value in pattern.findall(path.read_text()):
            found.append(f"{section}.{key}")
            *nested, name = key.split(".")  # data.terms.annotate: a key of data's terms
            owner = functools.reduce(getattr, nested, getattr(Config(), section))
            assert name in {f.name for f in dataclasses.fields(owner)}, (
                f"{path.name}: {section}.{key}"
            )
            if "$" not in value and value:
                load_config("multi30k", [f"{section}.{key}={value.strip(chr(34))}"])
    assert "optim.schedule" in found and "train.max_minutes" in found


def test_presets_are_the_shipped_files() -> None:
    shipped = presets()
    assert set(shipped) == {f.stem for f in (REPO / "configs").glob("*.yaml")}
    assert load_config("base") == load_config(REPO / "configs" / "base.yaml")
    # -c's help lists them all (it had missed multi30k-gpu, added after it was written)
    from transformer_mt import flags

    listed = typing.get_args(flags.ConfigOption)[1].help.split(": ", 1)[1].rstrip(".")
    assert sorted(listed.split(", ")) == sorted(shipped)


def test_paper_models_in_base_and_big() -> None:
    base, big = load_config("base"), load_config("big")
    assert (base.model.d_model, base.model.n_heads, base.model.d_ff, base.model.dropout) == (
        512,
        8,
        2048,
        0.1,
    )
    assert (big.model.d_model, big.model.n_heads, big.model.d_ff, big.model.dropout) == (
        1024,
        16,
        4096,
        0.3,
    )
    for cfg in (base, big):
        assert (cfg.data.source, cfg.data.path, cfg.data.hf_config) == ("hf", "wmt14", "de-en")
        assert (cfg.data.src_lang, cfg.data.tgt_lang) == ("en", "de")


# --- data.train as a list of corpora -----------------------------------------------------------


def test_a_list_of_corpora_reads_from_yaml_and_set_and_round_trips(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "data:\n  source: files\n  train:\n    - {split: clean, weight: 3}\n"
        "    - crawl\n    - {split: bt.tsv, source: tsv, tag: <BT>}\n",
    )
    cfg = load_config(path)
    assert cfg.data.train == (
        Corpus("clean", weight=3.0),
        Corpus("crawl"),
        Corpus("bt.tsv", tag="<BT>", source="tsv"),
    )
    assert load_config(path, ["data.train=[{split: a, weight: 2}]"]).data.train == (
        Corpus("a", 2.0),
    )
    assert load_config(path, ["data.train=plain"]).data.train == "plain"  # one split, as ever
    again = config_from_dict(yaml.safe_load(to_yaml(cfg)))
    assert again == cfg and config_hash(again) == config_hash(cfg)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("[]", "data.train = (): expected a split (a non-empty string) or a non-empty list"),
        ("[{split: a, wieght: 3}]", "unknown key data.train[0].wieght; valid keys: split, weight"),
        ("[{weight: 2}]", "data.train[0]: no split"),
        ("[a, {split: b, weight: -1}]", "data.train[1].weight = -1.0: expected > 0"),
        ("[{split: a, source: ftp}]", "data.train[0].source = 'ftp': expected one of"),
        ("[[a]]", "data.train[0]: expected a mapping of split, weight, tag"),
    ],
)
def test_bad_corpora_are_one_line_errors_naming_the_item(value: str, message: str) -> None:
    with pytest.raises(TmtError) as err:
        load_config("tiny", [f"data.train={value}"])
    assert message in str(err.value) and "\n" not in str(err.value)
