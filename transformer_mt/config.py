"""One frozen config tree with the paper's names and defaults (Vaswani et al., 2017).

Precedence: dataclass defaults < YAML file < `--set section.key=value` overrides. Unknown keys are
errors that list the valid ones; values are coerced to each field's type (PyYAML reads `1e-9` as a
string). Derived values (vocab size, special ids, world size) are never written back: they are
arguments of the functions that need them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import reprlib
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml

from transformer_mt.common.exits import TmtError, first_line


@dataclass(frozen=True)
class Interval:
    """The values a number field accepts (always finite); a field's type carries its interval."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def __str__(self) -> str:
        if self.low is None and self.high is None:
            return "a finite number"
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {_number(self.low)}"
        return (
            f"in {'(' if self.low_open else '['}{_number(self.low)}, {_number(self.high)}"
            f"{')' if self.high_open else ']'}"
        )


def _number(x: float | None) -> str:
    return str(int(x)) if x is not None and float(x).is_integer() else f"{x:g}"


class NonEmpty:
    """The range of a text field that may not be empty."""

    def __contains__(self, value: str) -> bool:
        return bool(value.strip())

    def __str__(self) -> str:
        return "a non-empty string"


class DeviceName:
    """auto (CUDA when there is a GPU), cpu, cuda, or cuda:N (the N-th GPU)."""

    def __contains__(self, value: str) -> bool:
        index = value.removeprefix("cuda:")
        return value in ("auto", "cpu", "cuda") or (index != value and index.isdigit())

    def __str__(self) -> str:
        return "auto, cpu, cuda or cuda:N"


class SamplingMethod:
    """none (search: greedy or beam), full, topk:K (K >= 1) or topp:P (0 < P <= 1)."""

    def __contains__(self, value: str) -> bool:
        kind, colon, number = value.partition(":")
        if not colon:
            return value in ("none", "full")
        try:
            return (kind == "topk" and int(number) >= 1) or (
                kind == "topp" and 0 < float(number) <= 1
            )
        except ValueError:
            return False

    def __str__(self) -> str:
        return "none, full, topk:K (K >= 1) or topp:P (0 < P <= 1)"


class TagText:
    """A corpus tag: "" (none) or one word without whitespace, e.g. <BT>; not a special piece."""

    def __contains__(self, value: str) -> bool:
        return value == "" or (
            not any(c.isspace() for c in value) and value not in ("<pad>", "<unk>", "<s>", "</s>")
        )

    def __str__(self) -> str:
        return '"" or one word without whitespace (e.g. <BT>), not <pad>, <unk>, <s> or </s>'


class TrainSplits:
    """data.train: one split (a non-empty string) or a non-empty list of corpora."""

    def __contains__(self, value: object) -> bool:
        return bool(value.strip()) if isinstance(value, str) else bool(value)

    def __str__(self) -> str:
        return "a split (a non-empty string) or a non-empty list of corpora"


# The ranges of most fields, by meaning; the type of every number field carries one.
Count = Annotated[int, Interval(1)]  # sizes, layers, heads, steps per event: at least 1
Number = Annotated[int, Interval(0)]  # budgets and intervals: 0 = none / off
Fraction = Annotated[float, Interval(0.0, 1.0, high_open=True)]  # dropout, smoothing, β: [0, 1)
Amount = Annotated[float, Interval(0.0)]  # scales, minutes, lengths: >= 0
Positive = Annotated[float, Interval(0.0, low_open=True)]  # ε, timeouts: > 0
Real = Annotated[float, Interval()]  # any finite number
Text = Annotated[str, NonEmpty()]


@dataclass(frozen=True)
class ModelConfig:
    d_model: Count = 512  # §3.1 width of every sublayer output and embedding
    d_ff: Count = 2048  # §3.3 inner width of the position-wise feed-forward network
    n_heads: Count = 8  # §3.2.2 h, parallel attention heads
    n_encoder_layers: Count = 6  # §3.1 N, encoder stack depth
    n_decoder_layers: Count = 6  # §3.1 N, decoder stack depth
    dropout: Fraction = 0.1  # §5.4 P_drop on sublayer outputs and embedding+position sums
    attention_dropout: Fraction = 0.0  # departure (fairseq/t2t): dropout on attention weights
    # Rows of the sinusoidal table (§3.5): the longest sequence, specials included. At most
    # 65,536 (peers' longest are in the thousands): the table is built whole, so a foreign
    # config's 10^8 would take gigabytes before its weights are read.
    max_positions: Annotated[int, Interval(2, 65_536)] = 1024
    pre_norm: bool = False  # departure: LayerNorm before each sublayer (+ final norms)
    # How attention is computed (not part of the model: any value runs any model): "auto" lets
    # tmt choose for the device (network/kernels.py attention_kernels), or one of
    # scaled_dot_product_attention's kernels: flash, efficient (memory-efficient), cudnn, math.
    attention_backend: Literal["auto", "flash", "efficient", "cudnn", "math"] = "auto"
    # Departures that models of other toolkits carry (tmt import: OPUS-MT's Marian models).
    # §3.3 max(0, ·); "swish" x·σ(x) (Marian's default, HF's silu), "gelu" (erf, as HF's gelu).
    activation: Literal["relu", "swish", "gelu"] = "relu"
    output_bias: bool = False  # a bias on the pre-softmax projection (Marian's final_logits_bias)
    # The decoder's first input: <s> (tmt's), or <pad> (Marian's: its vocabularies have no <s>).
    decoder_start: Literal["bos", "pad"] = "bos"
    # §3.4 one matrix for the source and target embeddings and the pre-softmax projection; false:
    # the source has its own (separate source and target vocabularies), the target's stays tied.
    share_embeddings: bool = True


