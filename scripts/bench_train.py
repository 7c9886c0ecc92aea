"""Training throughput: tmt vs HF transformers MarianMTModel vs a torch.nn.Transformer loop.

All three train the same architecture (the multi30k preset: 4+4 layers, d_model 256, 4 heads,
d_ff 1024, dropout 0.3, tied 8k joint vocabulary) on the same batches of the bundled Multi30k
de→en corpus (max_tokens 4096), in fp32, with the same label-smoothed loss and Adam. Each run is a
fresh process (its own peak RSS); systems are interleaved over --rounds and the median is kept,
because this VM's timings drift by ±20 %.

tmt runs as `tmt` runs: its CLI makes glibc keep freed memory before torch is imported
(allocator.keep_freed_memory). The peers run as shipped, and again with that same allocator setting
("+alloc"), so the report separates what the allocator gives from what the model code gives.
Needs the bench extra: pip install -e ".[bench]".

    python scripts/bench_train.py [--steps 20] [--warmup 4] [--rounds 2] [--config multi30k]

The last line printed is one JSON object with every figure. On a CUDA machine:
`--device cuda --precision bf16 --config base --systems tmt` gives tokens/s and MFU there.
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
    from transformer_mt.config import load_config
    from transformer_mt.data.batches import prepare_data

    cfg = load_config(config, overrides)
    data = prepare_data(cfg)
    batches = data.train.sampler(cfg.data.max_tokens, cfg.train.seed).epoch_batches(0)[:n]
    return cfg, data.tokenizer, [data.train.batch(b, data.tokenizer).to(device) for b in batches]


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
    from transformer_mt.training.loss import label_smoothed_nll

    torch.manual_seed(0)
    cfg, tok, batches = load_batches(
        args.config, args.set or [], args.warmup + args.steps, args.device
    )
    builders = {
        "tmt": build_tmt,
        "hf_marian": build_hf_marian,
        "torch_nn_transformer": build_torch_nn_transformer,
    }
    model = builders[system.removesuffix("+alloc")](cfg, tok)
    model = model.to(args.device).train()
    fused = args.device == "cuda"
    optimizer = torch.optim.Adam(
        model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=fused or None
    )
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.precision)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)

    def step(batch) -> None:
        with torch.autocast(args.device, dtype=dtype, enabled=dtype is not None):
            logits = model(batch.src, batch.tgt_in)
            sums = label_smoothed_nll(logits, batch.tgt_out, tok.pad_id, cfg.optim.label_smoothing)
        (sums.loss / sums.n_tokens).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for batch in batches[: args.warmup]:
        step(batch)
    sync()
    start = time.perf_counter()
    for batch in batches[args.warmup :]:
        step(batch)
    sync()
    seconds = time.perf_counter() - start
    timed = batches[args.warmup :]
    tokens = sum(b.n_tokens for b in timed)
    result = {
        "system": system,
        "parameters": count_parameters(model),
        "steps": len(timed),
        "target_tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "threads": torch.get_num_threads(),
    }
    if args.device == "cuda":
        result |= _mfu(cfg, tok, timed, seconds)
    return result


def _mfu(cfg, tok, batches, seconds: float) -> dict:
    """Model FLOPs utilisation: 6 · matmul FLOPs per token · tokens over peak bf16 FLOP/s."""
    import torch

    m = cfg.model
    d, f = m.d_model, m.d_ff
    flops = 0.0
    for b in batches:
        s, t, n = b.src.numel(), b.tgt_in.numel(), b.src.size(0)
        src_len, tgt_len = b.src.size(1), b.tgt_in.size(1)
        enc = m.n_encoder_layers * (s * (4 * d * d + 2 * d * f) + n * 2 * src_len * src_len * d)
        dec = m.n_decoder_layers * (
            t * (4 * d * d + 2 * d * d + 2 * d * f)
            + s * 2 * d * d
            + n * 2 * (tgt_len * tgt_len + tgt_len * src_len) * d
        )
        flops += 6 * (enc + dec + t * d * tok.vocab_size)  # forward 2·, backward 4·
    name = torch.cuda.get_device_name()
    peak = 989e12 if "H100" in name or "H200" in name else float("nan")  # dense bf16 tensor cores
    return {
        "gpu": name,
        "model_tflops": round(flops / seconds / 1e12, 1),
        "mfu": round(flops / seconds / peak, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--config", default="multi30k")
    parser.add_argument("--set", action="append", help="config override, e.g. data.max_tokens=8192")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
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
            if out.returncode != 0:
                sys.exit(f"{system} failed:\n{out.stderr[-3000:]}")
            runs[system].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(
                f"round {round_index + 1} {system:<28}"
                f" {runs[system][-1]['tokens_per_s']:>9,.0f} tok/s",
                flush=True,
            )
    results = {}
    for system, measured in runs.items():
        median = sorted(measured, key=lambda r: r["tokens_per_s"])[len(measured) // 2]
        results[system] = {**median, "tokens_per_s_runs": [r["tokens_per_s"] for r in measured]}
    print()
    for system, r in results.items():
        print(
            f"{system:<28} {r['tokens_per_s']:>9,.0f} target tok/s"
            f"  {r['peak_rss_mib']:>7,.0f} MiB peak RSS  {r['parameters']:>11,} params"
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
                "device": args.device,
                "precision": args.precision,
                "results": results,
                "ratios": ratios,
            }
        )
    )


if __name__ == "__main__":
    main()
