"""Training throughput: tmt vs HF transformers MarianMTModel vs a torch.nn.Transformer loop.

All three train the same architecture (by default the multi30k preset: 4+4 layers, d_model 128,
tied 8k joint vocabulary) on the same batches of the bundled Multi30k corpus, with the same
label-smoothed loss and Adam. The batches are those tmt trains on, on that device: data.max_tokens
and data.bucketing as the config leaves them to the device (4,096 tokens and exact lengths on a
CPU; 25,000 tokens and bounded shapes on CUDA). tmt runs its own update (training/step.py: its
loss, fused with the output layer on CUDA and from a 4,000-piece vocabulary on a CPU, its
attention kernels, one wait for the device an update); the peers run the textbook step. Each
run is a fresh process (its own peak RSS); systems are interleaved over --rounds and the median
is kept, because this VM's timings drift by ±20 %.

Timing: --cold-steps updates from the very first (every batch shape met for the first time is in
it: a GPU builds kernels and plans then), and --warm-steps updates again over those batches, every
shape seen. tokens/s counts real (non-padding) target tokens. On CUDA, MFU: the model's matrix
FLOPs on the real tokens (6 × multiply-adds: forward and backward) over the bf16 matrix-product
rate this script measures on the card (an 8192³ product), not a datasheet's.

tmt runs as `tmt` runs: its CLI makes glibc keep freed memory before torch is imported
(allocator.keep_freed_memory). The peers run as shipped, and again with that same allocator setting
("+alloc"), so the report separates what the allocator gives from what the model code gives.
Needs the bench extra: pip install -e ".[bench]".

    python scripts/bench_train.py [--cold-steps 20] [--warmup 4] [--rounds 2] [--config multi30k]
    python scripts/bench_train.py --device cuda --precision bf16 --config base \
        --set data.source=multi30k --set data.train=train --set data.valid=val \
        --systems tmt,hf_marian \
        --cold-steps 1000 --warm-steps 200 --rounds 1     # scripts/bench_gpu.sh's row

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import time

SYSTEMS = (
    "tmt",
    "hf_marian",
    "torch_nn_transformer",
    "hf_marian+alloc",
    "torch_nn_transformer+alloc",
)


def load_batches(config: str, overrides: list[str], n: int, device: str):
    """The first `n` updates' batches tmt trains on (epochs after the first as needed), on the
    host, with each batch's real lengths per row (for the FLOPs of attention)."""
    import torch

    from transformer_mt.config import load_config
    from transformer_mt.data.batches import prepare_data
    from transformer_mt.training import device_defaults

    cfg = load_config(config, overrides)
    data = prepare_data(cfg)
    cfg = device_defaults.resolve(cfg, torch.device(device), world_size=1)
    shapes = device_defaults.shape_buckets(cfg)
    sampler = data.train.sampler(cfg.data.max_tokens, cfg.train.seed, shapes=shapes)
    batches, epoch = [], 0
    while len(batches) < n:
        for positions in sampler.epoch_batches(epoch)[: n - len(batches)]:
            pad_to = sampler.batch_shape(epoch, positions)
            batches.append(data.train.batch(positions, data.tokenizer, epoch=epoch, pad_to=pad_to))
        epoch += 1
    return cfg, data.tokenizer, batches


def build_tmt(cfg, tok):
    from transformer_mt.network.model import Transformer

    return Transformer(cfg.model, tok.vocab_size, tok.pad_id)


