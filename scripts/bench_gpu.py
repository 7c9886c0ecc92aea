"""The parts of scripts/bench_gpu.sh that are Python, and its table.

    python scripts/bench_gpu.py attention --out DIR     # SDPA's kernels over a first epoch
    python scripts/bench_gpu.py compile --out DIR       # train.compile: eager against compiled
    python scripts/bench_gpu.py profile --out DIR       # where a new batch shape's time goes
    python scripts/bench_gpu.py e2e --out DIR            # tmt train -c multi30k-gpu via torchrun
    python scripts/bench_gpu.py decode --model RUN --out DIR --lines 10000
    python scripts/bench_gpu.py decode_profile --model RUN --out DIR --lines 2500
    python scripts/bench_gpu.py resume --out DIR         # a kill and resume on the GPU
    python scripts/bench_gpu.py table DIR                # one table of every part's JSON

Each part writes DIR/<part>.json (and prints it as its last line). `--device cpu` runs a part on
the CPU with small sizes: it checks the script, it measures nothing a report may quote.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TMT = [sys.executable, "-m", "transformer_mt"]
# The base model on the bundled corpus, en→de with the base preset's 37k joint vocabulary.
BASE_ON_MULTI30K = [
    "data.source=multi30k",
    "data.train=train",
    "data.valid=val",
    "data.test=test_2016_flickr",
    "data.src_lang=en",
    "data.tgt_lang=de",
    "data.num_proc=4",
]


def write(out: Path, part: str, result: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{part}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result), flush=True)


def attention(args: argparse.Namespace) -> dict:
    """tmt's update over its first epoch of GPU batches (every shape new: plans and kernels are
    made then), then over the same batches again (every shape known: with --set
    train.cuda_graphs=on, replays, where the kernels' time is the update's), once per attention
    kernel, each on a fresh model in this process; cuDNN first, before any shape is known to
    it."""
    sys.path.insert(0, str(REPO / "scripts"))
    import torch
    from bench_train import build_tmt, load_batches, tmt_step

    overrides = [*BASE_ON_MULTI30K, *(args.set or [])]
    cfg, tok, host = load_batches("base", overrides, args.steps, args.device)
    tokens = sum(b.n_tokens for b in host)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    rows = {}
    for backend in ("cudnn", "flash", "efficient", "math", "auto"):
        torch.manual_seed(0)
        model = build_tmt(cfg, tok).to(args.device).train()
        step_args = argparse.Namespace(
            device=args.device,
            precision="bf16" if args.device == "cuda" else "fp32",
            compile=False,
        )
        chosen = dataclasses.replace(
            cfg, model=dataclasses.replace(cfg.model, attention_backend=backend)
        )
        run = tmt_step(model, chosen, tok, step_args)
        row = {}
        for name in ("first", "warm"):
            sync()
            start = time.perf_counter()
            try:
                for batch in host:
                    run(batch.to(args.device))
                sync()
            except RuntimeError as err:  # a kernel this card or recording refuses: its row says
                row["error"] = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
                break
            seconds = time.perf_counter() - start
            prefix = "" if name == "first" else "warm_"
            row |= {f"{prefix}seconds": round(seconds, 3),
                    f"{prefix}tokens_per_s": round(tokens / seconds, 1)}  # fmt: skip
        rows[backend] = row
        print(backend, row, flush=True)
        del model, run
        if args.device == "cuda":
            torch.cuda.empty_cache()
    shapes = {(b.src.shape[0], b.src.shape[1], b.tgt_out.shape[1]) for b in host}
    result = {"updates": len(host), "batch_shapes": len(shapes), "rows": rows}
    for key, fastest in (("seconds", "fastest"), ("warm_seconds", "fastest_warm")):
        timed = [k for k in rows if k != "auto" and key in rows[k]]
        if timed:
            result[fastest] = min(timed, key=lambda k: rows[k][key])
    return result


def compiled(args: argparse.Namespace) -> dict:
    """The GPU recipe's model and batches (configs/multi30k-gpu.yaml) updated eagerly, with each
    batch shape's step recorded as a CUDA graph and replayed (train.cuda_graphs=on), traced
    once into CUDA graphs of its own kernels (compile_mode cudagraphs: a graph recorded per batch
    shape, then replayed) and torch.compiled by Inductor (what train.compile=on does; Inductor's
    graphs, reduce-overhead, compiled 2 updates in 93 s on an H200), each in a fresh process:
    target tokens/s over the first `steps` updates (compilation included) and again warm. Each
    run gets at most `seconds`: compilation that outlasts it does not pay in a run of minutes
    either."""
    precision = "bf16" if args.device == "cuda" else "fp32"
    common = [
        sys.executable,
        str(REPO / "scripts" / "bench_train.py"),
        "--child",
        "tmt",
        "--device",
        args.device,
        "--precision",
        precision,
        "--config",
        "multi30k-gpu",
        "--cold-steps",
        str(args.steps),
        "--warm-steps",
        str(args.steps),
        "--warmup",
        "0",
        *_sets([f"train.device={args.device}", *(args.set or [])]),
    ]
    keep = ("steps", "batch_shapes", "seconds", "tokens_per_s", "warm_tokens_per_s", "mfu")
    rows: dict[str, dict] = {}
    modes = (
        ("eager", []),
        ("cuda_graphs", ["--set", "train.cuda_graphs=on"]),
        ("traced", ["--compile=cudagraphs"]),
        ("compiled", ["--compile"]),
    )
    for name, extra in modes:
        try:
            done = subprocess.run(
                common + extra, capture_output=True, text=True, cwd=REPO, timeout=args.seconds
            )
        except subprocess.TimeoutExpired:
            rows[name] = {"error": f"not done in {args.seconds} s"}
        else:
            if done.returncode != 0:
                rows[name] = {"error": (done.stderr.strip().splitlines() or ["?"])[-1][:200]}
            else:
                found = json.loads(done.stdout.strip().splitlines()[-1])
                rows[name] = {k: found[k] for k in keep if k in found}
        print(name, rows[name], flush=True)
    return {"config": "multi30k-gpu", "rows": rows}


def profile(args: argparse.Namespace) -> dict:
    """Where the time of an update goes on the GPU recipe's model (configs/multi30k-gpu.yaml):
    its first `steps` updates (most of them a batch shape met for the first time) and the same
    updates again (every shape seen), each timed alone (synchronized) and then under the
    profiler; DIR/profile.txt keeps the profiler's tables (host time by operator, GPU time by
    kernel) of both. The first updates also count the allocator's cudaMalloc calls and
    retries, and run again in a process with expandable segments (PYTORCH_CUDA_ALLOC_CONF)."""
    sys.path.insert(0, str(REPO / "scripts"))
    import torch
    from bench_train import build_tmt, load_batches, tmt_step
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    cuda = args.device == "cuda"
    # The default length buckets (70 shapes an epoch at the recipe's 8,192 tokens, its own
    # buckets 35): most updates of the first two phases meet a new shape.
    buckets = ["data.source_buckets=32", "data.target_buckets=8"]
    overrides = [f"train.device={args.device}", *buckets, *(args.set or [])]
    cfg, tok, host = load_batches("multi30k-gpu", overrides, 2 * args.steps, args.device)
    torch.manual_seed(0)
    model = build_tmt(cfg, tok).to(args.device).train()
    step_args = argparse.Namespace(
        device=args.device, precision="bf16" if cuda else "fp32", compile=False
    )
    run = tmt_step(model, cfg, tok, step_args)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]

    def one_by_one(batches: list) -> dict:  # each update alone, synchronized
        times, before = [], allocator()
        for batch in batches:
            start = time.perf_counter()
            run(batch.to(args.device))
            sync()
            times.append(time.perf_counter() - start)
        times.sort()
        # cudaMalloc calls and the allocator's retries (each frees its cache: a device wait).
        grown = {k: v - before[k] for k, v in allocator().items()}
        return {"updates": len(times), "median_ms": round(1e3 * times[len(times) // 2], 1),
                "max_ms": round(1e3 * times[-1], 1), "total_s": round(sum(times), 2),
                **grown}  # fmt: skip

    def allocator() -> dict:
        stats = torch.cuda.memory_stats() if cuda else {}
        return {k: stats.get(k, 0) for k in ("num_device_alloc", "num_alloc_retries")}

    def profiled(name: str, batches: list) -> None:
        sync()
        with profiler(activities=activities) as prof:
            for batch in batches:
                run(batch.to(args.device))
            sync()
        table = prof.key_averages().table
        tables.append(f"== {name}: host time by operator ==\n"
                      + table(sort_by="self_cpu_time_total", row_limit=25))  # fmt: skip
        if cuda:
            tables.append(f"== {name}: GPU time by kernel ==\n"
                          + table(sort_by="self_cuda_time_total", row_limit=15))  # fmt: skip
        (args.out / "profile.txt").write_text("\n\n".join(tables))  # kept if the part is cut off

    def shapes(batches: list) -> set:
        return {(b.src.shape[0], b.src.shape[1], b.tgt_out.shape[1]) for b in batches}

    tables: list[str] = []
    first, later = host[: args.steps], host[args.steps :]
    # Updates 1..steps timed one by one (most of them a new shape); steps+1..2·steps under the
    # profiler (new shapes there too), then again (every shape seen), then timed one by one.
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict[str, dict] = {}

    def measured(name: str, found: dict) -> None:  # printed at once: a part cut off keeps it
        result[name] = found
        print(name, found, flush=True)

    measured("kernels", _attention_kernels(cfg, tok.pad_id, first[0], args.device))
    measured("first", {"new_shapes": len(shapes(first)), **one_by_one(first)})
    if args.first_only:
        return result
    if cuda:  # the same first updates in a process whose allocator maps memory as it grows
        measured("first_expandable", _first_updates_expandable(args))
    profiled("fresh", later)
    measured("fresh", {"updates": len(later), "new_shapes": len(shapes(later) - shapes(first))})
    profiled("warm", later)
    measured("warm_timed", one_by_one(later))
    versions = {"torch": torch.__version__}
    if cuda:
        versions |= {"cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
                     "module_loading": os.environ.get("CUDA_MODULE_LOADING", "")}  # fmt: skip
    return {"config": "multi30k-gpu", "versions": versions, **result}


def _attention_kernels(cfg, pad_id: int, batch, device: str) -> dict:
    """Which of SDPA's fused kernels may take each attention call of the model's training step
    (bf16, the model's attention dropout, one real batch's shapes and padding mask), and PyTorch's
    reasons where one may not (its debug warnings). The third H200 run had cuDNN build a plan for
    every new shape where tmt's order put flash and efficient attention first; this says why."""
    import warnings

    import torch
    from torch.backends import cuda as sdpa

    heads, rows = cfg.model.n_heads, batch.src.shape[0]
    dim = cfg.model.d_model // heads
    source, target = batch.src.shape[1], batch.tgt_in.shape[1]

    def heads_of(length: int) -> torch.Tensor:  # (B, H, length, K)
        return torch.randn(rows, heads, length, dim, device=device, dtype=torch.bfloat16,
                           requires_grad=True)  # fmt: skip

    keep = (batch.src != pad_id)[:, None, None, :].to(device)  # (B, 1, 1, S), as the model's
    # SDPA turns a boolean mask into an additive one of the query's type before it chooses.
    additive = torch.zeros(keep.shape, device=device, dtype=torch.bfloat16)
    additive = additive.masked_fill(~keep, float("-inf"))
    calls = {
        "encoder": (heads_of(source), heads_of(source), additive, False),
        "decoder_self": (heads_of(target), heads_of(target), None, True),
        "cross": (heads_of(target), heads_of(source), additive, False),
    }
    checks = {"flash": sdpa.can_use_flash_attention, "efficient": sdpa.can_use_efficient_attention,
              "cudnn": sdpa.can_use_cudnn_attention}  # fmt: skip
    found: dict[str, dict] = {}
    for name, (query, key, mask, causal) in calls.items():
        params = sdpa.SDPAParams(query, key, key, mask, cfg.model.attention_dropout, causal, False)
        found[name] = {}
        for kernel, check in checks.items():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                ok = check(params, True)
            why = "; ".join(str(w.message).splitlines()[0][:160] for w in caught)
            found[name][kernel] = True if ok else why or False
    return found


