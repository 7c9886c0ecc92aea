"""Decoding speed: tmt vs HF transformers `generate` vs CTranslate2, one model, the same batches.

Also tmt's own decoding through CTranslate2 (`tmt translate --engine ctranslate2`: tmt's
batching, length rule and outputs around the same CTranslate2 model, to show what tmt adds on top
of raw CTranslate2) and int8: tmt's `--precision int8` (torchao dynamic int8) and CTranslate2's
int8 model, raw and through tmt; and tmt's `--precision bf16` (its linear layers packed for
oneDNN in bf16: fast where the CPU has bf16 arithmetic, AVX512_BF16 or AMX, which the first line
printed says; CTranslate2 has no bf16 on a CPU).

The peers get tmt's weights through `tmt export`'s own converters
(transformer_mt/exchange/export.py): a post-norm model becomes a MarianMTModel, a pre-norm one (the
default preset) a PegasusForConditionalGeneration, and either a CTranslate2 TransformerSpec,
float32 and int8. All systems decode the same sentences of test_2016_flickr in the same length-
sorted batches (tmt's decode.max_tokens source tokens each), with the same length normalisation
(score / |Y|^α, α 0.6: the "power" form all three support), pad and bos never emitted, on the same
number of threads; each figure is the fastest of two timed passes after a warm-up pass. Matching
outputs show the ports are exact. Needs the bench extra: pip install -e ".[bench]".

    tmt train --set train.out_dir=runs/bench_decode --set train.max_minutes=10
    python scripts/bench_decode.py --checkpoint runs/bench_decode

The last line printed is one JSON object with every figure; "ratios" holds those the goals name:
tmt beam 4 ÷ CTranslate2 fp32 beam 4 and ÷ HF generate beam 4 (same stopping rule), tmt's
oneDNN linear layers ÷ PyTorch's (decode.cpu_linear), tmt
--engine ctranslate2 ÷ raw CTranslate2 (greedy, beam 4, int8 beam 4), int8 ÷ fp32 per engine;
"bleu_int8_minus_fp32" the BLEU cost of int8 per engine. The machine's ISA is printed first.

Several models (a teacher and its students, `tmt distill`), each through tmt's engines only:

    python scripts/bench_decode.py --model teacher=runs/teacher --model student=runs/student
    python scripts/bench_decode.py --model teacher=runs/teacher --model student=runs/student \
        --model student_sl=runs/student --model-set student_sl:decode.shortlist=auto

greedy and beam 4 through tmt's own engine (fp32, and torchao int8) and through
`--engine ctranslate2` (fp32 and int8), BLEU and chrF of each, sentences/s and each model's
speed over the first model's beam 4 at fp32. `--breakdown` instead profiles one model's greedy
and beam-4 decoding (torch.profiler): where a step's time goes (encoder, decoder layers, output
projection, embedding and cache, log-softmax, search).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from transformer_mt.common.allocator import keep_freed_memory

keep_freed_memory()  # as the tmt command does, before the models allocate


def batches_of(translator, lines):
    """tmt's own batching of these lines (sorted by length, decode.max_tokens): used by everyone."""
    from transformer_mt.data.sampler import TokenBucketSampler
    from transformer_mt.translation.batch_budget import batch_tokens

    ids = translator.tokenizer.encode(lines)
    lengths = np.array([len(x) + 1 for x in ids])
    sampler = TokenBucketSampler(lengths, lengths, batch_tokens(translator), seed=0, shuffle=False)
    return ids, sampler.epoch_batches(0)


def with_decode(translator, **changes):
    decode = dataclasses.replace(translator.config.decode, nbest=1, **changes)
    return dataclasses.replace(
        translator, config=dataclasses.replace(translator.config, decode=decode)
    )


def run_tmt(translator, lines, beam: int, early_stopping: str = "bound"):
    from transformer_mt.translation import translate

    t = with_decode(translator, beam_size=beam, early_stopping=early_stopping)
    start = time.perf_counter()
    outputs = [hyps[0].tokens if hyps else []
               for hyps in translate.translate_lines(t, lines, scores=False)]  # fmt: skip
    return time.perf_counter() - start, outputs


