"""Config: paper defaults, precedence defaults < YAML < --set, unknown keys, coercion, shipped files."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from transformer_mt.config import (
    Config,
    config_from_dict,
    config_hash,
    load_config,
    presets,
    to_dict,
    to_yaml,
)
from transformer_mt.exits import TmtError

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
        ("train.compile=true", ("train", "compile"), True),
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
        ("train.compile=maybe", "train.compile = 'maybe': expected true or false"),
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


def test_missing_config_lists_presets() -> None:
    with pytest.raises(TmtError, match="no such file or preset .*base, big, multi30k, tiny"):
        load_config("nope.yaml")


def test_top_level_must_be_a_mapping(tmp_path: Path) -> None:
    with pytest.raises(TmtError, match="expected a mapping"):
        load_config(write(tmp_path, "- a\n- b\n"))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.n_heads=7", "model.d_model must be divisible by model.n_heads"),
        ("data.max_len=5000", "data.max_len + 1 must be <= data.max_tokens"),
        ("data.tgt_lang=de", "data.src_lang and data.tgt_lang must differ"),
        ("data.max_len_ratio=0.5", "data.max_len_ratio must be >= 1"),
    ],
)
def test_cross_field_checks(override: str, message: str) -> None:
    with pytest.raises(TmtError, match=message.replace("+", r"\+")):
        load_config(None, [override])


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


def test_presets_are_the_shipped_files() -> None:
    shipped = presets()
    assert set(shipped) == {f.stem for f in (REPO / "configs").glob("*.yaml")}
    assert load_config("base") == load_config(REPO / "configs" / "base.yaml")


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