def _first_updates_expandable(args: argparse.Namespace) -> dict:
    """The profile's first phase again, in a fresh process with PyTorch's expandable segments:
    whether a new shape's cost is the caching allocator's new blocks."""
    out = args.out / "expandable"
    command = [sys.executable, __file__, "profile", "--first-only", "--out", str(out),
               "--steps", str(args.steps), *_sets(args.set)]  # fmt: skip
    env = os.environ | {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    try:
        done = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=60, cwd=REPO
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"error": "not done in 60 s"}
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["?"])[-1][:200]}
    return json.loads((out / "profile.json").read_text())["first"]


def _timed_lines(command: list[str], log: Path) -> subprocess.CompletedProcess:
    """Runs `command`; its log lines go to `log` as they come, each after the seconds since
    the start (where a short run's wall time goes: start, data, new shapes, validation, saves)."""
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as stdout, log.open("w") as out:
        process = subprocess.Popen(
            command, stdout=stdout, stderr=subprocess.PIPE, text=True, cwd=REPO
        )  # fmt: skip
        lines = []
        for line in process.stderr:
            lines.append(line)
            out.write(f"{time.perf_counter() - start:7.1f} {line}")
            out.flush()
        process.wait()
        stdout.seek(0)
        return subprocess.CompletedProcess(
            command, process.returncode, stdout.read(), "".join(lines)
        )