@torch.inference_mode()
def run_hf(model, translator, lines, beam: int, early_stopping: bool | str = False):
    tok = translator.tokenizer
    ids, batches = batches_of(translator, lines)
    outputs: list[list[int]] = [[] for _ in lines]
    start = time.perf_counter()
    for batch in batches:
        rows = [ids[i] + [tok.eos_id] for i in batch]
        width = max(map(len, rows))
        src = torch.tensor([r + [tok.pad_id] * (width - len(r)) for r in rows])
        generated = model.generate(
            input_ids=src, attention_mask=(src != tok.pad_id).long(),
            num_beams=beam, do_sample=False, early_stopping=early_stopping,
            length_penalty=translator.config.decode.length_penalty,
            max_new_tokens=min(width + 50, translator.config.model.max_positions),  # its table
            bad_words_ids=[[tok.pad_id], [tok.bos_id]],
        )  # fmt: skip
        for i, row in zip(batch, generated.tolist(), strict=True):
            row = row[1:]  # drop the decoder start token
            end = row.index(tok.eos_id) if tok.eos_id in row else len(row)
            outputs[i] = [t for t in row[:end] if t != tok.pad_id]
    return time.perf_counter() - start, outputs


def run_ct2(model_dir: Path, translator, lines, beam: int, compute_type: str = "float32"):
    """Raw CTranslate2 on tmt's batches: each batch's pieces in, one call with the batch's
    largest output limit (tmt's a · |x| + b, its EOS excluded), ids out."""
    import ctranslate2

    from transformer_mt.translation import translate

    tok = translator.tokenizer
    ct2 = ctranslate2.Translator(
        str(model_dir), device="cpu", compute_type=compute_type,
        intra_threads=torch.get_num_threads(),
    )  # fmt: skip
    ids, batches = batches_of(translator, lines)
    piece, index = tok._sp.id_to_piece, tok._sp.piece_to_id
    outputs: list[list[int]] = [[] for _ in lines]
    start = time.perf_counter()
    for batch in batches:
        source = [[piece(t) for t in ids[i]] for i in batch]
        limit = max(translate.output_limits(translator, source))
        results = ct2.translate_batch(
            source, beam_size=beam, length_penalty=translator.config.decode.length_penalty,
            max_decoding_length=limit - 1, max_batch_size=len(source),
            min_decoding_length=0,  # as tmt and HF: an empty output is allowed
            suppress_sequences=[[piece(tok.pad_id)], [piece(tok.bos_id)]],
        )  # fmt: skip
        for i, result in zip(batch, results, strict=True):
            outputs[i] = [index(p) for p in result.hypotheses[0]]
    return time.perf_counter() - start, outputs


def _timed(run, warm):
    """A warm-up pass on a few lines, then the faster of two timed passes."""
    warm()
    return min((run() for _ in range(2)), key=lambda r: r[0])


def compare_models(models: dict[str, str], split: str, lines: int,
                   settings: dict[str, list[str]] | None = None,
                   beams: tuple[int, ...] = (1, 4),
                   only: tuple[str, ...] = ()) -> dict:  # fmt: skip
    """Each model greedy and beam 4, tmt's engine (fp32, bf16, int8) and CTranslate2's (fp32, int8);
    `settings`: a model's own decode overrides (--model-set); one with a shortlist decodes in
    tmt's engine only (CTranslate2's vmap is --shortlist's measurement)."""
    settings = settings or {}
    from transformer_mt.data import corpus
    from transformer_mt.translation import evaluate, translate

    base = ["decode.length_penalty_form=power", "decode.device=cpu"]
    first = translate.load_translator(next(iter(models.values())), base)
    key = {"valid": "data.valid", "test": "data.test"}[split]
    sources, references = corpus.read_split(first.config.data, key)
    sources, references = sources[:lines], references[:lines]
    # Every PyTorch row before the first CTranslate2 one (two OpenMP runtimes: see main()).
    rows = [(engine, precision) for engine, precisions in
            (("torch", ("fp32", "bf16", "int8")), ("ctranslate2", ("fp32", "int8")))
            for precision in precisions if not only or f"{engine}_{precision}" in only]  # fmt: skip
    results: dict[str, dict] = {name: {} for name in models}
    for engine, precision in rows:
        for name, path in models.items():
            mine = settings.get(name, [])
            if engine == "ctranslate2" and any(m.startswith("decode.shortlist=") for m in mine):
                continue
            # CTranslate2 normalises by |Y|^α itself (tmt refuses a form for it)
            own = base if engine == "torch" else ["decode.device=cpu"]
            changes = [*own, f"decode.engine={engine}", f"decode.precision={precision}", *mine]
            translator = translate.load_translator(path, changes)
            for beam in beams:
                seconds, out = _timed(
                    lambda t=translator, b=beam: run_tmt(t, sources, b),
                    lambda t=translator, b=beam: run_tmt(t, sources[:100], b),
                )
                texts = translator.tokenizer.decode(out)
                score = evaluate.score(texts, references, all_metrics=False)
                row = f"{engine}_{precision}_beam{beam}"
                results[name][row] = {
                    "sentences_per_s": round(len(sources) / seconds, 1),
                    "bleu": score["bleu"], "chrf": score["chrf"],
                    "parameters": translator.parameters,
                }  # fmt: skip
                r = results[name][row]
                print(f"{name:<12} {row:<24} {r['sentences_per_s']:>8.1f} sent/s"
                      f"  BLEU {r['bleu']:.2f}  chrF {r['chrf']:.2f}", flush=True)  # fmt: skip
    reference = results[next(iter(models))]["torch_fp32_beam4"]["sentences_per_s"]
    for rows_of in results.values():
        for r in rows_of.values():
            r["speed_over_first_beam4"] = round(r["sentences_per_s"] / reference, 2)
    return {"split": split, "sentences": len(sources), "models": models, "results": results}


