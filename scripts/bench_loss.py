"""The label-smoothed loss, forward and backward: tmt's chunked loss fused with the output
projection (train.fused_loss, training/loss.py) against the reference loss from the logits, on
the same random states, in one process, alternated; best of --reps each, and their ratio.

    python scripts/bench_loss.py                              # 4,096 rows, d_model 128, 8,000
    python scripts/bench_loss.py --d-model 512 --vocab 37000  # the base model's output layer
    python scripts/bench_loss.py --vocab 250,500,1000,4000,16000
"""

from __future__ import annotations

import argparse
import json
import time


def measure(n_rows: int, d_model: int, vocab: int, reps: int) -> dict:
    """Best of `reps` forward and backward passes of each loss, alternated, and their ratio."""
    import torch

    from transformer_mt.training.loss import chunked_label_smoothed_nll, label_smoothed_nll

    torch.manual_seed(0)
    hidden = torch.randn(n_rows, d_model, requires_grad=True)
    projection = torch.nn.Linear(d_model, vocab, bias=False)
    target = torch.randint(1, vocab, (n_rows,))
    target[::7] = 0  # padding

    def fused() -> None:
        chunked_label_smoothed_nll(hidden, projection, target, 0, 0.1).loss.backward()

    def reference() -> None:
        label_smoothed_nll(projection(hidden), target, 0, 0.1).loss.backward()

    best = {"fused": float("inf"), "reference": float("inf")}
    for name, run in (("fused", fused), ("reference", reference)) * 2:  # alternated
        run()  # warm
        for _ in range(reps):
            start = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - start)
    row = {"rows": n_rows, "d_model": d_model, "vocab": vocab,
           "fused_ms": round(1e3 * best["fused"], 2),
           "reference_ms": round(1e3 * best["reference"], 2),
           "reference_over_fused": round(best["reference"] / best["fused"], 3)}  # fmt: skip
    print(f"{n_rows} x {d_model} x {vocab}: fused {row['fused_ms']} ms, reference"
          f" {row['reference_ms']} ms: the fused loss {row['reference_over_fused']}x",
          flush=True)  # fmt: skip
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096, help="target tokens (one in 7 padding)")
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--vocab", default="8000", help="comma-separated vocabulary sizes")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    args = parser.parse_args()
    try:
        vocabs = [int(v) for v in args.vocab.split(",")]
    except ValueError:
        parser.error(f"--vocab {args.vocab}: expected comma-separated integers")
    sizes = {"--rows": args.rows, "--d-model": args.d_model, "--reps": args.reps}
    for flag, value in [*sizes.items(), *(("--vocab", v) for v in vocabs)]:
        if value < 1:
            parser.error(f"{flag} {value}: expected a positive integer")

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [measure(args.rows, args.d_model, v, args.reps) for v in vocabs]
    print(json.dumps({"threads": torch.get_num_threads(), "rows": rows}))


if __name__ == "__main__":
    from transformer_mt.common.exits import run_script

    run_script(main)