@dataclass(frozen=True)
class TokenizerConfig:
    # §5.1 shared source-target vocabulary of about 37000 tokens (EN-DE).
    vocab_size: Annotated[int, Interval(8)] = 37000
    model_type: Literal["bpe", "unigram"] = "bpe"  # §5.1 byte-pair encoding
    # sentencepiece: the share of characters kept as pieces.
    character_coverage: Annotated[float, Interval(0.0, 1.0, low_open=True)] = 0.9995
    byte_fallback: bool = True  # rare characters become byte pieces instead of <unk>
    max_sentences: Count = 2_000_000  # sampling cap: at most this many sentences train the model
    model_path: str = ""  # an existing sentencepiece .model to use instead of training one


Source = Literal["multi30k", "files", "tsv", "jsonl", "hf", "hf_disk"]


@dataclass(frozen=True)
class Corpus:
    """One training corpus of a mixture (data.train given as a list). An empty text field takes
    the data section's value, so a list of prefixes needs only `split` (and `weight`, `tag`)."""

    split: Text  # what data.train names for one corpus: a split name, a path prefix or a file
    # Its share of every epoch: an epoch draws as many pairs as all corpora keep together, this
    # corpus weight / (sum of weights) of them (a subset, or every pair more than once).
    weight: Annotated[float, Interval(0.0, low_open=True)] = 1.0
    # Prepended to every source sentence (Caswell et al., 2019: tagged back-translation); added
    # to the sentencepiece model as a user-defined symbol, so it is always one piece.
    tag: Annotated[str, TagText()] = ""
    # The data section's keys of the same names, for this corpus ("" = the data section's value).
    source: Literal["", "multi30k", "files", "tsv", "jsonl", "hf", "hf_disk"] = ""
    path: str = ""
    hf_config: str = ""
    src_field: str = ""
    tgt_field: str = ""

    def __post_init__(self) -> None:
        problem = _field_problem(self, "data.train[]")
        if problem:
            raise _error(problem)


Corpora = tuple[Corpus, ...]


@dataclass(frozen=True)
class TermsConfig:
    """data.terms: term hints in training sources (Dinu et al. 2019: inline annotation), so that
    a glossary costs nothing at translation time (glossary.mode hint, auto); and how `tmt terms`
    builds the dictionary they come from (hints.py, terms.py; the manual's "Glossaries and
    terminology")."""

    dictionary: str = ""  # source -> target entries (tmt terms' TSV, or any glossary); "" = none
    # The share of training sentences with a dictionary term (its target in the reference) that
    # get hints, drawn anew each epoch from (train.seed, epoch, pair): 0 = none (Dinu: 0.1).
    annotate: Fraction = 0.0
    # append: "der <t> Hund </t> <tr> dog </tr> bellt"; replace: "der <tr> dog </tr> bellt".
    style: Literal["append", "replace"] = "append"
    # The hint is the target word's lemma (simplemma), so that the model learns to inflect it
    # (Bergmanis & Pinnis 2021); false: the surface form the reference uses.
    lemma: bool = False
    span_share: Annotated[float, Interval(0.0, 1.0, low_open=True)] = 0.5  # of a sentence's terms
    # tmt terms: what a dictionary entry needs (its source and target words aligned together).
    min_count: Count = 5  # pairs in which the source phrase is aligned to the target phrase
    min_prob: Annotated[float, Interval(0.0, 1.0)] = 0.1  # p(target | source)
    max_words: Annotated[int, Interval(1, 5)] = 3  # words a side of a phrase
    skip_common: Number = 150  # the most frequent words of each side are no terms (Dinu: 500)
    chunk_pairs: Count = 100_000  # pairs aligned at a time (the unit of resuming and of memory)


@dataclass(frozen=True)
class DataConfig:
    # Where the parallel text comes from:
    #   multi30k  the corpus bundled with tmt (splits train, val, test_2016_flickr; en, de, fr)
    #   files     a plain or .gz text file per language: PREFIX.{lang} or PREFIX.{lang}.gz
    #   tsv       one file, tab-separated columns (see src_field)
    #   jsonl     one JSON object per line (see src_field)
    #   hf        datasets.load_dataset(path, hf_config, split=...): a hub name or a local directory
    #   hf_disk   datasets.load_from_disk(path): a DatasetDict written by save_to_disk
    source: Source = "multi30k"
    src_lang: Text = "de"  # the source language's code (ISO 639-1 or -3), as the files name it
    tgt_lang: Text = "en"  # the target language's code
    path: str = ""  # hf: dataset name or directory; hf_disk: the saved DatasetDict's directory
    hf_config: str = ""  # hf: configuration name, e.g. "de-en" for wmt14
    # Splits: a split name (multi30k, hf, hf_disk), a path prefix (files) or a file (tsv, jsonl).
    # data.train may also be a list of corpora, each a mapping with the keys of `Corpus` (split,
    # weight, tag, and source/path/hf_config/src_field/tgt_field when they differ from these).
    train: Annotated[str | Corpora, TrainSplits()] = "train"
    valid: Text = "val"  # validation split: the loss and BLEU that pick the best checkpoint
    test: Text = "test_2016_flickr"  # the split `tmt evaluate` scores by default
    # tsv: "" reads columns 0 and 1 with no header; names pick columns of a header line; digits pick
    # columns by index. jsonl/hf: "" reads record["translation"][lang]; names read top-level fields.
    src_field: str = ""
    tgt_field: str = ""
    encoding_errors: Literal["strict", "replace", "skip"] = "strict"  # invalid UTF-8 policy
    max_len: Count = 256  # training pairs with more subword tokens on either side are filtered
    # ... and pairs whose longer side exceeds this multiple of the shorter.
    max_len_ratio: Annotated[float, Interval(1.0)] = 3.0
    # Batch budget per rank: sentences × padded length of the longer side. 0 = by device: 4096 on
    # a CPU; on CUDA the paper's ~25,000 tokens an update (§5.1), shared by the ranks. A resumed
    # run keeps its own.
    max_tokens: Number = 0
    # Bounded batch shapes (data/sampler.py): lengths padded up to buckets chosen from the
    # corpus's length distribution, rows a multiple of rows_multiple, so that an epoch has a few
    # hundred shapes at most (a GPU builds kernels and plans per shape). auto: on with CUDA; on a
    # CPU, exact lengths (the least padding). A resumed run keeps its own.
    bucketing: Literal["auto", "on", "off"] = "auto"
    source_buckets: Count = 32  # bucketing: source lengths an epoch pads to
    target_buckets: Count = 8  # bucketing: target lengths per source bucket
    rows_multiple: Count = 8  # bucketing: a batch's sentences, a multiple of this (fairseq's)
    num_proc: Count = 1  # processes that encode the corpus (datasets.map)
    # Subword regularization (departure): BPE-dropout (Provilkov et al., 2020), Kudo's (2018)
    # idea for a bpe model: each training pair's words are merged afresh, every candidate merge
    # skipped with probability subword_alpha, the same draw per (train.seed, epoch, pair). 0 =
    # off: one segmentation (§5.1). Validation and translation are never sampled. Batches are
    # packed by the unsampled lengths (data.max_tokens); a draw over data.max_len is not used.
    subword_alpha: Fraction = 0.0
    subword_sides: Literal["source", "both"] = "source"  # which sides are sampled
    cache_dir: str = ""  # tokenized-corpus cache; "" = $TMT_CACHE or ~/.cache/transformer_mt
    # Departure: apply the clean section's filters to the training corpora as they are read
    # (tmt clean's rules; the result cached with the encoding). Validation is never cleaned.
    clean: bool = False
    terms: TermsConfig = field(default_factory=TermsConfig)  # departure: term hints (data.terms)