def e2e(args: argparse.Namespace) -> dict:
    """`tmt train -c multi30k-gpu` through torchrun (NCCL, one rank): its wall time from the
    command's start to its end; then test2016 and validation BLEU of what it made (tmt
    evaluate, its own decoding settings, on the GPU)."""
    label = args.label or "e2e"  # e2e's run is the decode part's model; a variant's its own
    run_dir = args.out / ("multi30k" if label == "e2e" else label)
    shutil.rmtree(run_dir, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    preset = ["-c", "multi30k-gpu", "--set", f"train.out_dir={run_dir}", *_sets(args.set)]
    if args.device == "cpu":  # the script's check: a few updates
        preset += [
            "--set",
            "train.device=cpu",
            "--set",
            "train.precision=fp32",
            "--set",
            "train.max_minutes=0.3",
            "--set",
            "model.n_encoder_layers=1",
            "--set",
            "model.n_decoder_layers=1",
        ]
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "1",
        "-m",
        "transformer_mt",
        "train",
        *preset,
        "--json",
    ]
    start = time.perf_counter()
    trained = _timed_lines(torchrun, args.out / f"{label}_train.log")
    seconds = time.perf_counter() - start
    if (run_dir / "metrics.jsonl").is_file():  # the run's curve and rates, kept with the logs
        shutil.copyfile(run_dir / "metrics.jsonl", args.out / f"{label}_metrics.jsonl")
    result = {"train_rc": trained.returncode, "wall_s": round(seconds, 1)}
    if trained.returncode != 0:
        return result | {"error": trained.stderr.strip().splitlines()[-1:]}
    summary = json.loads(trained.stdout.strip().splitlines()[-1])
    result |= {"updates": summary["step"], "stop": summary["stop"]}
    device = "cuda" if args.device == "cuda" else "cpu"
    # Both splits: the recipe's choices are made on the validation split, the goal is test2016.
    for split, key in (("test", "test2016_bleu"), ("valid", "valid_bleu")):
        scored = subprocess.run(
            [*TMT, "evaluate", "-m", str(run_dir), "--split", split, "--json", "--device", device],
            capture_output=True,
            text=True,
            cwd=REPO,
        )
        if scored.returncode != 0:
            return result | {"evaluate_error": scored.stderr.strip().splitlines()[-1:]}
        result[key] = json.loads(scored.stdout.strip().splitlines()[-1]).get("bleu")
    return result


