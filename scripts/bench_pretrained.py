"""OPUS-MT-shaped models in tmt against their peers, in one run on this machine.

A base-size MarianMTModel directory like opus-mt-de-en (d_model 512, 6+6 layers, 8 heads, ffn
2048, swish, a 58,101-entry vocabulary: Multi30k sentencepiece models padded with unused entries,
random weights and output bias), written by transformers' save_pretrained, then:

1. memory: peak RSS of `tmt import` and of loading the imported model (Translator.load), each in
   a process of its own, against the weights' size and an interpreter that only imports them;
2. fine-tuning speed: target tokens/s of `tmt train --init-from` against transformers'
   Seq2SeqTrainer on the same Multi30k de->en pairs with the same sentences per batch (tmt's mean
   batch), label smoothing 0.1 both, the first updates left out of both;
3. decoding speed: Multi30k test_2016_flickr at beam 4 (1,000 sentences): tmt (the imported
   model), transformers generate and CTranslate2 converted by its own converter
   (ctranslate2.converters.TransformersConverter) from the same directory, the same batches
   (tmt's length buckets), the same length normalisation (|Y|^1, </s> counted as generate does)
   and the same length limit per batch: its longest source + 1 pieces, </s> included. Random
   weights rarely choose to stop, so each system decodes each batch to about that limit: the work
   of real translations of those lengths, the same for all three. tmt runs with the import's
   settings (generate's stopping rule, against generate) and with CTranslate2's rule (k
   finished, against CTranslate2); with that rule also in bf16 (`--precision bf16`: fast where
   the CPU has bf16 arithmetic, AVX512_BF16 or AMX) against CTranslate2's int8 (it has no bf16
   on a CPU).

    python scripts/bench_pretrained.py [--workdir runs/bench_pretrained] [--lines 1000]
    python scripts/bench_pretrained.py --only decode --shortlist   # issue 49's rows alone

With --shortlist, also a lexical shortlist (issue 49): `tmt shortlist -m IMPORTED -i train.de --ref
train.en` (Multi30k's pairs: the model's pieces are Multi30k's, padded) and, in the same run, tmt
at beam 4 with it (decode.shortlist) and CTranslate2 fp32 exactly and with the same table as its
vmap (`tmt export --format ctranslate2 --shortlist`, decoded through tmt's ctranslate2 engine
with the same batches and limits). Random weights give the speed of a shortlist at this shape,
not its BLEU: what they choose inside a set says nothing of a trained model's choices.

The last line printed is one JSON object with every figure; "ratios" holds the goals': tmt ÷
generate and tmt ÷ CTranslate2 at beam 4, tmt ÷ Seq2SeqTrainer in tokens/s; peak RSS figures in
MiB. Needs the bench extra: pip install -e ".[bench]".
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
MULTI30K = REPO / "transformer_mt" / "multi30k"
sys.path.insert(0, str(REPO / "tests"))  # marian_models: how the tests build Marian directories


def lines_of(lang: str, split: str) -> list[str]:
    with gzip.open(MULTI30K / f"{split}.{lang}.gz", "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def isa() -> str:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    base = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "other"
    bf16 = [name for name in ("avx512_bf16", "amx_bf16") if name in flags]
    return f"{base} ({', '.join(bf16)})" if bf16 else base


# --- the model ---------------------------------------------------------------------------------


def build_base(out: Path) -> Path:
    """opus-mt-de-en's shape, random weights, written by transformers."""
    import marian_models

    return out if (out / "config.json").exists() else marian_models.random_marian(out)


def peak_rss(code: str) -> float:
    """Peak RSS (MiB) of a fresh interpreter running `code`: its VmHWM (ru_maxrss would carry
    the peak of this process, which forked it, across the exec)."""
    wrapper = (
        f"{code}\nimport pathlib\nprint([line.split()[1] for line in pathlib.Path("
        "'/proc/self/status').read_text().splitlines() if line.startswith('VmHWM')][0])"
    )
    out = subprocess.run([sys.executable, "-c", wrapper], capture_output=True, text=True,
                         check=True, cwd=REPO)  # fmt: skip
    return int(out.stdout.split()[-1]) / 1024