@dataclass(frozen=True)
class CleanConfig:
    """`tmt clean` and data.clean: each filter on or off, and its threshold (filters.py; the
    defaults, their sources and what they remove: the manual, "Data and cleaning")."""

    empty: bool = True  # a side empty or blank
    encoding: bool = True  # control characters, U+FFFD, mojibake (Ã© for é)
    length: bool = True  # words per side (not for zh, ja, th...) and characters
    min_words: Count = 1  # words a side at least
    max_words: Count = 150  # OpusCleaner's and Mozilla's max_length
    max_chars: Count = 1024  # bicleaner-hardrules' not_too_long
    ratio: bool = True  # the longer side over the shorter, in characters (UTF-8 bytes for CJK)
    max_ratio: Annotated[float, Interval(1.0)] = 3.0  # bicleaner-hardrules' length_ratio
    copy: bool = True  # the target is the source once case, spaces and punctuation are set aside
    copy_min_words: Count = 3  # ... with this many words with letters: shorter copies are names
    script: bool = True  # letters in each side's expected script (those of shared tokens aside)
    min_script_share: Annotated[float, Interval(0.0, 1.0)] = 0.5  # of a side's letters
    symbols: bool = True  # digits, punctuation and symbols among a side's characters
    max_symbol_share: Annotated[float, Interval(0.0, 1.0)] = 0.5  # bicleaner's no_only_numbers
    overlap: bool = True  # a source or target of data.valid or data.test (normalised)
    duplicate: bool = True  # a pair seen before, byte for byte
    near_duplicate: bool = True  # ... once case, spaces and punctuation are set aside
    langid: bool = False  # each side identified as its language (py3langid: the clean extra)
    langid_min_chars: Count = 20  # shorter sides (shared tokens aside) are not identified
    langid_min_prob: Annotated[float, Interval(0.0, 1.0)] = 0.1  # a side under it goes
    examples: Annotated[int, Interval(0, 100)] = 3  # removed pairs shown per filter


@dataclass(frozen=True)
class DistillConfig:
    """`tmt distill`: sequence-level knowledge distillation (Kim & Rush, 2016). The teacher
    translates data.train's sources; the config's model (the student) trains on its outputs."""

    beam_size: Count = 4  # the teacher's beam (Kim & Rush: 5; Marian's students: 4-8)
    nbest: Count = 4  # hypotheses a source; the one nearest its reference is kept (1: the best)
    select_by: Literal["chrf", "bleu"] = "chrf"  # sentence-level score against the reference
    original_weight: Annotated[float, Interval(0.0)] = 0.0  # the original pairs in the mixture
    eval_split: Literal["valid", "test"] = "valid"  # where student and teacher are compared
    export: Literal["none", "ctranslate2", "huggingface"] = "ctranslate2"  # the student's export
    quantization: Literal["none", "int8"] = "none"  # ... its weights (ctranslate2 only)
    # The student's lexical shortlist (tmt shortlist) from the distilled corpora, beside its model:
    # used only where decode.shortlist asks for it.
    shortlist: bool = True


@dataclass(frozen=True)
class OptimConfig:
    lr_scale: Amount = 1.0  # §5.3 multiplier of d_model^-0.5 · min(step^-0.5, step · warmup^-1.5)
    warmup_steps: Count = 4000  # §5.3
    beta1: Fraction = 0.9  # §5.3 Adam β1
    beta2: Fraction = 0.98  # §5.3 Adam β2
    eps: Positive = 1e-9  # §5.3 Adam ε
    label_smoothing: Fraction = 0.1  # §5.4 ε_ls
    clip_norm: Amount = 0.0  # departure: clip the global gradient norm to this value (0 = off)
    # "noam": §5.3, the rate peaks at warmup_steps and decays as step^-0.5, whatever the budget.
    # "budget" (departure): the run's budget in updates is planned (train.max_steps, max_epochs,
    # or train.max_minutes × the update rate measured early in the run): the paper's warmup to
    # its peak (lr_scale · d_model^-0.5 · warmup_steps^-0.5), sooner when the budget is short so
    # that the decay fits, the peak held, and a linear decay to zero over the budget's last
    # decay_fraction (warmup-stable-decay; optim.py BudgetSchedule). For runs a budget stops.
    schedule: Literal["noam", "budget"] = "noam"
    # budget: > 0 warms up over this fraction of the budget instead of warmup_steps
    warmup_fraction: Annotated[float, Interval(0.0, 1.0, high_open=True)] = 0.0
    decay_fraction: Annotated[float, Interval(0.0, 1.0, low_open=True)] = 0.2  # budget: decay