def _sets(items: list[str] | None) -> list[str]:
    return [arg for item in items or [] for arg in ("--set", item)]


def decode(args: argparse.Namespace) -> dict:
    """`lines` Multi30k training sources (de) decoded by the model at its default settings on
    the device: tmt; transformers `generate` on tmt's export (AutoModelForSeq2SeqLM), the same
    beam and length penalty, batches of 256 sentences in tmt's length order; CTranslate2 on the
    GPU if its wheel runs there. Sentences/s, BLEU against the references, one timed pass each
    after a warm-up on 256 lines. generate's length penalty is |Y|^α (decode.length_penalty_form
    power: the GPU recipe's), tmt's default GNMT's: a model of another form is decoded again with
    power (`tmt_power`), which searches for what generate searches for; the lines where a tmt
    row differs from generate are counted (0 of 300 on a CPU). Then with generate's stopping rule
    too (decode.early_stopping=current: HF's default; tmt's exact bound costs steps, ~20 % more
    on a CPU, where one batch's last sentences hold a GPU's host to its step rate); and at the
    larger batches of `sizes` (decode.max_tokens), above the default's 32,768-token cap; on CUDA
    also in bf16 (decode.precision)."""
    import torch
    import transformers

    from transformer_mt.translation import evaluate, translate
    from transformer_mt.translation.batch_budget import batch_tokens

    transformers.logging.set_verbosity_error()
    sources, references = _training_lines(args.lines)
    translator = translate.load_translator(args.model, [f"decode.device={args.device}"])
    decode_cfg = translator.config.decode
    rows: dict[str, dict] = {}

    def timed(name: str, fn) -> None:
        fn(sources[:256])  # warm-up
        if args.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        texts = fn(sources)
        if args.device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        rows[name] = {
            "sentences_per_s": round(len(sources) / seconds, 1),
            "seconds": round(seconds, 2),
            "bleu": evaluate.score(texts, references)["bleu"],
        }
        outputs[name] = texts
        print(name, rows[name], flush=True)

    outputs: dict[str, list[str]] = {}
    # The goal's ratio first (tmt, then generate): the third H200 run's part ran out of time
    # in the variants, before generate.
    timed("tmt", lambda lines: translate.translate_text(translator, lines))
    export = args.out / "hf_export"
    shutil.rmtree(export, ignore_errors=True)
    subprocess.run(
        [*TMT, "export", "-m", str(args.model), "--format", "huggingface", "-o", str(export)],
        check=True,
        cwd=REPO,
        capture_output=True,
    )
    hf = transformers.AutoModelForSeq2SeqLM.from_pretrained(export).to(args.device).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(export)
    # tmt's output limit of each line (a·|x| + b within the position table), its batch's largest:
    # a fixed a·128 + b ran past Marian's 128 positions on a line the model never ends.
    limits = translate.output_limits(translator, translate.source_ids(translator, sources))
    limit_of = dict(zip(sources, limits, strict=True))

    @torch.inference_mode()
    def generate(lines: list[str]) -> list[str]:
        order = sorted(range(len(lines)), key=lambda i: len(lines[i]))
        out = [""] * len(lines)
        for at in range(0, len(order), 256):
            chosen = order[at : at + 256]
            batch = hf_tok([lines[i] for i in chosen], return_tensors="pt", padding=True)
            ids = hf.generate(
                **batch.to(args.device),
                num_beams=decode_cfg.beam_size,
                length_penalty=decode_cfg.length_penalty,
                max_new_tokens=max(limit_of[lines[i]] for i in chosen),
                do_sample=False,
            )
            for i, text in zip(
                chosen, hf_tok.batch_decode(ids, skip_special_tokens=True), strict=True
            ):
                out[i] = text
        return out

    def result() -> dict:  # the rows so far
        def unlike_generate(name: str) -> int | None:
            if name not in outputs:
                return None
            return sum(a != b for a, b in zip(outputs[name], outputs["hf_generate"], strict=True))

        ratio = rows["tmt"]["sentences_per_s"] / rows["hf_generate"]["sentences_per_s"]
        return {
            "length_penalty_form": decode_cfg.length_penalty_form,
            "lines_unlike_generate": {
                name: unlike_generate(name) for name in outputs if name.startswith("tmt")
            },
            # tmt's own variants against its default run (CUDA graphs: the same search)
            "lines_unlike_tmt": {
                name: sum(a != b for a, b in zip(outputs[name], outputs["tmt"], strict=True))
                for name in outputs
                if name.startswith("tmt_")
            },
            "lines": len(sources),
            "beam": decode_cfg.beam_size,
            "max_tokens": batch_tokens(translator),
            "rows": rows,
            "tmt_over_generate": round(ratio, 2),
        }

    timed("hf_generate", generate)
    # The goal's ratio kept at once: the part's limit may cut the variants off.
    (args.out / "decode.json").write_text(json.dumps(result(), indent=1))
    # On CUDA first: the decoder's step as CUDA graphs (the fourth run's steps were host-bound),
    # then bf16 (its matrix products were float32 without tensor cores); generate's length
    # penalty; larger batches than the default's (GPU_BATCH_TOKENS).
    variants = []
    if args.device == "cuda":
        graphs, bf16 = ["decode.cuda_graphs=on"], ["decode.precision=bf16"]
        variants += [("tmt_graphs", graphs), ("tmt_graphs_bf16", [*graphs, *bf16]),
                     ("tmt_bf16", bf16)]  # fmt: skip
    power = ["decode.length_penalty_form=power"]
    if decode_cfg.length_penalty_form != "power":
        variants.append(("tmt_power", power))
    variants.append(("tmt_power_current", [*power, "decode.early_stopping=current"]))
    variants += [(f"tmt_{n}", [f"decode.max_tokens={n}"]) for n in args.sizes or []]
    for name, settings in variants:
        try:  # a variant that fails (a recording the card refuses) is a row of its own
            variant = translate.load_translator(
                args.model, [f"decode.device={args.device}", *settings]
            )
            timed(name, lambda lines, t=variant: translate.translate_text(t, lines))
        except Exception as err:
            rows[name] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}
            print(name, rows[name], flush=True)
    try:
        ct2 = translate.load_translator(
            args.model, [f"decode.device={args.device}", "decode.engine=ctranslate2"]
        )
        timed("ctranslate2", lambda lines: translate.translate_text(ct2, lines))
    except Exception as err:  # a wheel that does not run on this card is a row of its own
        rows["ctranslate2"] = {"error": str(err).splitlines()[0][:200]}
    return result()