def memory(hf_dir: Path, imported: Path) -> dict:
    if imported.exists():
        shutil.rmtree(imported)
    weights = (hf_dir / "model.safetensors").stat().st_size / 2**20
    baseline = peak_rss(
        "import torch, safetensors.torch; from transformer_mt.exchange import pretrained"
    )
    start = time.perf_counter()
    importing = peak_rss(
        "from transformer_mt.common.allocator import keep_freed_memory; keep_freed_memory()\n"
        f"from transformer_mt.exchange import pretrained; pretrained.import_model({str(hf_dir)!r},"
        f" {str(imported)!r})"
    )
    seconds = time.perf_counter() - start
    loading = peak_rss(
        "from transformer_mt.common.allocator import keep_freed_memory; keep_freed_memory()\n"
        f"from transformer_mt import Translator; Translator.load({str(imported)!r}, device='cpu')"
    )
    return {
        "weights_mib": round(weights, 1), "interpreter_mib": round(baseline, 1),
        "import_peak_mib": round(importing, 1), "import_seconds": round(seconds, 1),
        "load_peak_mib": round(loading, 1),
        "import_over_weights": round((importing - baseline) / weights, 2),
        "load_over_weights": round((loading - baseline) / weights, 2),
    }  # fmt: skip


# --- fine-tuning speed -------------------------------------------------------------------------


def tmt_finetune(imported: Path, out: Path, updates: int) -> dict:
    if out.exists():
        shutil.rmtree(out)
    settings = {
        "data.source": "multi30k", "train.out_dir": out, "train.max_steps": updates,
        "train.log_every": 1, "train.valid_every": 0, "train.bleu_every": 0,
        "train.save_every": 0, "train.patience": 0, "train.best_metric": "val_loss",
        "train.average_last": 0, "train.curves": False,
    }  # fmt: skip
    args = [a for k, v in settings.items() for a in ("--set", f"{k}={v}")]
    command = [sys.executable, "-m", "transformer_mt", "train", "-c", str(imported / "config.yaml"),
               "--init-from", str(imported), *args]  # fmt: skip
    subprocess.run(command, check=True, cwd=REPO, capture_output=True)
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "tokens_per_s" in r and not r.get("partial")]
    rates = [r["tokens_per_s"] for r in steps[2:]]  # the first two: warm-up
    return {"tokens_per_s": round(float(np.mean(rates)), 1), "updates": len(rates)}


def tmt_sentences_per_batch(imported: Path) -> float:
    from transformer_mt.data.batches import prepare_data
    from transformer_mt.runs import checkpoint
    from transformer_mt.training import device_defaults

    saved = checkpoint.read(imported)  # its config reads the bundled Multi30k, de -> en
    data = prepare_data(saved.config, saved.tokenizer)
    cfg = device_defaults.resolve(saved.config, torch.device("cpu"), world_size=1)
    batches = data.train.sampler(cfg.data.max_tokens, 1).epoch_batches(0)
    return float(np.mean([len(b) for b in batches]))


def hf_finetune(hf_dir: Path, sentences: int, steps: int, workdir: Path) -> dict:
    """Seq2SeqTrainer on the same pairs, `sentences` a batch, grouped by length."""
    import datasets
    import transformers

    tokenizer = transformers.MarianTokenizer.from_pretrained(str(hf_dir))
    model = transformers.MarianMTModel.from_pretrained(str(hf_dir))
    pairs = datasets.Dataset.from_dict(
        {"src": lines_of("de", "train"), "tgt": lines_of("en", "train")}
    )
    encoded = pairs.map(lambda b: tokenizer(b["src"], text_target=b["tgt"]), batched=True,
                        remove_columns=["src", "tgt"])  # fmt: skip
    collate = transformers.DataCollatorForSeq2Seq(tokenizer, model=model)
    times, tokens = [], []

    class Clock(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter())

    def counting(features):
        batch = collate(features)
        tokens.append(int((batch["labels"] != -100).sum()))
        return batch

    arguments = transformers.Seq2SeqTrainingArguments(
        output_dir=str(workdir / "hf_trainer"), per_device_train_batch_size=sentences,
        max_steps=steps, learning_rate=5e-5, label_smoothing_factor=0.1,
        train_sampling_strategy="group_by_length",
        report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True,
        dataloader_num_workers=0, seed=1,
    )  # fmt: skip
    trainer = transformers.Seq2SeqTrainer(
        model=model, args=arguments, train_dataset=encoded, data_collator=counting,
        callbacks=[Clock()],
    )  # fmt: skip
    trainer.train()
    # tokens[i] is batch i's; step i ends at times[i]: the rate over steps 3.. (warm-up left out)
    rate = sum(tokens[3 : len(times)]) / (times[-1] - times[2])
    return {"tokens_per_s": round(rate, 1), "steps": len(times) - 3, "sentences": sentences}


