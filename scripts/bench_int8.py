"""int8 matrix products at tmt's decoding shapes against tmt's packed float32 (issue 49, part 4).

One linear layer y = x W^T + b at a time, x of M rows (a decoding step's rows: sentences × beam),
for each layer shape of the demo model (d_model 128, d_ff 512, 8,000 pieces) and of an
opus-mt-de-en-shaped model (512, 2,048, 58,101), timed as:

  fp32 packed   tmt's float32 path: oneDNN with the weight packed once (kernels.PackedLinear)
  int8 pt2e     torch's maintained int8 path: torch.export, torchao's PT2E X86InductorQuantizer
                (dynamic: activations quantized per call, weights per channel), convert_pt2e,
                torch.compile (inductor), which lowers the product to oneDNN's qlinear
  int8 torchao  tmt's --precision int8 today: torchao's Int8DynamicActivationInt8WeightConfig
                (eager)

The median of interleaved rounds, each a burst of calls, one thread or two; the ratio is
fp32 packed / the int8 path (> 1: int8 is faster), and the largest relative difference of the
outputs from float32. The issue adopts int8 for a shape only where it is >= 1.3x (and within
0.3 BLEU end to end); this script measures the first condition.

    python scripts/bench_int8.py [--threads 2] [--rounds 15] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
import warnings

import torch
import torch.nn as nn

from transformer_mt.network import kernels

SHAPES = {  # (in_features, out_features) of each linear layer kind
    "demo": {
        "attention": (128, 128),
        "ffn_in": (128, 512),
        "ffn_out": (512, 128),
        "output": (128, 8000),
    },
    "opus-mt": {
        "attention": (512, 512),
        "ffn_in": (512, 2048),
        "ffn_out": (2048, 512),
        "output": (512, 58101),
    },
}
ROWS = (4, 32, 128, 300)  # greedy on a few lines, beam 4 on 8, beam 4 on 32, beam 4 on 75


def timed(fn, x: torch.Tensor, calls: int) -> float:
    """Seconds per call over a burst of `calls`."""
    start = time.perf_counter()
    for _ in range(calls):
        fn(x)
    return (time.perf_counter() - start) / calls


def pt2e_int8(linear: nn.Linear, x: torch.Tensor):
    """The linear layer quantized by torchao's PT2E flow for x86 and compiled by inductor."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
    from torchao.quantization.pt2e.quantizer import x86_inductor_quantizer as xiq

    quantizer = xiq.X86InductorQuantizer()
    quantizer.set_global(xiq.get_default_x86_inductor_quantization_config(is_dynamic=True))
    exported = torch.export.export(linear, (x,)).module()
    prepared = prepare_pt2e(exported, quantizer)
    prepared(x)  # observes (dynamic: the weights' ranges only)
    converted = convert_pt2e(prepared)
    return torch.compile(converted)


def copy_of(linear: nn.Linear) -> nn.Sequential:
    """The layer as a model of its own (kernels' functions change a model's layers in place)."""
    model = nn.Sequential(nn.Linear(linear.in_features, linear.out_features))
    model[0].load_state_dict(linear.state_dict())
    return model


def measure(k: int, n: int, m: int, rounds: int) -> dict:
    torch.manual_seed(0)
    linear = nn.Linear(k, n).eval()
    x = torch.randn(m, k)
    packed = copy_of(linear)
    kernels.pack_linears(packed)
    systems = {"fp32 packed": packed, "int8 torchao": kernels.int8(copy_of(linear))}
    with torch.inference_mode():
        reference = linear(x)
    try:
        with torch.no_grad():
            systems["int8 pt2e"] = pt2e_int8(linear, x)
    except Exception as err:  # record why the path is missing on this machine, keep measuring
        print(f"  pt2e failed at {k}x{n}, {m} rows: {type(err).__name__}: {err}", file=sys.stderr)
    calls = max(3, int(2e8 / (m * k * n)))  # about 0.2 GFLOP-pairs a burst
    seconds = {name: [] for name in systems}
    errors = {}
    with torch.inference_mode():
        for name, fn in systems.items():
            y = fn(x)  # warm up (and compile)
            fn(x)
            errors[name] = float(((y - reference).abs().max() / reference.abs().max()).item())
        for _ in range(rounds):
            for name, fn in systems.items():
                seconds[name].append(timed(fn, x, calls))
    median = {name: statistics.median(s) for name, s in seconds.items()}
    base = median["fp32 packed"]
    return {
        "k": k, "n": n, "rows": m,
        "ms": {name: round(v * 1e3, 4) for name, v in median.items()},
        "speedup_vs_fp32": {name: round(base / v, 3) for name, v in median.items()},
        "max_rel_error": {name: round(e, 5) for name, e in errors.items()},
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logging.disable(logging.WARNING)  # torchao's notes about GPU kernels it cannot load
    warnings.simplefilter("ignore")
    isa = torch.backends.cpu.get_cpu_capability()
    print(f"CPU capability: {isa}, {args.threads} threads, torch {torch.__version__}")
    rows = []
    for model, layers in SHAPES.items():
        for layer, (k, n) in layers.items():
            for m in ROWS:
                row = {"model": model, "layer": layer, **measure(k, n, m, args.rounds)}
                rows.append(row)
                ratio = row["speedup_vs_fp32"]
                fp32 = row["ms"]["fp32 packed"]
                print(f"{model:8} {layer:9} {k:5}x{n:<6} {m:4} rows: fp32 {fp32:.4f} ms"
                      f" | pt2e {ratio.get('int8 pt2e', float('nan')):.2f}x"
                      f" | torchao {ratio['int8 torchao']:.2f}x", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump({"isa": isa, "threads": args.threads, "rows": rows}, out, indent=1)


if __name__ == "__main__":
    from transformer_mt.common.exits import run_script

    run_script(main)