def breakdown(path: str, lines: int) -> dict:
    """Where tmt's greedy and beam-4 time goes, by torch.profiler over labelled parts."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from transformer_mt.data import corpus
    from transformer_mt.translation import translate

    translator = translate.load_translator(path, ["decode.device=cpu"])
    model = translator.model

    def labelled(module, method: str, label: str) -> None:
        inner = getattr(module, method)

        def wrapper(*args, **kwargs):
            with record_function(label):
                return inner(*args, **kwargs)

        setattr(module, method, wrapper)

    labelled(model, "encode", "encoder")
    labelled(model, "decode", "decoder step")
    labelled(model.output_projection, "forward", "output projection")
    for layer in model.decoder_layers:
        labelled(layer, "forward", "decoder layers")
    sources = corpus.read_split(translator.config.data, "data.test")[0][:lines]
    report = {"model": path, "sentences": len(sources)}
    for beam in (1, 4):
        run_tmt(translator, sources[:50], beam)  # warm-up
        with profile(activities=[ProfilerActivity.CPU]) as prof, record_function("total"):
            run_tmt(translator, sources, beam)
        times = {e.key: e.cpu_time_total for e in prof.key_averages()}
        total = times["total"]
        parts = {
            "encoder": times.get("encoder", 0),
            "decoder layers": times.get("decoder layers", 0),
            "output projection": times.get("output projection", 0),
        }
        step = times.get("decoder step", 0)
        parts["embedding, final norm, cache"] = step - parts["decoder layers"] - parts[
            "output projection"]  # fmt: skip
        parts["log-softmax"] = times.get("aten::log_softmax", 0)
        parts["search and batching"] = total - step - parts["encoder"] - parts["log-softmax"]
        shares = {k: round(100 * v / total, 1) for k, v in parts.items()}
        report[f"beam{beam}"] = shares
        print(f"beam {beam}: " + ", ".join(f"{k} {v} %" for k, v in shares.items()), flush=True)
    # Greedy's argmax by block maxima (search.row_max) against torch's max with indices, the
    # same outputs, the faster of two passes each, alternated.
    from transformer_mt.network import search

    fast, seconds = search.row_max, {"row_max": [], "torch_max": []}
    for _ in range(2):
        for name, argmax in (("row_max", fast), ("torch_max", lambda v: v.max(dim=-1))):
            search.row_max = argmax
            elapsed, outputs = run_tmt(translator, sources, 1)
            seconds[name].append(elapsed)
            report.setdefault("greedy_outputs", {})[name] = outputs
    search.row_max = fast
    same = report.pop("greedy_outputs")
    report["greedy_row_max_over_torch_max"] = round(min(seconds["torch_max"]) /
                                                    min(seconds["row_max"]), 3)  # fmt: skip
    report["greedy_identical"] = same["row_max"] == same["torch_max"]
    print(f"greedy, argmax by block maxima over torch's max: "
          f"{report['greedy_row_max_over_torch_max']:.2f}x (identical outputs:"
          f" {report['greedy_identical']})", flush=True)  # fmt: skip
    report.update(greedy_from_logits(translator, sources))
    return report


def greedy_from_logits(translator, sources, passes: int = 3) -> dict:
    """Greedy's argmax from the raw logits (issue 49's exact saving: no log-softmax over the
    vocabulary per step) against the log-probabilities' argmax, interleaved; outputs compared."""
    from transformer_mt.translation import decoding

    exact, seconds, outputs = decoding.greedy_from_logits, {"logits": [], "log_softmax": []}, {}
    try:
        for _ in range(passes):
            for name, rule in (("logits", exact), ("log_softmax", lambda t: False)):
                decoding.greedy_from_logits = rule
                elapsed, outputs[name] = run_tmt(translator, sources, 1)
                seconds[name].append(elapsed)
    finally:
        decoding.greedy_from_logits = exact
    same = sum(a == b for a, b in zip(outputs["logits"], outputs["log_softmax"], strict=True))
    report = {
        "greedy_logits_s": sorted(round(x, 3) for x in seconds["logits"]),
        "greedy_log_softmax_s": sorted(round(x, 3) for x in seconds["log_softmax"]),
        "greedy_logits_over_log_softmax": round(
            min(seconds["log_softmax"]) / min(seconds["logits"]), 3),
        "greedy_logits_identical_lines": f"{same}/{len(sources)}",
    }  # fmt: skip
    print(f"greedy from logits over log-softmax: {report['greedy_logits_over_log_softmax']:.3f}x"
          f" (min of {passes}; identical lines {same}/{len(sources)})", flush=True)  # fmt: skip
    report["argmax_step_ms"] = argmax_step(translator.tokenizer.vocab_size)
    return report