def decode_profile(args: argparse.Namespace) -> dict:
    """Where decoding's time goes: `lines` Multi30k training sources (default 2,500: about one
    batch at the default decode.max_tokens on a GPU) decoded by the model at its defaults, timed
    (synchronized), then again under the profiler: the kernels' busy time against the wall time
    (bound by the host, or by which kernels: the decoder cache's reorder is index_select's
    copies), the top kernels (on a CPU, operators), the search's steps and rows a step (the
    output projection's calls), and the share of the wall time the host spent inside the
    model's decoder steps (the rest: the search, the encoder, the text). The decode part says
    how fast; this says why. --set: decoding settings (decode.cuda_graphs=on: the recorded
    steps counted and timed at DecoderGraphs.step, or for beam search the whole search at
    beam_graphs' run, its rows those it computed, finished sentences' included)."""
    sys.path.insert(0, str(REPO / "scripts"))
    import torch
    from bench_train import profile_calls

    from transformer_mt.network.beam_graphs import _Search
    from transformer_mt.network.decoder_graphs import DecoderGraphs
    from transformer_mt.translation import translate

    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sources, _ = _training_lines(args.lines)
    translator = translate.load_translator(
        args.model, [f"decode.device={args.device}", *(args.set or [])]
    )
    steps, rows = [0], [0]

    def counted(module, inputs, output) -> None:  # one call a search step (and batch)
        steps[0] += 1
        rows[0] += inputs[0].shape[:-1].numel()

    def decode() -> None:
        translate.translate_text(translator, sources)

    translate.translate_text(translator, sources[:256])  # warm-up
    hook = translator.model.output_projection.register_forward_hook(counted)
    model_s = [0.0]  # the host's time inside the model's decoder steps (no sync: launches)
    model_decode = translator.model.decode

    def timed_decode(*args, **kwargs):
        begin = time.perf_counter()
        try:
            return model_decode(*args, **kwargs)
        finally:
            model_s[0] += time.perf_counter() - begin

    graphed_step = DecoderGraphs.step  # decode.cuda_graphs=on: the step, timed and counted
    # the timed decode's, not the profiled; recording_s: the host's time in recordings
    graphs = {"batches": 0, "recorded": 0, "replays": 0, "recording_s": 0.0}

    def timed_graphed_step(self, tokens):
        before = self.recorded, self.replays, self.recording_s
        graphs["batches"] += self.length == 0  # a batch's first step
        begin = time.perf_counter()
        try:
            return graphed_step(self, tokens)
        finally:
            model_s[0] += time.perf_counter() - begin
            steps[0], rows[0] = steps[0] + 1, rows[0] + len(tokens)
            graphs["recorded"] += self.recorded - before[0]
            graphs["replays"] += self.replays - before[1]
            graphs["recording_s"] += self.recording_s - before[2]

    graphed_search = _Search.run  # decode.cuda_graphs=on, beam search: every step a graph

    def timed_graphed_search(self, nbest):
        before = self.graphs.recorded, self.graphs.replays, self.graphs.recording_s
        graphs["batches"] += 1
        begin = time.perf_counter()
        try:
            return graphed_search(self, nbest)
        finally:
            model_s[0] += time.perf_counter() - begin
            steps[0], rows[0] = steps[0] + self.steps_run, rows[0] + self.rows_run
            graphs["recorded"] += self.graphs.recorded - before[0]
            graphs["replays"] += self.graphs.replays - before[1]
            graphs["recording_s"] += self.graphs.recording_s - before[2]

    translator.model.decode = timed_decode  # this instance only, until the timing ends
    DecoderGraphs.step, _Search.run = timed_graphed_step, timed_graphed_search
    sync()
    start = time.perf_counter()
    try:
        decode()
        sync()
    finally:
        DecoderGraphs.step, _Search.run = graphed_step, graphed_search
    wall = time.perf_counter() - start
    del translator.model.decode
    hook.remove()
    profiled = profile_calls([decode], args.device)
    per_step = max(steps[0], 1)
    result = {"lines": len(sources), "wall_s": round(wall, 3), "steps": steps[0],
              "rows_per_step": round(rows[0] / per_step, 1),
              "ms_per_step": round(1e3 * wall / per_step, 3),
              "model_step_share": round(model_s[0] / wall, 3), "profile": profiled}  # fmt: skip
    if "gpu_busy_ms" in profiled:
        result["gpu_busy_share"] = round(profiled["gpu_busy_ms"] / 1e3 / wall, 3)
    if graphs["batches"]:
        result["graphs"] = {**graphs, "recording_s": round(graphs["recording_s"], 3)}
    return result