@dataclass(frozen=True)
class TrainConfig:
    out_dir: Text = "runs/default"  # run directory: config, metrics, tokenizer, checkpoints
    seed: Annotated[int, Interval(0, 2**31 - 1)] = 1  # initialisation, batch order, dropout
    max_steps: Number = 100_000  # §5.2 base model: 100K steps; whichever budget ends first stops
    max_epochs: Number = 0  # 0 = no epoch budget
    max_minutes: Amount = 0.0  # wall-clock budget; 0 = none
    update_freq: Count = 1  # micro-batches accumulated per optimizer step
    # What a step computes in: fp32; bf16 or fp16 under autocast (float32 weights, cast where a
    # product reads them; fp16 with a loss scaler); bf16_weights, the model's weights,
    # activations and gradients bf16 throughout and Adam updating a float32 master copy, which
    # checkpoints hold (fairseq's --bf16; training/master_weights.py): no casts, half the bytes
    # of layer norm's and the elementwise kernels' traffic.
    precision: Literal["fp32", "bf16", "fp16", "bf16_weights"] = "fp32"
    # torch.compile the model: "auto" leaves it off until it is measured to pay on the device
    # (scripts/bench_gpu.sh); "on" compiles it (a few seconds per batch shape: data.bucketing).
    compile: Literal["auto", "on", "off"] = "auto"
    # torch.compile's mode where the model is compiled: "reduce-overhead" replays a CUDA graph
    # per batch shape (one launch for the kernels a step's host would launch one by one: a GPU
    # trains the small models host-bound); on a CPU it is the default. "cudagraphs": the same
    # graphs of the model's own kernels, traced once for all shapes, no code generated.
    compile_mode: Literal[
        "default", "reduce-overhead", "max-autotune-no-cudagraphs", "cudagraphs"
    ] = "default"
    # CUDA graphs of a micro-batch's forward, loss and backward, recorded once per batch shape
    # and replayed (training/graphs.py): one launch for the ~800 kernels a host would launch one
    # by one, where a GPU trains a small model host-bound. On CUDA, at fp32, bf16 or
    # bf16_weights, without train.compile (several ranks: train.grad_sync after_backward); a CPU
    # has none to record and trains as with "off".
    cuda_graphs: Literal["off", "on"] = "off"
    # How several ranks (torchrun) average their gradients: "overlapped", DDP's all-reduces of
    # buckets of them while the backward pass runs; "after_backward", one all-reduce of them all
    # after the update's last backward pass (fairseq's legacy_ddp), which CUDA graphs need (a
    # recorded backward cannot run DDP's hooks). auto: after_backward with train.cuda_graphs=on,
    # else overlapped. Each rank's gradients divided by the ranks, then summed, either way.
    grad_sync: Literal["auto", "overlapped", "after_backward"] = "auto"
    # The label-smoothed loss in chunks of rows fused with the output projection (training/loss.py
    # chunked_label_smoothed_nll): no (tokens × vocabulary) logits or float32 log-probabilities
    # are kept for the backward pass. auto: on with CUDA, and on a CPU for a target vocabulary
    # of 4,000 pieces or more (faster there too); else the reference loss from the logits.
    fused_loss: Literal["auto", "on", "off"] = "auto"
    log_every: Count = 100  # steps between metrics.jsonl records
    valid_every: Number = 1000  # steps between validation loss measurements (0 = off)
    save_every: Number = 1000  # steps between checkpoints (0 = off)
    save_every_minutes: Amount = 10.0  # §6.1 checkpoints written at 10-minute intervals (0 = off)
    keep_last: Number = 5  # checkpoints kept besides the best; §6.1 averages the last 5 (base)
    # The best checkpoints by train.best_metric that are kept besides the newest (tmt average
    # --best N averages them); each checkpoint carries the validation scores of its step.
    keep_best: Count = 1
    bleu_every: Number = 0  # steps between validation BLEU (decoded like tmt evaluate); 0 = off
    bleu_beam_size: Count = 1  # beam size of validation BLEU decoding (1 = greedy)
    best_metric: Literal["val_loss", "val_bleu"] = "val_loss"  # what checkpoints/best tracks
    patience: Number = 0  # stop after this many validations without a better best_metric; 0 = never
    average_last: Number = 0  # at the end, average the newest N checkpoints into OUT_DIR/average
    nonfinite_patience: Count = 5  # consecutive non-finite updates (each skipped) before stopping
    oom_patience: Count = 10  # consecutive updates out of memory (each skipped) before stopping
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: CUDA when available
    distributed_timeout_s: Positive = 600.0  # a collective waiting longer fails, not hangs
    # A run directory whose checkpoint was trained with other settings (anything but budgets,
    # logging, checkpoint cadence, decoding and execution): "auto" refuses to resume it, naming
    # the keys; "force" resumes anyway and records the change in metrics.jsonl.
    resume: Literal["auto", "force"] = "auto"
    # Fine-tuning: start from this model's weights and tokenizer (a checkpoint, an averaged
    # model or a run directory) with a fresh optimizer, schedule and data position. Its model
    # and tokenizer settings must be this config's (dropout aside). "" = random initialisation.
    init_from: str = ""
    curves: bool = True  # draw OUT_DIR/curves.png at validations and the end (needs matplotlib)
    tensorboard: bool = False  # write event files to OUT_DIR/tensorboard (needs tensorboard)