def build_hf_marian(cfg, tok):
    import torch
    from transformers import MarianConfig, MarianMTModel

    m = cfg.model
    config = MarianConfig(
        vocab_size=tok.vocab_size, decoder_vocab_size=tok.vocab_size, d_model=m.d_model,
        encoder_layers=m.n_encoder_layers, decoder_layers=m.n_decoder_layers,
        encoder_attention_heads=m.n_heads, decoder_attention_heads=m.n_heads,
        encoder_ffn_dim=m.d_ff, decoder_ffn_dim=m.d_ff, activation_function="relu",
        dropout=m.dropout, attention_dropout=m.attention_dropout, activation_dropout=0.0,
        max_position_embeddings=m.max_positions, scale_embedding=True,
        pad_token_id=tok.pad_id, eos_token_id=tok.eos_id, decoder_start_token_id=tok.bos_id,
        share_encoder_decoder_embeddings=True, tie_word_embeddings=True,
    )  # fmt: skip
    model = (
        MarianMTModel(config, attn_implementation="sdpa")
        if _accepts_attn(MarianMTModel)
        else MarianMTModel(config)
    )

    class Wrapped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, src, tgt_in):
            out = self.inner(
                input_ids=src, attention_mask=(src != tok.pad_id).long(),
                decoder_input_ids=tgt_in, decoder_attention_mask=(tgt_in != tok.pad_id).long(),
            )  # fmt: skip
            return out.logits

    return Wrapped()


def _accepts_attn(cls) -> bool:
    import inspect

    return "attn_implementation" in inspect.signature(cls.__init__).parameters


def build_torch_nn_transformer(cfg, tok):
    import torch
    import torch.nn.functional as F

    from transformer_mt.network.model import sinusoidal_positions

    m, pad = cfg.model, tok.pad_id

    class NNTransformer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(tok.vocab_size, m.d_model)
            self.register_buffer(
                "pos", sinusoidal_positions(m.max_positions, m.d_model), persistent=False
            )
            self.drop = torch.nn.Dropout(m.dropout)
            self.core = torch.nn.Transformer(
                m.d_model,
                m.n_heads,
                m.n_encoder_layers,
                m.n_decoder_layers,
                m.d_ff,
                m.dropout,
                batch_first=True,
            )

        def embed_(self, ids):
            return self.drop(self.embed(ids) * math.sqrt(m.d_model) + self.pos[: ids.size(1)])

        def forward(self, src, tgt_in):
            causal = torch.nn.Transformer.generate_square_subsequent_mask(
                tgt_in.size(1), device=src.device
            )
            h = self.core(
                self.embed_(src), self.embed_(tgt_in), tgt_mask=causal, tgt_is_causal=True,
                src_key_padding_mask=src == pad, tgt_key_padding_mask=tgt_in == pad,
                memory_key_padding_mask=src == pad,
            )  # fmt: skip
            return F.linear(h, self.embed.weight)

    return NNTransformer()


def child(system: str, args: argparse.Namespace) -> dict:
    if system == "tmt" or system.endswith("+alloc"):
        from transformer_mt.common.allocator import keep_freed_memory

        keep_freed_memory()  # before torch is imported, as the tmt command does
    import torch

    from transformer_mt.network.model import count_parameters

    torch.manual_seed(0)
    steps = args.warmup + args.cold_steps
    overrides = [*(args.set or []), f"model.attention_backend={args.attention}"]
    cfg, tok, host = load_batches(args.config, overrides, steps, args.device)
    builders = {
        "tmt": build_tmt,
        "hf_marian": build_hf_marian,
        "torch_nn_transformer": build_torch_nn_transformer,
    }
    model = builders[system.removesuffix("+alloc")](cfg, tok).to(args.device).train()
    if args.device == "cuda":  # as tmt train sets it
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    step = (tmt_step if system == "tmt" else peer_step)(model, cfg, tok, args)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    shapes = {(b.src.shape[0], b.src.shape[1], b.tgt_out.shape[1]) for b in host}

    def timed(batches) -> float:
        sync()
        start = time.perf_counter()
        for batch in batches:
            step(batch.to(args.device))
        sync()
        return time.perf_counter() - start

    # Cold: from the first update (CPU: after --warmup updates), every new shape included.
    if args.warmup:
        timed(host[: args.warmup])
    cold = host[args.warmup :]
    cold_s = timed(cold)
    warm = cold[: args.warm_steps]
    warm_s = timed(warm) if warm else float("nan")
    profiled = profile_updates(step, warm[: max(0, args.profile_steps)], args.device)
    tokens = sum(b.n_tokens for b in cold)
    result = {
        "system": system,
        "parameters": count_parameters(model),
        "max_tokens": cfg.data.max_tokens,
        "bucketing": cfg.data.bucketing,
        "batch_shapes": len(shapes),
        "steps": len(cold),
        "target_tokens": tokens,
        "seconds": round(cold_s, 3),
        "tokens_per_s": round(tokens / cold_s, 1),
        "warm_steps": len(warm),
        "warm_tokens_per_s": round(sum(b.n_tokens for b in warm) / warm_s, 1) if warm else None,
        "warm_ms_per_update": round(1e3 * warm_s / len(warm), 2) if warm else None,
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "threads": torch.get_num_threads(),
    }
    if profiled:
        result["warm_profile"] = profiled
    if args.device == "cuda":
        peak = matmul_peak()
        result |= {"gpu": torch.cuda.get_device_name(), "bf16_peak_tflops": round(peak / 1e12, 1)}
        result["mfu"] = round(model_flops(cfg, tok, cold, pad_id=tok.pad_id) / cold_s / peak, 4)
        if warm:
            result["warm_mfu"] = round(model_flops(cfg, tok, warm, tok.pad_id) / warm_s / peak, 4)
    return result