def _training_lines(n: int) -> tuple[list[str], list[str]]:
    from transformer_mt.data.corpus import BUNDLED_DIR

    def read(lang: str) -> list[str]:
        with gzip.open(BUNDLED_DIR / f"train.{lang}.gz", "rt", encoding="utf-8") as f:
            return f.read().splitlines()[:n]

    return read("de"), read("en")


def resume(args: argparse.Namespace) -> dict:
    """configs/tiny.yaml on the device for 8 updates, straight; and killed after its checkpoint
    at step 4 (TMT_FAULT), then the same command again: every logged loss and every weight of
    step 8 must be the straight run's, bit for bit. --set adds overrides to both runs
    (train.cuda_graphs=on: a resumed run records its shapes again)."""
    import torch

    from transformer_mt.runs import checkpoint

    precision = "bf16" if args.device == "cuda" else "fp32"
    base = [
        "train",
        "-c",
        "tiny",
        "--set",
        f"train.device={args.device}",
        "--set",
        f"train.precision={precision}",
        "--set",
        "train.max_steps=8",
        "--set",
        "train.save_every=4",
        "--set",
        "train.log_every=1",
        *_sets(args.set),
        "--json",
    ]

    def tmt(run_dir: Path, fault: str = "") -> subprocess.CompletedProcess:
        env = {**os.environ, **({"TMT_FAULT": fault} if fault else {})}
        cmd = [*TMT, *base, "--set", f"train.out_dir={run_dir}"]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)

    label = args.label or "resume"
    straight, resumed = args.out / f"{label}_straight", args.out / f"{label}_resumed"
    for path in (straight, resumed):
        shutil.rmtree(path, ignore_errors=True)
    runs = [tmt(straight)]
    if runs[0].returncode == 0:  # else the others would be refused the same, minutes on a GPU
        runs += [tmt(resumed, "after_save@4:kill"), tmt(resumed)]
    codes = [run.returncode for run in runs]
    failed = [run for run in runs[::2] if run.returncode != 0]
    if failed:  # a setting or a device the runs refuse: their own line, not a missing file
        return {"exit_codes": codes, "error": failed[0].stderr.strip().splitlines()[-1:]}
    if codes[1] != -signal.SIGKILL:  # no kill, no resume: "bit-exact" would say nothing
        return {"exit_codes": codes, "error": [
            f"the run to be killed after its step-4 checkpoint ended with exit {codes[1]}"
            " (another run in the same --out?)"]}  # fmt: skip

    def losses(run_dir: Path) -> list:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return [json.loads(x).get("loss") for x in lines if '"loss"' in x]

    a = checkpoint.read(straight / "checkpoints" / "step_00000008").state_dict
    b = checkpoint.read(resumed / "checkpoints" / "step_00000008").state_dict
    same_weights = all(torch.equal(a[k], b[k]) for k in a)
    return {
        "exit_codes": codes,
        "same_losses": losses(straight) == losses(resumed),
        "same_weights": same_weights,
        "bit_exact": same_weights and losses(straight) == losses(resumed),
    }