@dataclass(frozen=True)
class DecodeConfig:
    beam_size: Count = 4  # §6.1; 1 = greedy
    length_penalty: Real = 0.6  # §6.1 α
    length_penalty_form: Literal["gnmt", "power"] = "gnmt"  # ((5+|Y|)/6)^α; |Y|^α (fairseq, HF)
    # When a sentence's search stops once it has k finished hypotheses: "bound" when no live one
    # can beat them under any length up to the maximum (tensor2tensor, the paper's code: exact,
    # the same output as searching to the maximum length); "current" when none beats them at its
    # current length (HF generate's default heuristic: fewer steps, may rarely differ);
    # "k_finished" as soon as it has them (fairseq's and CTranslate2's rule, HF's True).
    early_stopping: Literal["bound", "current", "k_finished"] = "bound"
    # The score of the EOS forced at a sentence's maximum length: its log-probability (tmt), or
    # 0 ("zero": transformers' forced_eos_token_id, which `tmt import` sets to decode as generate).
    forced_eos: Literal["log_prob", "zero"] = "log_prob"
    max_len_a: Amount = 1.0  # §6.1 maximum output length a · input length + b
    max_len_b: Number = 50  # §6.1 b: "input length + 50"
    # Source tokens per translation batch (padded), before beam expansion. 0 = by device: 4096 on
    # a CPU; on CUDA as many as half its free memory holds (translation/batch_budget.py).
    max_tokens: Number = 0
    nbest: Count = 1  # hypotheses written per input line (tmt translate --nbest)
    buffer_lines: Count = 256  # stdin lines translated together when they are already waiting
    device: Annotated[str, DeviceName()] = "auto"  # where translate and evaluate run
    # Which engine decodes: tmt's own search over the PyTorch model, or CTranslate2 (an export
    # of the model, made on first use beside it and checked against tmt; or -m EXPORT_DIR). With
    # ctranslate2, beam search is CTranslate2's: score / |Y|^α and its own stopping rule, so
    # length_penalty_form and early_stopping do not apply; sampling is refused (translate.py).
    engine: Literal["torch", "ctranslate2"] = "torch"
    # Weights and activations while decoding (scores are always summed in fp32): fp32; bf16 or
    # fp16 halve memory traffic on a GPU (fp16 needs one); bf16 on a CPU with bf16 arithmetic
    # (AVX512_BF16 or AMX; the linear layers packed for oneDNN in bf16) is faster than fp32 and
    # emulated, slower, on one without (a warning); int8 on a CPU: torch, the linear layers
    # dynamically quantized (torchao); ctranslate2, an int8 export. Speed and BLEU cost per
    # machine: docs/benchmarks.md.
    precision: Literal["fp32", "bf16", "fp16", "int8"] = "fp32"
    # float32 linear layers on a CPU, set at load: oneDNN with packed weights (1.4x faster beam
    # search on AVX-512, kernels.py), or "torch", PyTorch's own kernels (MKL on x86).
    cpu_linear: Literal["onednn", "torch"] = "onednn"
    # Each search step recorded as a CUDA graph per batch shape and replayed, one launch where
    # the host launched ~250 kernels a step: beam search's whole step (network/beam_graphs.py),
    # greedy's and sampling's decoder step (decoder_graphs.py). "on" takes effect on CUDA for
    # one PyTorch model without a shortlist; elsewhere decoding runs as "off" (logged).
    cuda_graphs: Literal["off", "on"] = "off"
    # Sampling instead of search (back-translation): "none", "full", "topk:K" or "topp:P", at
    # `temperature` (0 = greedy); nbest N = N independent samples per line. Each line's random
    # stream depends only on `seed` and the line's index in the input, so outputs are the same
    # with 1 or N processes and after a resume. beam_size is not used while sampling.
    sampling: Annotated[str, SamplingMethod()] = "none"
    temperature: Amount = 1.0
    seed: Number = 0
    # Alignments written after each translation (tmt translate --alignment; Marian's "text |||
    # i-j ..."): "subword" or "word" pairs in the Pharaoh format, source index first, from the
    # cross-attention of decoder layer `alignment_layer` (-2, the penultimate: Garg et al. 2019),
    # heads averaged, each target token to the source token it attends to most (alignment.py).
    alignment: Literal["none", "subword", "word"] = "none"
    # A multi-target model's target language (Marian's OPUS-MT models): its token >>xxx<< is put
    # first in every source line (and in training data that has no tag of its own); "" = none.
    target_lang: str = ""
    alignment_layer: Annotated[int, Interval(-128, 127)] = -2  # within the decoder: at load
    # tmt translate -i FILE -o FILE: lines per committed chunk (the unit of resuming and of
    # sharing the work among processes).
    chunk_lines: Count = 2000
    # A lexical shortlist (tmt shortlist; shortlist.py): each sentence's outputs scored over its
    # own candidates only (frequent pieces and its source pieces' likely translations): "none"
    # (the exact decode), "auto" (shortlist.npz beside the model), or a file's path. At load.
    shortlist: Annotated[str, NonEmpty()] = "none"


@dataclass(frozen=True)
class GlossaryConfig:
    """Glossaries (tmt translate --glossary FILE; the server's glossaries): source terms and the
    target terms every translation uses (glossary.py; the manual, "Glossaries and terminology")."""

    path: str = ""  # a TSV or CSV glossary; "" = none
    # strict: every line decoded as usual; a line whose output misses an entry it matched is
    # decoded again by constrained beam search (constraints.py), which puts every entry in.
    # check: decoded as usual, and only which entries the output uses is reported.
    # hint: each matched entry's target written into the source as a hint (hints.py; a model
    # trained with data.terms only), decoded as usual. auto: hint, then strict for the lines
    # whose output still misses an entry: the default for a model trained with hints.
    mode: Literal["strict", "check", "hint", "auto"] = "strict"
    beam: Count = 8  # the beam of constrained decoding (Post & Vilar's banks need room)
    case_sensitive: bool = False  # match sources with their case (default: case ignored)
    # Longer sources are skipped, counted in the log (0 = none: a trie matches any length at the
    # cost of the words a line shares with the entry, whatever its length; DeepL takes them).
    max_source_words: Number = 0