def argmax_step(vocab: int, repeats: int = 200) -> dict:
    """One greedy step's choice alone, at batch rows 32, 128 and 300: row_max(log_softmax(x))
    (before) against search.logits_argmax(x) (after), milliseconds, the median of interleaved
    rounds."""
    from transformer_mt.network import search

    out = {}
    for rows in (32, 128, 300):
        x = torch.randn(rows, vocab) * 3
        ways = {"log_softmax": lambda x=x: search.row_max(torch.log_softmax(x, dim=-1)),
                "logits": lambda x=x: search.logits_argmax(x)}  # fmt: skip
        times = {name: [] for name in ways}
        for _ in range(repeats):
            for name, way in ways.items():
                start = time.perf_counter()
                way()
                times[name].append(1000 * (time.perf_counter() - start))
        medians = {name: round(float(np.median(t)), 3) for name, t in times.items()}
        out[str(rows)] = {**medians, "ratio": round(medians["log_softmax"] / medians["logits"], 2)}
        print(f"argmax step, {rows} x {vocab}: {medians['log_softmax']} ms -> {medians['logits']}"
              f" ms ({out[str(rows)]['ratio']}x)", flush=True)  # fmt: skip
    return out


def shortlist_ab(path: str, table: str, split: str, lines: int, passes: int = 3) -> dict:
    """One model decoded exactly and with a lexical shortlist (decode.shortlist = `table`),
    greedy and beam 4, the passes interleaved: sentences/s (the fastest pass), lines identical to
    the exact decode, the miss rate (exact outputs' tokens outside their sentence's candidates),
    BLEU and chrF with sacreBLEU's paired tests against the exact decode."""
    from transformer_mt.data import corpus
    from transformer_mt.translation import evaluate, translate

    exact = translate.load_translator(path, ["decode.device=cpu"])
    listed = translate.load_translator(path, ["decode.device=cpu", f"decode.shortlist={table}"])
    key = {"valid": "data.valid", "test": "data.test"}[split]
    sources, references = (x[:lines] for x in corpus.read_split(exact.config.data, key))
    tok, report = exact.tokenizer, {"model": path, "shortlist": table, "split": split}
    ids = tok.encode(sources)
    sizes = [len(listed.shortlist.candidates(x)) + 1 for x in ids]
    report.update(mean_candidates=round(float(np.mean(sizes)), 1), vocabulary=tok.vocab_size)
    for beam in (1, 4):
        seconds, outputs = {"exact": [], "shortlist": []}, {}
        for t in (exact, listed):
            run_tmt(t, sources[:100], beam)  # warm-up
        for _ in range(passes):
            for name, t in (("exact", exact), ("shortlist", listed)):
                elapsed, outputs[name] = run_tmt(t, sources, beam)
                seconds[name].append(elapsed)
        texts = {name: tok.decode(out) for name, out in outputs.items()}
        tested = evaluate.compare([(n, texts[n]) for n in ("exact", "shortlist")], references)
        missed_lines = missed_tokens = tokens = 0
        for x, out in zip(ids, outputs["exact"], strict=True):
            allowed = set(listed.shortlist.candidates(x).tolist()) | {tok.eos_id}
            outside = sum(t not in allowed for t in out)
            missed_lines, missed_tokens, tokens = (
                missed_lines + (outside > 0),
                missed_tokens + outside,
                tokens + len(out),
            )
        row = {
            "exact_sentences_per_s": round(len(sources) / min(seconds["exact"]), 1),
            "shortlist_sentences_per_s": round(len(sources) / min(seconds["shortlist"]), 1),
            "speedup": round(min(seconds["exact"]) / min(seconds["shortlist"]), 3),
            "seconds": {k: sorted(round(x, 3) for x in v) for k, v in seconds.items()},
            "identical_lines_pct": round(100 * sum(
                a == b for a, b in zip(outputs["exact"], outputs["shortlist"], strict=True))
                / len(sources), 1),
            "missed_lines_pct": round(100 * missed_lines / len(sources), 1),
            "missed_tokens_pct": round(100 * missed_tokens / max(tokens, 1), 2),
            "systems": tested["systems"],
        }  # fmt: skip
        report[f"beam{beam}"] = row
        report.update(_vmap_ab(path, table, listed, sources, references, beam, outputs, passes))
        b = next(s for s in tested["systems"] if s["system"] == "shortlist")
        print(f"beam {beam}: {row['exact_sentences_per_s']} -> {row['shortlist_sentences_per_s']}"
              f" sent/s ({row['speedup']:.2f}x); identical {row['identical_lines_pct']} %;"
              f" missed lines {row['missed_lines_pct']} %, tokens {row['missed_tokens_pct']} %;"
              f" BLEU {tested['systems'][0]['bleu']['score']} -> {b['bleu']['score']}"
              f" (p {b['bleu']['p_bootstrap']} / {b['bleu']['p_randomization']})",
              flush=True)  # fmt: skip
    return report