# What a kernel's name says it does, first match wins (cuBLAS's, CUTLASS's and cuDNN's names
# are templates many lines long).
KERNEL_KINDS = (
    ("attention", ("fmha", "flash", "attention", "sdpa", "cudnn")),
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas")),
    ("layer_norm", ("layer_norm", "layernorm", "gammabeta")),
    ("softmax", ("softmax", "logsumexp")),
    ("optimizer", ("adam", "multi_tensor_apply")),
    ("dropout", ("dropout",)),
    ("reduction", ("reduce",)),
    ("copy", ("memcpy", "memset", "copy", "cast")),
    ("elementwise", ("elementwise",)),
)


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, marks in KERNEL_KINDS if any(m in lowered for m in marks)), "other")


def profile_updates(step, batches, device: str) -> dict | None:
    """Where `len(batches)` updates over shapes already seen spend their time, per update
    (profile_calls). Says whether an update is bound by its host (GPU busy a small share of its
    wall time) or by its kernels, and by which."""
    if not batches:
        return None
    profiled = profile_calls([lambda b=b: step(b.to(device)) for b in batches], device)
    return profiled if "error" in profiled else {"updates": len(batches), **profiled}


def profile_calls(calls, device: str) -> dict:
    """The calls run under the profiler, per call: on CUDA the kernels' busy time, by kind and
    the top kernels, and the launches; on a CPU the operators' own time. A failure is reported,
    not raised: this is a benchmark's extra row."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    n = len(calls)
    try:
        with profile(activities=activities) as prof:
            for call in calls:
                call()
            if cuda:
                torch.cuda.synchronize()
        events = prof.events()
        top: dict[str, float] = {}
        result: dict = {}
        if cuda:
            kinds: dict[str, float] = {}
            for e in events:
                if e.device_type == DeviceType.CUDA:
                    us, kind = e.time_range.elapsed_us(), kernel_kind(e.name)
                    top[e.name] = top.get(e.name, 0.0) + us
                    kinds[kind] = kinds.get(kind, 0.0) + us
            busy = sum(kinds.values())
            result["gpu_busy_ms"] = round(busy / n / 1e3, 2)
            result["kinds_ms"] = {
                k: round(v / n / 1e3, 2) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])
            }
            result["launches"] = round(sum("Launch" in e.name for e in events) / n, 1)
        else:
            for e in prof.key_averages():
                if e.key.startswith("aten::"):
                    top[e.key] = e.self_cpu_time_total
            result["host_op_ms"] = round(sum(top.values()) / n / 1e3, 2)
        best = sorted(top.items(), key=lambda kv: -kv[1])[:10]
        result["top_ms"] = {name[:100]: round(us / n / 1e3, 3) for name, us in best}
        return result
    except Exception as err:  # the row says what failed; the timings stand
        return {"error": f"{type(err).__name__}: {err}"[:300]}


def tmt_step(model, cfg, tok, args):
    """tmt's own update (training/step.py) with what tmt train uses on this device: its loss
    (train.fused_loss: fused on CUDA, and on a CPU from a 4,000-piece vocabulary), fused Adam
    on CUDA, its attention kernels (model.attention_backend)."""
    import dataclasses

    import torch

    from transformer_mt.common.distributed import DistInfo
    from transformer_mt.network import kernels
    from transformer_mt.training import device_defaults, step
    from transformer_mt.training.loss import Objective

    device = torch.device(args.device)
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=device)
    compiled = {"compile": "on", "compile_mode": args.compile} if args.compile else {}
    train = dataclasses.replace(cfg.train, precision=args.precision, **compiled)
    cfg = dataclasses.replace(cfg, train=train)
    opt = step.Optimization.build(model, cfg, device)  # bf16_weights: the model made bf16
    fused = device_defaults.fused_loss(cfg, device, tok.vocab_size)
    objective = Objective(cfg.optim.label_smoothing, model.output_projection if fused else None)
    trained = device_defaults.compiled(model, cfg, device)  # as tmt train runs it
    graphs = device_defaults.graphs(trained, objective, cfg, device)  # train.cuda_graphs=on

    def run(batch) -> None:
        # Entered at each update: a context entered once here and left to the garbage collector
        # is closed when this function returns, and every earlier GPU figure of this script
        # (and of bench_gpu.py's attention and profile parts) had PyTorch's own kernel order.
        with kernels.attention(cfg.model.attention_backend, device):
            step.train_step(trained, [batch], opt, cfg, info, objective=objective, graphs=graphs)

    return run


def peer_step(model, cfg, tok, args):
    """The textbook update: logits, the label-smoothed loss from them, backward, Adam."""
    import torch

    from transformer_mt.training.loss import label_smoothed_nll

    fused = args.device == "cuda"
    optimizer = torch.optim.Adam(
        model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=fused or None
    )
    # HF's Trainer trains under autocast (--bf16); tmt's bf16_weights is compared with that
    dtype = {"bf16": torch.bfloat16, "bf16_weights": torch.bfloat16, "fp16": torch.float16}.get(
        args.precision
    )

    def run(batch) -> None:
        with torch.autocast(args.device, dtype=dtype, enabled=dtype is not None):
            logits = model(batch.src, batch.tgt_in)
            sums = label_smoothed_nll(logits, batch.tgt_out, tok.pad_id, cfg.optim.label_smoothing)
        (sums.loss / batch.n_tokens).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return run


def matmul_peak() -> float:
    """This card's bf16 matrix-product rate (FLOP/s): an 8192³ product, the best of 3 timings of
    20 after 5 to warm up."""
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(5):
        a @ b
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(20):
            a @ b
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * 8192**3 * 20 / best


def model_flops(cfg, tok, batches, pad_id: int) -> float:
    """Matrix FLOPs of training on the batches' real tokens: 6 × the multiply-adds per token of
    every projection, feed-forward and the output layer, and of attention over each sentence's
    real length (forward 2×, backward 4×)."""
    m = cfg.model
    d, f, vocab = m.d_model, m.d_ff, tok.vocab_size
    macs = 0.0
    for b in batches:
        src_len = (b.src != pad_id).sum(dim=1).double()  # (B,) real tokens a row
        tgt_len = (b.tgt_out != pad_id).sum(dim=1).double()
        s, t = float(src_len.sum()), float(tgt_len.sum())
        enc = s * (4 * d * d + 2 * d * f) + 2 * d * float((src_len**2).sum())
        dec = t * (4 * d * d + 2 * d * d + 2 * d * f) + s * 2 * d * d
        dec += 2 * d * float((tgt_len**2).sum() + (tgt_len * src_len).sum())
        macs += m.n_encoder_layers * enc + m.n_decoder_layers * dec + t * d * vocab
    return 6 * macs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cold-steps", "--steps", type=int, default=20, dest="cold_steps")
    parser.add_argument("--warm-steps", type=int, default=0, help="again over seen shapes")
    parser.add_argument("--warmup", type=int, default=4, help="untimed updates first (CPU)")
    parser.add_argument(
        "--profile-steps", type=int, default=0,
        help="then profile this many warm updates: GPU busy time by kernel kind (CUDA)",
    )  # fmt: skip
    parser.add_argument("--attention", default="auto", help="tmt's model.attention_backend")
    parser.add_argument(
        "--compile", nargs="?", const="default", help="tmt's step torch.compiled in this mode"
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--config", default="multi30k")
    parser.add_argument("--set", action="append", help="config override, e.g. data.max_tokens=8192")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--precision",
        default="fp32",
        choices=("fp32", "bf16", "fp16", "bf16_weights"),
        help="tmt's train.precision (the peer: autocast bf16 for bf16_weights)",
    )
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    from transformer_mt.common.distributed import resolve_device

    resolve_device(args.device, key="--device")  # a GPU where there is none: one line, exit 2
    if args.child:
        print(json.dumps(child(args.child, args)))
        return
    systems = args.systems.split(",")
    runs: dict[str, list[dict]] = {system: [] for system in systems}
    for round_index in range(args.rounds):
        order = systems[round_index % len(systems) :] + systems[: round_index % len(systems)]
        for system in order:
            command = [sys.executable, __file__, "--child", system, *sys.argv[1:]]
            out = subprocess.run(command, capture_output=True, text=True)
            if out.returncode == 2:  # bad input (a config, an override): the child's one line
                sys.stderr.write(out.stderr.strip().splitlines()[-1] + "\n")
                sys.exit(2)
            if out.returncode != 0:
                sys.exit(f"{system} failed:\n{out.stderr[-3000:]}")
            runs[system].append(json.loads(out.stdout.strip().splitlines()[-1]))
            last = runs[system][-1]
            mfu = f"  MFU {last['mfu']:.1%}" if "mfu" in last else ""
            print(
                f"round {round_index + 1} {system:<28} {last['tokens_per_s']:>9,.0f} tok/s{mfu}",
                flush=True,
            )
    results = {}
    for system, measured in runs.items():
        median = sorted(measured, key=lambda r: r["tokens_per_s"])[len(measured) // 2]
        results[system] = {**median, "tokens_per_s_runs": [r["tokens_per_s"] for r in measured]}
    print()
    for system, r in results.items():
        warm = f", warm {r['warm_tokens_per_s']:,.0f}" if r.get("warm_tokens_per_s") else ""
        mfu = f", MFU {r['mfu']:.1%}" if "mfu" in r else ""
        print(
            f"{system:<28} {r['tokens_per_s']:>9,.0f} target tok/s{warm}{mfu}"
            f"  {r['peak_rss_mib']:>7,.0f} MiB peak RSS  {r['parameters']:>11,} params"
            f"  {r['batch_shapes']} shapes"
        )
    ratios = {}
    if "tmt" in results:
        for peer in (s for s in results if s != "tmt"):
            ratios[f"tmt_over_{peer}"] = round(
                results["tmt"]["tokens_per_s"] / results[peer]["tokens_per_s"], 3
            )
            print(f"tmt / {peer}: {ratios[f'tmt_over_{peer}']:.2f}x")
    print(
        json.dumps(
            {
                "config": args.config,
                "overrides": args.set or [],
                "attention": args.attention,
                "device": args.device,
                "precision": args.precision,
                "results": results,
                "ratios": ratios,
            }
        )
    )


if __name__ == "__main__":
    from transformer_mt.common.exits import run_script

    run_script(main)