@dataclass(frozen=True)
class ServeConfig:
    """`tmt serve`: where it listens, how it batches, and the limits that keep it standing."""

    host: Text = "127.0.0.1"  # the address it binds; 0.0.0.0 opens it to the network
    port: Annotated[int, Interval(0, 65535)] = 8000  # 0: any free port (printed at the start)
    # Dynamic batching: the sentences of the requests waiting are decoded together, up to
    # max_tokens source tokens, after waiting for more (the last batch's clients, or whoever
    # keeps coming within gap_ms), at most max_wait_ms (batching.py says why).
    max_tokens: Count = 4096
    max_wait_ms: Amount = 50.0
    gap_ms: Amount = 2.0
    max_queue: Count = 1024  # sentences waiting; beyond that a request gets 503 and Retry-After
    max_sentences: Count = 128  # sentences in one request
    max_beam: Count = 16  # hypotheses a sentence a request may ask for (beam_size, nbest)
    max_chars: Count = 2000  # characters in one sentence
    max_body_bytes: Count = 1_048_576  # bytes in one request body
    body_seconds: Positive = 30.0  # time a request body has to arrive whole (else 408)
    header_seconds: Positive = 10.0  # time a request's headers have to arrive whole (else 408)
    drain_seconds: Amount = 30.0  # on SIGTERM or SIGINT: time in-flight requests get to finish
    # Stored glossaries (POST /v1/glossaries): kept here, one file each, written atomically;
    # "" = <cache>/glossaries ($TMT_CACHE or ~/.cache/transformer_mt).
    glossary_dir: str = ""
    max_glossaries: Count = 1000  # stored glossaries (DeepL: 1,000 an account)
    max_glossary_bytes: Count = 10_485_760  # one glossary's entries (DeepL: 10 MiB)


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    glossary: GlossaryConfig = field(default_factory=GlossaryConfig)
    clean: CleanConfig = field(default_factory=CleanConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)

    def __post_init__(self) -> None:
        for section in dataclasses.fields(self):
            problem = _field_problem(getattr(self, section.name), section.name)
            if problem:
                raise _error(problem)
        for ok, message in _relations(self):
            if not ok:
                raise _error(message)


def _relations(cfg: Config) -> list[tuple[bool, str]]:
    """(holds, what to do when it does not) of each rule between fields of different sections.

    Longer than 60 lines: one entry per rule, read as a table."""
    return [
        (
            cfg.model.d_model % cfg.model.n_heads == 0,
            f"model.d_model must be divisible by model.n_heads ({cfg.model.d_model} and"
            f" {cfg.model.n_heads})",
        ),
        (
            cfg.data.src_lang != cfg.data.tgt_lang,
            "data.src_lang and data.tgt_lang must differ",
        ),
        # A pair that passes the length filter must fit a batch and the positions (+1: eos).
        (
            not cfg.data.max_tokens or cfg.data.max_len + 1 <= cfg.data.max_tokens,
            f"data.max_len + 1 must be <= data.max_tokens ({cfg.data.max_len} + 1 and"
            f" {cfg.data.max_tokens})",
        ),
        (
            cfg.data.max_len + 1 <= cfg.model.max_positions,
            f"data.max_len + 1 must be <= model.max_positions ({cfg.data.max_len} + 1 and"
            f" {cfg.model.max_positions})",
        ),
        (
            cfg.train.max_steps > 0 or cfg.train.max_epochs > 0 or cfg.train.max_minutes > 0,
            "set a budget: train.max_steps, train.max_epochs or train.max_minutes",
        ),
        (
            cfg.train.best_metric != "val_bleu" or cfg.train.bleu_every > 0,
            "train.best_metric=val_bleu needs train.bleu_every > 0",
        ),
        (
            not cfg.train.patience
            or (cfg.train.bleu_every if cfg.train.best_metric == "val_bleu" else 0)
            or cfg.train.valid_every,
            "train.patience needs validation: train.valid_every > 0 (or train.bleu_every > 0"
            " with train.best_metric=val_bleu)",
        ),
        (  # sampling draws nbest samples; beam_size is not used
            cfg.decode.nbest <= cfg.decode.beam_size or cfg.decode.sampling != "none",
            f"decode.nbest must be <= decode.beam_size ({cfg.decode.nbest} and"
            f" {cfg.decode.beam_size}; or sample: decode.sampling)",
        ),
        (
            cfg.distill.nbest <= cfg.distill.beam_size,
            f"distill.nbest must be <= distill.beam_size ({cfg.distill.nbest} and"
            f" {cfg.distill.beam_size})",
        ),
        (
            not cfg.data.terms.annotate or bool(cfg.data.terms.dictionary),
            "data.terms.annotate needs data.terms.dictionary (tmt terms writes one)",
        ),
        (
            not cfg.data.terms.annotate or not cfg.data.subword_alpha,
            "data.terms.annotate and data.subword_alpha: one or the other (a hint's span is"
            " found in the segmentation the cache holds)",
        ),
        (
            cfg.distill.quantization == "none" or cfg.distill.export == "ctranslate2",
            "distill.quantization needs distill.export=ctranslate2",
        ),
    ]


_SECTION_TYPES: dict[str, type] = typing.get_type_hints(Config)  # section name -> dataclass
SECTIONS = list(_SECTION_TYPES)
# The sections that define a model: fixed for a run, its checkpoints and their averages.
MODEL_SECTIONS = ("model", "tokenizer")
# The values that leave a setting to the device (training/device_defaults.py): a resumed run keeps
# its own, so they never count as a change of settings.
BY_DEVICE = {"data.max_tokens": 0, "data.bucketing": "auto"}
# Keys of those sections that say how a model runs, not what it is: they may differ anywhere.
HOW_IT_RUNS = ("model.attention_backend",)


def presets() -> dict[str, Path]:
    """The YAML configs shipped with tmt, by name (installed from the repository's configs/)."""
    root = Path(str(resources.files("transformer_mt") / "configs"))
    return {path.stem: path for path in sorted(root.glob("*.yaml"))}