# --- decoding speed ----------------------------------------------------------------------------


def shortlist_of(imported: Path, table: Path) -> dict:
    """tmt shortlist for the imported model from Multi30k's training pairs (its pieces are
    Multi30k's): the report, with the seconds it took."""
    from transformer_mt.translation import shortlisting

    with tempfile.TemporaryDirectory() as scratch:
        pairs = {}
        for lang in ("de", "en"):
            pairs[lang] = Path(scratch) / f"train.{lang}"
            pairs[lang].write_text("\n".join(lines_of(lang, "train")) + "\n", encoding="utf-8")
        start = time.perf_counter()
        report = shortlisting.make(str(imported), table, pairs["de"], pairs["en"])
    return {**report, "seconds": round(time.perf_counter() - start, 1)}


def decode_all(hf_dir: Path, imported: Path, workdir: Path, count: int,
               shortlist: Path | None = None) -> dict:  # fmt: skip
    """Each system decodes tmt's length buckets of the test sentences, one call a bucket, with
    one length limit a bucket: its longest source + 1 pieces, </s> included (a forced </s>)."""
    import ctranslate2
    import transformers

    from transformer_mt.data.sampler import TokenBucketSampler
    from transformer_mt.translation import translate
    from transformer_mt.translation.batch_budget import batch_tokens

    sources = lines_of("de", "test_2016_flickr")[:count]
    ours = translate.load_translator(imported, ["decode.device=cpu"])
    tok = ours.tokenizer
    ids = tok.encode(sources)
    lengths = np.array([len(x) + 1 for x in ids])
    batches = TokenBucketSampler(lengths, lengths, batch_tokens(ours), seed=0,
                                 shuffle=False).epoch_batches(0)  # fmt: skip
    limits = [max(len(ids[i]) for i in batch) + 1 for batch in batches]
    results: dict = {"sentences": count, "batches": len(batches)}

    def timed(name: str, run) -> list[list[int]]:
        run()  # warm-up
        start = time.perf_counter()
        outputs = run()
        seconds = time.perf_counter() - start
        results[name] = {"seconds": round(seconds, 2), "sentences_per_s": round(count / seconds, 1)}
        return outputs

    def run_tmt(stopping: str | None, model: Path = imported, more: tuple[str, ...] = ()):
        """tmt's search with this stopping rule, or (None) CTranslate2's engine through tmt."""
        rule = [f"decode.early_stopping={stopping}"] if stopping else []
        models = {limit: translate.load_translator(model, [
            "decode.device=cpu", "decode.max_len_a=0", f"decode.max_len_b={limit}",
            "decode.beam_size=4", *rule, *more,
        ]) for limit in set(limits)}  # fmt: skip

        def run() -> list[list[int]]:
            outputs: list[list[int]] = [[] for _ in sources]
            for batch, limit in zip(batches, limits, strict=True):
                found = translate.translate_lines(models[limit], [sources[i] for i in batch])
                for i, hyps in zip(batch, found, strict=True):
                    outputs[i] = hyps[0].tokens if hyps else []
            return outputs

        return run

    tmt_current = timed("tmt_beam4", run_tmt("current"))
    tmt_k = timed("tmt_beam4_k_finished", run_tmt("k_finished"))
    # --precision bf16: the model and its packed linear layers in bf16 (fast on a CPU with bf16
    # arithmetic: AVX512_BF16 or AMX; CTranslate2 has no bf16 on a CPU, its int8 is below).
    tmt_bf16 = timed("tmt_bf16_beam4_k_finished",
                     run_tmt("k_finished", more=("decode.precision=bf16",)))  # fmt: skip
    model = transformers.MarianMTModel.from_pretrained(str(hf_dir)).eval()

    @torch.inference_mode()
    def run_hf() -> list[list[int]]:
        outputs: list[list[int]] = [[] for _ in sources]
        for batch, limit in zip(batches, limits, strict=True):
            rows = [ids[i] + [tok.eos_id] for i in batch]
            width = max(map(len, rows))
            src = torch.tensor([r + [tok.pad_id] * (width - len(r)) for r in rows])
            generated = model.generate(input_ids=src, attention_mask=(src != tok.pad_id).long(),
                                       num_beams=4, max_new_tokens=limit)  # fmt: skip
            for i, row in zip(batch, generated.tolist(), strict=True):
                row = row[1:]
                end = row.index(tok.eos_id) if tok.eos_id in row else len(row)
                outputs[i] = [t for t in row[:end] if t != tok.pad_id]
        return outputs

    hf = timed("hf_generate_beam4", run_hf)
    ct2_dir = workdir / "ctranslate2"
    if not ct2_dir.exists():
        ctranslate2.converters.TransformersConverter(str(hf_dir)).convert(str(ct2_dir))
    engines = {compute: ctranslate2.Translator(str(ct2_dir), device="cpu", compute_type=compute,
                                               intra_threads=torch.get_num_threads())
               for compute in ("float32", "int8")}  # fmt: skip

    def run_ct2(compute: str = "float32") -> list[list[int]]:
        engine = engines[compute]
        outputs: list[list[int]] = [[] for _ in sources]
        for batch, limit in zip(batches, limits, strict=True):
            # transformers' models get no implicit </s> from CTranslate2: it is the tokenizer's
            pieces = [[tok.id_to_piece(t, "source") for t in ids[i]] + ["</s>"] for i in batch]
            found = engine.translate_batch(
                pieces,
                beam_size=4,
                length_penalty=1.0,
                max_decoding_length=limit - 1,
                max_batch_size=len(batch),
                min_decoding_length=0,
            )
            for i, result in zip(batch, found, strict=True):
                outputs[i] = [tok.piece_to_id(p) for p in result.hypotheses[0]]
        return outputs

    ct2 = timed("ctranslate2_beam4", run_ct2)
    ct2_int8 = timed("ctranslate2_int8_beam4", lambda: run_ct2("int8"))
    same = lambda a, b: sum(map(list.__eq__, a, b))  # noqa: E731
    results["identical_lines"] = {"tmt_vs_generate": same(tmt_current, hf),
                                  "tmt_k_finished_vs_ctranslate2": same(tmt_k, ct2),
                                  "tmt_bf16_vs_tmt": same(tmt_bf16, tmt_k),
                                  "ctranslate2_int8_vs_float32": same(ct2_int8, ct2)}  # fmt: skip
    if shortlist is not None:
        from transformer_mt.exchange import export

        listed = ("decode.shortlist=" + str(shortlist),)
        timed("tmt_beam4_shortlist", run_tmt("current", more=listed))
        timed("tmt_beam4_k_finished_shortlist", run_tmt("k_finished", more=listed))
        exported = workdir / "ctranslate2_vmap"
        if not (exported / "vmap.txt").exists():
            export.export(imported, "ctranslate2", exported, check_lines=20, overwrite=True,
                          shortlist=str(shortlist))  # fmt: skip
        engine_ct2 = ("decode.engine=ctranslate2",)
        ct2_exact = timed("ctranslate2_beam4_tmt_export",
                          run_tmt(None, exported, engine_ct2))  # fmt: skip
        timed("ctranslate2_beam4_vmap",
              run_tmt(None, exported, (*engine_ct2, "decode.shortlist=auto")))  # fmt: skip
        results["identical_lines"]["ctranslate2_tmt_export_vs_own_converter"] = same(ct2_exact, ct2)
    results["output_tokens"] = int(sum(map(len, tmt_current)))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", type=Path, default=REPO / "runs" / "bench_pretrained")
    parser.add_argument("--lines", type=int, default=1000)
    parser.add_argument("--updates", type=int, default=8, help="tmt fine-tuning updates timed")
    parser.add_argument("--hf-steps", type=int, default=8, help="Seq2SeqTrainer steps timed")
    parser.add_argument("--shortlist", action="store_true", help="also decode with a shortlist")
    parser.add_argument("--only", choices=("decode",), help="measure the decoding alone")
    args = parser.parse_args()
    from transformer_mt.common.allocator import keep_freed_memory

    keep_freed_memory()
    print(f"machine: {os.cpu_count()} cores, {isa()}, torch {torch.__version__},"
          f" {torch.get_num_threads()} threads", flush=True)  # fmt: skip
    args.workdir.mkdir(parents=True, exist_ok=True)
    hf_dir = build_base(args.workdir / "opus-mt-shaped")
    imported = args.workdir / "imported"
    report: dict = {"isa": isa()}
    if args.only is None or not (imported / "model.pt").exists():
        report["memory"] = memory(hf_dir, imported)  # also makes the import
        print("memory:", report["memory"], flush=True)
    table = None
    if args.shortlist:
        table = args.workdir / "shortlist.npz"
        if not table.exists():
            report["shortlist"] = shortlist_of(imported, table)
            print("shortlist:", report["shortlist"], flush=True)
    report["decode"] = d = decode_all(hf_dir, imported, args.workdir, args.lines, table)
    print("decode:", report["decode"], flush=True)
    report["ratios"] = {
        "tmt_vs_generate_beam4": round(d["tmt_beam4"]["sentences_per_s"]
                                       / d["hf_generate_beam4"]["sentences_per_s"], 2),
        "tmt_vs_ctranslate2_beam4": round(d["tmt_beam4_k_finished"]["sentences_per_s"]
                                          / d["ctranslate2_beam4"]["sentences_per_s"], 2),
        "tmt_bf16_vs_tmt_beam4": round(d["tmt_bf16_beam4_k_finished"]["sentences_per_s"]
                                       / d["tmt_beam4_k_finished"]["sentences_per_s"], 2),
        "tmt_bf16_vs_ctranslate2_int8_beam4": round(
            d["tmt_bf16_beam4_k_finished"]["sentences_per_s"]
            / d["ctranslate2_int8_beam4"]["sentences_per_s"], 2),
        "ctranslate2_int8_vs_float32_beam4": round(d["ctranslate2_int8_beam4"]["sentences_per_s"]
                                                   / d["ctranslate2_beam4"]["sentences_per_s"], 2),
    }  # fmt: skip
    if table is not None:
        report["ratios"] |= {
            "tmt_shortlist_vs_generate_beam4": round(
                d["tmt_beam4_shortlist"]["sentences_per_s"]
                / d["hf_generate_beam4"]["sentences_per_s"], 2),
            "tmt_shortlist_vs_ctranslate2_beam4": round(
                d["tmt_beam4_k_finished_shortlist"]["sentences_per_s"]
                / d["ctranslate2_beam4"]["sentences_per_s"], 2),
            "tmt_shortlist_vs_ctranslate2_vmap_beam4": round(
                d["tmt_beam4_k_finished_shortlist"]["sentences_per_s"]
                / d["ctranslate2_beam4_vmap"]["sentences_per_s"], 2),
            "tmt_shortlist_vs_exact": round(d["tmt_beam4_shortlist"]["sentences_per_s"]
                                            / d["tmt_beam4"]["sentences_per_s"], 2),
            "ctranslate2_vmap_vs_exact": round(
                d["ctranslate2_beam4_vmap"]["sentences_per_s"]
                / d["ctranslate2_beam4_tmt_export"]["sentences_per_s"], 2),
        }  # fmt: skip
    if args.only == "decode":
        print(json.dumps(report))
        return
    sentences = round(tmt_sentences_per_batch(imported))
    with tempfile.TemporaryDirectory() as scratch:
        report["finetune"] = {
            "tmt": tmt_finetune(imported, args.workdir / "finetune", args.updates + 3),
            "seq2seq_trainer": hf_finetune(hf_dir, sentences, args.hf_steps + 3, Path(scratch)),
        }
    print("finetune:", report["finetune"], flush=True)
    f = report["finetune"]
    report["ratios"]["tmt_vs_seq2seq_trainer_tokens_per_s"] = round(
        f["tmt"]["tokens_per_s"] / f["seq2seq_trainer"]["tokens_per_s"], 2)  # fmt: skip
    print(json.dumps(report))


if __name__ == "__main__":
    from transformer_mt.common.exits import run_script

    run_script(main)