def table(directory: Path) -> str:
    """One table of every part's JSON in `directory` (a part that did not finish says so)."""
    parts = [json.loads(x) for x in (directory / "parts.jsonl").read_text().splitlines() if x]

    def load(name: str) -> dict:
        try:
            return json.loads((directory / f"{name}.json").read_text())
        except (OSError, ValueError):  # not written, or not JSON: the part did not finish
            return {}

    rows = [("part", "exit", "seconds", "result")]
    for part in parts:
        name, found = part["part"], load(part["part"])
        if name == "tests":  # pytest's last line: what passed, failed and was skipped
            log = (directory / "tests.log").read_text(errors="replace").strip().splitlines()
            found = {"pytest": log[-1].strip("= ")} if log else {}
        rows.append((name, str(part["rc"]), f"{part['seconds']:.0f}", _summary(name, found)))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [" | ".join(r[i].ljust(widths[i]) if i < 3 else r[i] for i in range(4)) for r in rows]
    return "\n".join(lines)


def _busy(r: dict) -> str:
    """A warm update's wall time against its kernels' (bench_train.py --profile-steps): bound by
    the host or by the kernels, and which kinds of kernel."""
    profiled = r.get("warm_profile") or {}
    if "error" in profiled:
        return f" (warm profile failed: {profiled['error']})"
    if "gpu_busy_ms" not in profiled or not r.get("warm_ms_per_update"):
        return ""
    wall, busy = r["warm_ms_per_update"], profiled["gpu_busy_ms"]
    kinds = ", ".join(f"{k} {v}" for k, v in list(profiled["kinds_ms"].items())[:5])
    return (
        f" (a warm update {wall} ms, its kernels {busy} ms: {busy / wall:.0%} busy; {kinds} ms;"
        f" {profiled['launches']} launches)"
    )


def _attention_cell(backend: str, row: dict) -> str:
    if "seconds" not in row:
        return f"{backend}: {row.get('error')}"
    warm = f" (warm {row['warm_seconds']:.2f})" if "warm_seconds" in row else ""
    return f"{backend} {row['seconds']:.1f} s{warm}"