def resolve_config_path(name_or_path: str | Path) -> Path:
    """A path to a YAML file, or the name of a shipped preset (`base`, `multi30k`, ...)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = presets()
    if path.suffix == "" and str(path) in shipped:
        return shipped[str(path)]
    raise _error(
        f"config {str(path)!r}: no such file or preset (presets: {', '.join(sorted(shipped))})"
    )


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Defaults, then the YAML file (a path or a preset name), then each `section.key=value`."""
    tree: dict[str, dict[str, Any]] = {}
    origin = "defaults"
    if path is not None:
        file = resolve_config_path(path)
        origin = str(file)
        tree = _read_yaml(file)
    overridden = {}
    for item in overrides:
        section, key, value = _parse_override(item)
        _set(tree.setdefault(section, {}), key, value)
        overridden[f"{section}.{key}"] = f"{{overrides}} {item}"
    return config_from_dict(tree, origin=origin, origins=overridden)


def _set(section: dict[str, Any], key: str, value: Any) -> None:
    """section[key] = value; "terms.annotate" sets a key of the nested section "terms"."""
    head, dot, rest = key.partition(".")
    if dot and isinstance(section.get(head, {}), dict):
        section.setdefault(head, {})[rest] = value
    else:
        section[key] = value


def apply_overrides(cfg: Config, overrides: Sequence[str | tuple[str, str]]) -> Config:
    """`cfg` with `section.key=value` overrides; an override may come as (item, what the user
    typed), e.g. ("decode.beam_size=0", "--beam 0"), so that errors quote the user's words; a plain
    one is named as an item of `overrides` (the command line's --set)."""
    tree = to_dict(cfg)
    overridden = {}
    for entry in overrides:
        item, typed = entry if isinstance(entry, tuple) else (entry, f"{{overrides}} {entry}")
        section, key, value = _parse_override(item)
        if section not in tree:
            raise _error(
                f"{typed}: unknown section {_shown(section)}; valid sections: {', '.join(SECTIONS)}"
            )
        _set(tree[section], key, value)
        overridden[f"{section}.{key}"] = typed
    return config_from_dict(tree, origin="config", origins=overridden)


def config_from_dict(
    tree: Mapping[str, Any], origin: str = "config", origins: Mapping[str, str] | None = None
) -> Config:
    """A Config from a nested mapping (YAML, a checkpoint's copy), checking every key, type and
    range; errors name where each value came from (`origins` by key, else `origin`)."""
    if not isinstance(tree, Mapping):
        raise _error(f"{origin}: expected a mapping of sections, got {type(tree).__name__}")
    unknown = sorted(set(tree) - set(SECTIONS))
    if unknown:
        raise _error(
            f"{origin}: unknown section {_shown(unknown[0])}; valid sections: {', '.join(SECTIONS)}"
        )
    sections = {}
    for name, cls in _SECTION_TYPES.items():
        values = tree.get(name) or {}
        if not isinstance(values, Mapping):
            raise _error(f"{origin}: section {_shown(name)} must be a mapping of key: value")
        sections[name] = _section(cls, values, name, origin, origins or {})
    return Config(**sections)


def _section(
    cls: type, values: Mapping[str, Any], name: str, origin: str, origins: Mapping[str, str]
) -> Any:
    """One section (or a section nested in one, data.terms) from its mapping, each key checked."""
    hints = typing.get_type_hints(cls, include_extras=True)
    valid = [f.name for f in dataclasses.fields(cls)]
    coerced = {}
    for key, value in values.items():
        where = origins.get(f"{name}.{key}", origin)
        if key not in hints:
            raise _error(
                f"{where}: unknown key {name}.{key}; valid keys in {name}: {', '.join(valid)}"
            )
        if dataclasses.is_dataclass(hints[key]):  # a nested section
            nested = value if value is not None else {}
            if not isinstance(nested, Mapping):
                raise _error(f"{where}: {name}.{key} must be a mapping of key: value")
            coerced[key] = _section(hints[key], nested, f"{name}.{key}", origin, origins)
            continue
        coerced[key] = _coerce(value, hints[key], f"{name}.{key}", where)
    return cls(**coerced)


def to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    """Plain data (mappings, lists, numbers, text): what YAML, JSON and checkpoints hold."""
    tree = dataclasses.asdict(cfg)
    if isinstance(cfg.data.train, tuple):
        tree["data"]["train"] = [dict(corpus) for corpus in tree["data"]["train"]]
    return tree


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def config_hash(cfg: Config) -> str:
    """SHA-256 of the resolved config in canonical JSON."""
    return hashlib.sha256(json.dumps(to_dict(cfg), sort_keys=True).encode()).hexdigest()


def changed_keys(old: Config, new: Config, sections: Sequence[str] = SECTIONS) -> list[str]:
    """`section.key` of every value of `sections` that differs between two configs (HOW_IT_RUNS
    aside)."""
    a, b = to_dict(old), to_dict(new)
    return [
        f"{s}.{k}"
        for s in sections
        for k in b[s]
        if a[s][k] != b[s][k] and f"{s}.{k}" not in HOW_IT_RUNS
    ]


class _Text(str):
    """An override's value: kept as typed for str fields, parsed as YAML for every other type."""


# A value an error shows is cut to a glance: a list of 10^5 items, or an alias-built one of 9^8, is
# not printed whole (reprlib never walks what it does not show).
def _shown(value: Any) -> str:
    shown = reprlib.Repr()  # keyword arguments: Python 3.12 on
    shown.maxlevel, shown.maxlist, shown.maxtuple, shown.maxdict = 2, 6, 6, 6
    shown.maxstring = shown.maxother = 80
    return shown.repr(value)


def _error(message: str) -> TmtError:
    """A config error. It names an override by the loader's parameter, "{overrides} KEY=VALUE":
    the command line writes it as its flag, --set."""
    return TmtError(message, mentions=["overrides"])