def _vmap_ab(path, table, listed, sources, references, beam, tmt_outputs, passes) -> dict:
    """CTranslate2 exactly and with the same shortlist as its vmap (tmt export --shortlist), in
    tmt's batches: its speed-up, and how often its per-batch union changes a line against tmt's
    per-sentence sets (lines identical to tmt's shortlist decode; to CTranslate2's own one line
    at a time)."""
    try:
        import ctranslate2  # noqa: F401
    except ImportError:
        return {}
    from transformer_mt.exchange import export
    from transformer_mt.translation import evaluate, translate

    directory = Path(tempfile.mkdtemp(prefix="tmt-vmap-")) / "export"
    export.export(path, "ctranslate2", directory, check_lines=50, shortlist=table)
    base = ["decode.engine=ctranslate2", "decode.device=cpu"]
    engines = {
        "ct2_exact": translate.load_translator(directory, base),
        "ct2_vmap": translate.load_translator(directory, [*base, "decode.shortlist=auto"]),
    }
    seconds, outputs = {name: [] for name in engines}, {}
    for t in engines.values():
        run_tmt(t, sources[:100], beam)
    for _ in range(passes):
        for name, t in engines.items():
            elapsed, outputs[name] = run_tmt(t, sources, beam)
            seconds[name].append(elapsed)
    alone = [run_tmt(engines["ct2_vmap"], [line], beam)[1][0] for line in sources]

    def same(a, b):
        return round(100 * sum(x == y for x, y in zip(a, b, strict=True)) / len(a), 1)

    tok, ours = listed.tokenizer, tmt_outputs["shortlist"]
    bleu = {n: evaluate.score(tok.decode(o), references, all_metrics=False)["bleu"]
            for n, o in outputs.items()}  # fmt: skip
    row = {
        "ct2_exact_sentences_per_s": round(len(sources) / min(seconds["ct2_exact"]), 1),
        "ct2_vmap_sentences_per_s": round(len(sources) / min(seconds["ct2_vmap"]), 1),
        "ct2_vmap_speedup": round(min(seconds["ct2_exact"]) / min(seconds["ct2_vmap"]), 3),
        "ct2_bleu": bleu,
        "ct2_vmap_batched_vs_one_line_identical_pct": same(outputs["ct2_vmap"], alone),
        "ct2_vmap_vs_tmt_shortlist_identical_pct": same(outputs["ct2_vmap"], ours),
        "ct2_one_line_vs_tmt_shortlist_identical_pct": same(alone, ours),
    }  # fmt: skip
    print(f"beam {beam}, CTranslate2: vmap {row['ct2_vmap_speedup']:.2f}x its exact decode;"
          f" batched = one line at a time on {row['ct2_vmap_batched_vs_one_line_identical_pct']} %"
          f" of lines; = tmt's shortlist on {row['ct2_vmap_vs_tmt_shortlist_identical_pct']} %"
          f" (one line at a time: {row['ct2_one_line_vs_tmt_shortlist_identical_pct']} %);"
          f" BLEU {bleu}", flush=True)  # fmt: skip
    return {f"beam{beam}_ctranslate2": row}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="runs/bench_decode", help="a model or a run")
    parser.add_argument("--lines", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="compare these models (tmt's engines only), the first the baseline",
    )
    parser.add_argument(
        "--model-set",
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE",
        help="a decode setting for one --model, e.g. student_sl:decode.shortlist=auto",
    )
    parser.add_argument("--split", choices=("valid", "test"), default="test")
    parser.add_argument("--beams", default="1,4", help="--model: the beam sizes, e.g. 1,2,4")
    parser.add_argument(
        "--rows",
        default="",
        help="--model: only these, e.g."
        " torch_fp32,ctranslate2_fp32 (default: fp32, int8 of both engines, torch_bf16)",
    )
    parser.add_argument("--breakdown", action="store_true", help="profile --checkpoint instead")
    parser.add_argument(
        "--shortlist", metavar="auto|PATH", help="--checkpoint exactly and with this shortlist"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    isa = torch.backends.cpu.get_cpu_capability()  # AVX512, AVX2, ...: what decides the winner
    from transformer_mt.network import kernels

    native_bf16 = kernels.cpu_has_bf16()  # AVX512_BF16 or AMX: whether bf16 decoding pays
    print(f"CPU capability: {isa}, bf16 arithmetic: {native_bf16}, {args.threads} threads",
          flush=True)  # fmt: skip
    if args.shortlist:
        summary = shortlist_ab(args.checkpoint, args.shortlist, args.split, args.lines)
        print(json.dumps({"isa": isa, "threads": args.threads, **summary}))
        return
    if args.breakdown or args.model:
        models = dict(m.split("=", 1) for m in args.model)
        settings: dict[str, list[str]] = {}
        for item in args.model_set:
            name, _, change = item.partition(":")
            if name not in models or "=" not in change:
                parser.error(f"--model-set {item}: expected NAME:KEY=VALUE for a --model NAME")
            settings.setdefault(name, []).append(change)
        beams = tuple(int(b) for b in args.beams.split(","))
        rows = tuple(args.rows.split(",")) if args.rows else ()
        summary = (breakdown(args.checkpoint, args.lines) if args.breakdown
                   else compare_models(models, args.split, args.lines, settings, beams,
                                       rows))  # fmt: skip
        print(json.dumps({"isa": isa, "threads": args.threads, **summary}))
        return

    import transformers

    from transformer_mt.data import corpus
    from transformer_mt.exchange import huggingface
    from transformer_mt.translation import ct2, evaluate, translate

    transformers.logging.set_verbosity_error()  # not a warning per batch about max_length

    # Same normalisation for everyone: score / |Y|^α (HF and CTranslate2 cannot do GNMT's).
    overrides = ["decode.length_penalty_form=power", "decode.device=cpu"]
    translator = translate.load_translator(args.checkpoint, overrides)
    # tmt's --precision int8: torchao's dynamic int8 of the feed-forward and attention output
    # projections (the fused Q/K/V and the tied output projection stay fp32).
    int8 = translate.load_translator(args.checkpoint, [*overrides, "decode.precision=int8"])
    # tmt's --precision bf16: the model in bf16, its linear layers packed for oneDNN in bf16 (fast
    # where the CPU has bf16 arithmetic: AVX512_BF16 or AMX; emulated, slower, elsewhere).
    bf16 = translate.load_translator(args.checkpoint, [*overrides, "decode.precision=bf16"])
    # tmt's own engine with PyTorch's linear kernels (MKL on x86) instead of oneDNN's.
    torch_linear = translate.load_translator(
        args.checkpoint, [*overrides, "decode.cpu_linear=torch"]
    )
    # tmt --engine ctranslate2 (its export, made beside the model on first use), fp32 and int8:
    # loaded after every PyTorch row has run (engines, below).
    engine = ["decode.engine=ctranslate2", "decode.device=cpu"]  # its normalisation is |Y|^α
    engines: dict[str, translate.Translator] = {}

    def tmt_ct2(precision: str) -> translate.Translator:
        if precision not in engines:
            changes = [*engine, f"decode.precision={precision}"]
            engines[precision] = translate.load_translator(args.checkpoint, changes)
        return engines[precision]

    sources, references = corpus.read_split(translator.config.data, "data.test")
    sources, references = sources[: args.lines], references[: args.lines]
    hf_model, architecture = huggingface.model(translator)
    results: dict[str, dict] = {}
    outputs: dict[str, list[list[int]]] = {}
    with tempfile.TemporaryDirectory(prefix="tmt-ct2-") as work:
        fp32_dir, int8_dir = Path(work) / "fp32", Path(work) / "int8"
        for directory, quantization in ((fp32_dir, None), (int8_dir, "int8")):
            spec = ct2.convert(translator.model, translator.tokenizer, translator.config)
            spec.optimize(quantization=quantization)
            directory.mkdir()
            spec.save(str(directory))
        # PyTorch rows first: once CTranslate2 has decoded in a process, PyTorch's small
        # parallel ops there take ~60 µs instead of ~4 (two OpenMP runtimes; measured on the
        # benchmark machine), which would slow every PyTorch row measured after it.
        runs = {
            "tmt_greedy": lambda: run_tmt(translator, sources, 1),
            "tmt_beam4": lambda: run_tmt(translator, sources, 4),
            "tmt_beam4_current": lambda: run_tmt(translator, sources, 4, "current"),
            "tmt_beam4_k_finished": lambda: run_tmt(translator, sources, 4, "k_finished"),
            "tmt_torch_linear_beam4_current": lambda: run_tmt(torch_linear, sources, 4, "current"),
            "tmt_int8_beam4_current": lambda: run_tmt(int8, sources, 4, "current"),
            "tmt_bf16_greedy": lambda: run_tmt(bf16, sources, 1),
            "tmt_bf16_beam4_current": lambda: run_tmt(bf16, sources, 4, "current"),
            "hf_greedy": lambda: run_hf(hf_model, translator, sources, 1),
            "hf_beam4_never": lambda: run_hf(hf_model, translator, sources, 4, "never"),
            "hf_beam4": lambda: run_hf(hf_model, translator, sources, 4),
            "tmt_ct2_greedy": lambda: run_tmt(tmt_ct2("fp32"), sources, 1),
            "tmt_ct2_beam4": lambda: run_tmt(tmt_ct2("fp32"), sources, 4),
            "tmt_ct2_int8_beam4": lambda: run_tmt(tmt_ct2("int8"), sources, 4),
            "ct2_greedy": lambda: run_ct2(fp32_dir, translator, sources, 1),
            "ct2_beam4": lambda: run_ct2(fp32_dir, translator, sources, 4),
            "ct2_int8_beam4": lambda: run_ct2(int8_dir, translator, sources, 4, "int8"),
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
                f"{name:<32} {r['sentences_per_s']:>8.1f} sent/s"
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
        "isa": isa,
        "bf16_arithmetic": native_bf16,
        "hf_architecture": architecture,
        "sentences": len(sources),
        "threads": torch.get_num_threads(),
        "results": results,
        "ratios": {
            # The goals: tmt beam 4 against CTranslate2 fp32 beam 4 with CTranslate2's stopping
            # rule (k_finished: a sentence stops once it has k finished hypotheses; current
            # searches a little longer), and against HF generate with the same rule as tmt's.
            "tmt_beam4_k_finished_over_ct2_beam4": ratio("tmt_beam4_k_finished", "ct2_beam4"),
            "tmt_beam4_current_over_ct2_beam4": ratio("tmt_beam4_current", "ct2_beam4"),
            "tmt_beam4_over_hf_beam4_never": ratio("tmt_beam4", "hf_beam4_never"),
            "tmt_beam4_current_over_hf_beam4": ratio("tmt_beam4_current", "hf_beam4"),
            "tmt_greedy_over_hf_greedy": ratio("tmt_greedy", "hf_greedy"),
            "tmt_greedy_over_ct2_greedy": ratio("tmt_greedy", "ct2_greedy"),
            "tmt_int8_over_ct2_int8_beam4": ratio("tmt_int8_beam4_current", "ct2_int8_beam4"),
            # tmt --engine ctranslate2 against raw CTranslate2 on the same batches (goal >= 0.95)
            "tmt_ct2_over_ct2_greedy": ratio("tmt_ct2_greedy", "ct2_greedy"),
            "tmt_ct2_over_ct2_beam4": ratio("tmt_ct2_beam4", "ct2_beam4"),
            "tmt_ct2_int8_over_ct2_int8_beam4": ratio("tmt_ct2_int8_beam4", "ct2_int8_beam4"),
            # oneDNN's packed linear layers (decode.cpu_linear's default) over PyTorch's own
            "onednn_over_torch_linear_beam4": ratio(
                "tmt_beam4_current", "tmt_torch_linear_beam4_current"
            ),
            # bf16 over fp32 (tmt's engine: CTranslate2 has no bf16 on a CPU), and against
            # CTranslate2's fastest CPU rows
            "tmt_bf16_over_tmt_fp32_beam4": ratio("tmt_bf16_beam4_current", "tmt_beam4_current"),
            "tmt_bf16_over_tmt_fp32_greedy": ratio("tmt_bf16_greedy", "tmt_greedy"),
            "tmt_bf16_over_ct2_beam4": ratio("tmt_bf16_beam4_current", "ct2_beam4"),
            "tmt_bf16_over_ct2_int8_beam4": ratio("tmt_bf16_beam4_current", "ct2_int8_beam4"),
            # int8 over fp32, each engine, beam 4
            "tmt_int8_over_tmt_fp32_beam4": ratio("tmt_int8_beam4_current", "tmt_beam4_current"),
            "ct2_int8_over_ct2_fp32_beam4": ratio("ct2_int8_beam4", "ct2_beam4"),
        },
        "bleu_int8_minus_fp32": {
            "tmt": round(
                results["tmt_int8_beam4_current"]["bleu"] - results["tmt_beam4_current"]["bleu"], 2
            ),
            "ct2": round(results["ct2_int8_beam4"]["bleu"] - results["ct2_beam4"]["bleu"], 2),
        },
        "bleu_bf16_minus_fp32": {
            "greedy": round(results["tmt_bf16_greedy"]["bleu"] - results["tmt_greedy"]["bleu"], 2),
            "beam4": round(
                results["tmt_bf16_beam4_current"]["bleu"] - results["tmt_beam4_current"]["bleu"], 2
            ),
        },
        "identical_outputs": {
            "tmt_greedy_vs_hf": agree("tmt_greedy", "hf_greedy"),
            "tmt_greedy_vs_ct2": agree("tmt_greedy", "ct2_greedy"),
            "tmt_beam4_vs_hf_never": agree("tmt_beam4", "hf_beam4_never"),
            "tmt_beam4_current_vs_hf": agree("tmt_beam4_current", "hf_beam4"),
            "tmt_beam4_current_vs_ct2": agree("tmt_beam4_current", "ct2_beam4"),
            "tmt_beam4_k_finished_vs_ct2": agree("tmt_beam4_k_finished", "ct2_beam4"),
            "tmt_onednn_vs_torch_linear": agree(
                "tmt_beam4_current", "tmt_torch_linear_beam4_current"
            ),
            "tmt_beam4_vs_tmt_beam4_current": agree("tmt_beam4", "tmt_beam4_current"),
            "tmt_int8_vs_tmt": agree("tmt_int8_beam4_current", "tmt_beam4_current"),
            "tmt_bf16_vs_tmt_greedy": agree("tmt_bf16_greedy", "tmt_greedy"),
            "tmt_bf16_vs_tmt_beam4": agree("tmt_bf16_beam4_current", "tmt_beam4_current"),
            "ct2_int8_vs_ct2": agree("ct2_int8_beam4", "ct2_beam4"),
            "tmt_ct2_vs_ct2_greedy": agree("tmt_ct2_greedy", "ct2_greedy"),
            "tmt_ct2_vs_ct2_beam4": agree("tmt_ct2_beam4", "ct2_beam4"),
        },
    }
    for key, value in summary["identical_outputs"].items():
        print(f"identical outputs, {key}: {value:.1%}")
    for key, value in summary["ratios"].items():
        print(f"{key}: {value:.2f}x")
    print(json.dumps(summary))


if __name__ == "__main__":
    from transformer_mt.common.exits import run_script

    sys.exit(run_script(main))