def _summary(name: str, found: dict) -> str:
    if not found:
        return "(no result: see its log)"
    if name in ("train", "train_graphs", "train_traced", "train_bf16_weights"):
        res = found.get("results", {})
        cells = []
        for system, r in res.items():
            mfu = f", MFU {r['mfu']:.1%}" if "mfu" in r else ""
            warm = (
                (
                    f"; warm {r['warm_tokens_per_s']:,.0f}"
                    + (f", MFU {r['warm_mfu']:.1%}" if "warm_mfu" in r else "")
                )
                if r.get("warm_tokens_per_s")
                else ""
            )
            cells.append(
                f"{system} {r['tokens_per_s']:,.0f} tok/s over the first {r['steps']}"
                f"{mfu}{warm}; {r['batch_shapes']} shapes{_busy(r)}"
            )
        ratios = ", ".join(f"{k} {v:.2f}x" for k, v in found.get("ratios", {}).items())
        peak = next(iter(res.values()), {}).get("bf16_peak_tflops")
        return (
            "; ".join(cells)
            + (f"; {ratios}" if ratios else "")
            + (f"; bf16 peak {peak} TFLOP/s" if peak else "")
        )
    if name.startswith("attention"):
        rows = ", ".join(_attention_cell(k, v) for k, v in found["rows"].items())
        return (
            f"first {found['updates']} updates ({found['batch_shapes']} shapes), then the same"
            f" again warm: {rows}; fastest {found.get('fastest')}, warm"
            f" {found.get('fastest_warm')}"
        )
    if name == "profile":
        first, warm = found.get("first", {}), found.get("warm_timed", {})
        expandable = found.get("first_expandable", {})
        allowed = ", ".join(
            f"{call} " + ("+".join(k for k, ok in kernels.items() if ok is True) or "math")
            for call, kernels in found.get("kernels", {}).items()
        )
        return (
            f"fused kernels allowed: {allowed}; first {first.get('updates')} updates"
            f" ({first.get('new_shapes')} new shapes):"
            f" median {first.get('median_ms')} ms, {first.get('total_s')} s,"
            f" {first.get('num_device_alloc')} cudaMalloc, {first.get('num_alloc_retries')}"
            f" retries; with expandable segments {expandable.get('total_s')} s"
            f" {expandable.get('error', '')}; updates over seen shapes: median"
            f" {warm.get('median_ms')} ms (tables in profile.txt)"
        )
    if name == "compile":
        return "; ".join(
            f"{k}: {v['tokens_per_s']:,.0f} tok/s over the first {v['steps']}"
            f" ({v['seconds']:.1f} s), warm {v['warm_tokens_per_s']:,.0f}"
            if "tokens_per_s" in v
            else f"{k}: {v.get('error')}"
            for k, v in found["rows"].items()
        )
    if name.startswith("e2e"):
        return ", ".join(f"{k} {v}" for k, v in found.items())
    if name.startswith("decode_profile"):
        profiled = found.get("profile", {})
        kinds = ", ".join(f"{k} {v}" for k, v in list(profiled.get("kinds_ms", {}).items())[:5])
        busy = (
            f"; kernels busy {found['gpu_busy_share']:.0%} of it ({kinds} ms;"
            f" {profiled.get('launches')} launches)"
            if "gpu_busy_share" in found
            else f"; {profiled.get('error') or 'no GPU figures'}"
        )
        return (
            f"{found.get('lines')} lines in {found.get('wall_s')} s, {found.get('steps')} steps"
            f" of {found.get('rows_per_step')} rows, {found.get('ms_per_step')} ms a step"
            f" ({found.get('model_step_share', 0):.0%} of it in the model's step){busy}"
            + (f"; graphs {found['graphs']}" if "graphs" in found else "")
        )
    if name == "decode":
        rows = "; ".join(
            f"{k} {v['sentences_per_s']:,.0f} sent/s BLEU {v['bleu']:.2f}"
            if "bleu" in v
            else f"{k}: {v.get('error')}"
            for k, v in found["rows"].items()
        )
        return (
            f"{found['lines']} lines, beam {found['beam']}: {rows}; tmt/generate"
            f" {found['tmt_over_generate']}x (length penalty {found.get('length_penalty_form')});"
            " lines unlike generate's: "
            + ", ".join(f"{k} {v}" for k, v in found.get("lines_unlike_generate", {}).items())
            + "; unlike tmt's: "
            + ", ".join(f"{k} {v}" for k, v in found.get("lines_unlike_tmt", {}).items())
        )
    return ", ".join(f"{k} {v}" for k, v in found.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parts = ("attention", "compile", "profile", "e2e", "decode", "decode_profile", "resume",
             "table")  # fmt: skip
    parser.add_argument("part", choices=parts)
    parser.add_argument("directory", nargs="?", type=Path, help="table: the results' directory")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench_gpu")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", type=Path, help="decode: the model (a run directory)")
    parser.add_argument(
        "--lines", type=int, help="decode: lines (default 10,000); decode_profile (2,500)"
    )
    parser.add_argument(
        "--sizes", type=lambda v: [int(x) for x in v.split(",") if x], default=[65536, 131072],
        help="decode: tmt again at these decode.max_tokens",
    )  # fmt: skip
    parser.add_argument(
        "--steps", type=int, default=40, help="attention, compile, profile: updates"
    )
    parser.add_argument("--seconds", type=int, default=50, help="compile: the compiled run's limit")
    parser.add_argument("--set", action="append", help="a config override for the part")
    parser.add_argument("--first-only", action="store_true", help="profile: its first phase")
    parser.add_argument("--label", help="the result's name (default: the part's), e.g. e2e_eager")
    args = parser.parse_args()
    if args.part == "table":
        print(table(args.directory or args.out))
        return
    from transformer_mt.common.distributed import resolve_device

    resolve_device(args.device, key="--device")  # a GPU where there is none: one line, exit 2
    run = {"attention": attention, "compile": compiled, "profile": profile, "e2e": e2e}
    if args.part in ("decode", "decode_profile") and args.model is None:
        parser.error(f"{args.part} decodes a model: name it with --model (a run directory)")
    if args.lines is None:
        args.lines = 2500 if args.part == "decode_profile" else 10000
    if args.lines < 1:  # a slice [:-5] would be every line but five
        parser.error(f"--lines {args.lines}: expected a number of lines >= 1")
    # A label names files and run directories inside --out, which e2e and resume remove first:
    # "..", or one with a slash, would name (and remove) something outside it.
    if args.label is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", args.label):
        parser.error(f"--label {args.label!r}: expected a plain name (letters, digits, _ . -)")
    parts_run = {**run, "decode": decode, "decode_profile": decode_profile, "resume": resume}
    result = parts_run[args.part](args)
    write(args.out, args.label or args.part, {"device": args.device, **result})


if __name__ == "__main__":
    from transformer_mt.common.exits import run_script

    run_script(main)