def _parse_override(item: str) -> tuple[str, str, _Text]:
    key, sep, value = item.partition("=")
    section, dot, name = key.strip().partition(".")
    if not sep or not dot or not name:
        raise _error(
            f"{{overrides}} {item!r}: expected section.key=value, e.g. optim.warmup_steps=8000"
        )
    return section, name, _Text(value.strip())


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, but a key given twice in one mapping is an error: PyYAML keeps the
    last silently, so a setting written twice would lose one without a word."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # "<<: *anchor": keys written over it
                continue  # replace the merged ones, as YAML means
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, typing.Hashable):
                continue  # PyYAML's own error names it
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"{key!r} is given twice", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        tree = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or first_line(err)
        raise _error(f"{path}{where}: invalid YAML: {problem}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise _error(f"{path}: cannot read: {err}") from None
    except RecursionError:  # [[[[... a config holds nothing nested that deep
        raise _error(f"{path}: invalid YAML: nested too deeply to read") from None
    if tree is None:
        return {}
    if not isinstance(tree, dict):
        raise _error(f"{path}: expected a mapping of sections at the top level")
    return tree


def _field_problem(values: Any, prefix: str) -> str | None:
    """The first field of a config dataclass outside its range, as an error message, or None."""
    hints = typing.get_type_hints(type(values), include_extras=True)
    for f in dataclasses.fields(values):
        key, value = f"{prefix}.{f.name}", getattr(values, f.name)
        if dataclasses.is_dataclass(value):  # a nested section: its own fields
            problem = _field_problem(value, key)
            if problem:
                return problem
            continue
        problem = _out_of_range(value, hints[f.name])
        if problem:
            return f"{key} = {_shown(value)}: expected {problem}"
    return None


def _coerce_corpora(value: Any, key: str, origin: str) -> str | Corpora:
    """data.train: a split as text, or a list whose items are corpora (mappings of Corpus keys,
    or a bare split)."""
    if isinstance(value, _Text):
        parsed = None
        with contextlib.suppress(yaml.YAMLError, RecursionError):
            parsed = yaml.safe_load(value) if value.lstrip().startswith("[") else None
        value = parsed if isinstance(parsed, list) else str(value)
    if isinstance(value, str | Corpus):
        return value if isinstance(value, str) else (value,)
    if not isinstance(value, list | tuple):
        raise _error(f"{origin}: {key} = {_shown(value)}: expected {TrainSplits()}")
    valid = [f.name for f in dataclasses.fields(Corpus)]
    hints = typing.get_type_hints(Corpus, include_extras=True)
    corpora = []
    for index, item in enumerate(value):
        where = f"{key}[{index}]"
        if isinstance(item, Corpus):
            corpora.append(item)
            continue
        if isinstance(item, str):
            item = {"split": item}
        if not isinstance(item, Mapping):
            raise _error(f"{origin}: {where}: expected a mapping of {', '.join(valid)}")
        for name in item:
            if name not in hints:
                raise _error(
                    f"{origin}: unknown key {where}.{name}; valid keys: {', '.join(valid)}"
                )
        if "split" not in item:
            raise _error(f"{origin}: {where}: no split (the corpus to read, as data.train)")
        corpora.append(
            Corpus(**{k: _coerce(v, hints[k], f"{where}.{k}", origin) for k, v in item.items()})
        )
    return tuple(corpora)


def _coerce(value: Any, kind: Any, key: str, origin: str) -> Any:
    """Convert `value` to the field type `kind` and check its range, or raise a TmtError naming
    the key and where the value came from."""
    if typing.get_origin(kind) is Annotated and typing.get_args(kind)[0] == str | Corpora:
        coerced = _coerce_corpora(value, key, origin)
        if coerced not in TrainSplits():
            raise _error(f"{origin}: {key} = {_shown(coerced)}: expected {TrainSplits()}")
        return coerced
    if typing.get_origin(kind) is Annotated:
        base = typing.get_args(kind)[0]
        coerced = _coerce(value, base, key, origin)
        problem = _out_of_range(coerced, kind)
        if problem:
            raise _error(f"{origin}: {key} = {_shown(coerced)}: expected {problem}")
        return coerced
    if isinstance(value, _Text):
        if kind is str:
            return str(value)
        # unparsable text (or nested past Python's recursion limit) is reported as a bad value
        with contextlib.suppress(yaml.YAMLError, RecursionError):
            value = yaml.safe_load(value) if value != "" else ""
    bad = _error(f"{origin}: {key} = {_shown(value)}: expected {_type_name(kind)}")
    if typing.get_origin(kind) is Literal:
        if isinstance(value, bool) and "on" in typing.get_args(kind):
            value = "on" if value else "off"  # YAML 1.1 reads a bare on/off (and true) as a bool
        if value not in typing.get_args(kind):
            raise bad
        return value
    if kind is bool:
        if not isinstance(value, bool):
            raise bad
        return value
    if kind is int:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, int):
            return value
        number = _as_float(value)
        if number is None or not number.is_integer():
            raise bad
        return int(number)
    if kind is float:
        number = _as_float(value)
        if number is None or isinstance(value, bool):
            raise bad
        return number
    if kind is str:
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            # YAML 1.1 reads bare yes/no/on/off as booleans: the user must quote them.
            raise _error(f"{origin}: {key} = {_shown(value)}: expected a string (quote it in YAML)")
        return str(value)
    raise TypeError(f"unsupported config field type {kind!r} for {key}")  # a bug in this module


def _out_of_range(value: Any, kind: Any) -> str | None:
    """The range `value` misses, as words ("in [0, 1)"), or None (also for unranged kinds)."""
    if typing.get_origin(kind) is not Annotated:
        return None
    rule = typing.get_args(kind)[1]
    if value in rule:
        return None
    if isinstance(rule, Interval) and not math.isfinite(value):
        bounds = str(rule)  # "a finite number" when the interval has no bounds
        return bounds if bounds == str(Interval()) else f"a finite number {bounds}"
    return str(rule)


def _as_float(value: Any) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)  # "1e-9": PyYAML 1.1 needs a dot to read it as a float
        except ValueError:
            return None
    return None


def _type_name(kind: Any) -> str:
    if typing.get_origin(kind) is Annotated:
        return _type_name(typing.get_args(kind)[0])
    if typing.get_origin(kind) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(kind))
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[kind]
