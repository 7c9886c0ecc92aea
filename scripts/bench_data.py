"""Benchmark the data pipeline: load -> filter -> tokenize -> batch, cold and warm cache.

Corpora: the bundled Multi30k de→en (29k pairs) and a synthetic 1,000,000-pair corpus (Multi30k
train repeated). Each case runs in a fresh process so its peak RSS is its own. The peer is the
in-memory pipeline of the tutorials (annotated-transformer, pytorch-seq2seq): every line read
into Python lists, encoded with the same sentencepiece model, sorted and packed the same way.

    python scripts/bench_data.py            # both corpora
    python scripts/bench_data.py --quick    # Multi30k only

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import gzip
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MAX_TOKENS = 4096
SYNTHETIC_PAIRS = 1_000_000


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def child_tmt(corpus: str, cache: str) -> dict:
    """One tmt run of the pipeline in this process (imports excluded from the timing)."""
    from transformer_mt.config import load_config
    from transformer_mt.data.batches import prepare_data
    from transformer_mt.data.sampler import padding_efficiency

    overrides = [f"data.cache_dir={cache}", f"data.max_tokens={MAX_TOKENS}"]
    if corpus != "multi30k":
        overrides += ["data.source=files", f"data.train={corpus}/train", f"data.valid={corpus}/val"]
    start = time.perf_counter()
    cfg = load_config("multi30k", overrides)
    data = prepare_data(cfg)
    sampler = data.train.sampler(cfg.data.max_tokens, cfg.train.seed)
    batches = sampler.epoch_batches(0)
    efficiency = padding_efficiency(batches, sampler.src_lengths, sampler.tgt_lengths)
    seconds = time.perf_counter() - start
    return {
        "pairs": data.counts["data.train"].read,
        "kept": len(data.train),
        "batches": len(batches),
        "padding_efficiency": round(efficiency, 4),
        "seconds": round(seconds, 3),
        "pairs_per_s": round(data.counts["data.train"].read / seconds),
        "peak_rss_mib": round(peak_rss_bytes() / 2**20, 1),
        "tokenizer": str(next(Path(cache, "tokenizers").glob("*.model"))),
    }


def child_in_memory(corpus: str, tokenizer_path: str) -> dict:
    """The peer: Python lists of every line and every id sequence, same tokenizer and packing."""
    import numpy as np
    import sentencepiece as spm

    from transformer_mt.data.sampler import TokenBucketSampler, padding_efficiency

    start = time.perf_counter()
    if corpus == "multi30k":
        from transformer_mt.data.corpus import BUNDLED_DIR

        paths = [BUNDLED_DIR / "train.de.gz", BUNDLED_DIR / "train.en.gz"]
    else:
        paths = [Path(corpus, "train.de"), Path(corpus, "train.en")]
    src_lines, tgt_lines = (read_text_lines(path) for path in paths)
    sp = spm.SentencePieceProcessor(model_file=tokenizer_path)
    src_ids, tgt_ids = sp.encode(src_lines), sp.encode(tgt_lines)
    pairs = enumerate(zip(src_ids, tgt_ids, strict=True))
    keep = [i for i, (s, t) in pairs if s and t and len(s) <= 128 and len(t) <= 128]
    src_len = np.array([len(src_ids[i]) + 1 for i in keep])
    tgt_len = np.array([len(tgt_ids[i]) + 1 for i in keep])
    sampler = TokenBucketSampler(src_len, tgt_len, MAX_TOKENS, seed=1)
    batches = sampler.epoch_batches(0)
    efficiency = padding_efficiency(batches, src_len, tgt_len)
    seconds = time.perf_counter() - start
    return {
        "pairs": len(src_lines),
        "batches": len(batches),
        "padding_efficiency": round(efficiency, 4),
        "seconds": round(seconds, 3),
        "pairs_per_s": round(len(src_lines) / seconds),
        "peak_rss_mib": round(peak_rss_bytes() / 2**20, 1),
    }


def read_text_lines(path: Path) -> list[str]:
    if path.suffix == ".gz":
        with gzip.open(path, "rt", encoding="utf-8") as handle:
            return [line.rstrip("\n") for line in handle]
    with open(path, encoding="utf-8") as handle:
        return [line.rstrip("\n") for line in handle]


def print_report(name: str, result: dict) -> None:
    print(f"\n{name}: {result['cold']['pairs']:,} pairs, max_tokens {MAX_TOKENS}")
    print(f"  {'case':<16}{'seconds':>10}{'pairs/s':>12}{'peak RSS MiB':>14}{'padding':>10}")
    for case in ("cold", "warm", "in_memory_peer"):
        r = result[case]
        print(
            f"  {case:<16}{r['seconds']:>10.2f}{r['pairs_per_s']:>12,}"
            f"{r['peak_rss_mib']:>14.0f}{r['padding_efficiency']:>10.4f}"
        )
    print(
        f"  warm/cold time {result['warm_over_cold']:.3f};"
        f" peer RSS / tmt warm RSS {result['peer_rss_over_tmt_warm']:.2f}x;"
        f" tmt warm is {result['tmt_warm_speedup_over_peer']:.1f}x faster than the peer"
    )


def run_child(*args: str) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", *args], capture_output=True, text=True
    )
    if out.returncode != 0:
        sys.exit(f"benchmark case {args} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def write_synthetic(root: Path, pairs: int) -> None:
    """Multi30k train repeated to `pairs` lines per side (plain text), plus Multi30k val."""
    from transformer_mt.data.corpus import BUNDLED_DIR

    for lang in ("de", "en"):
        lines = gzip.decompress((BUNDLED_DIR / f"train.{lang}.gz").read_bytes()).splitlines(
            keepends=True
        )
        with open(root / f"train.{lang}", "wb") as out:
            for i in range(pairs):
                out.write(lines[i % len(lines)])
        (root / f"val.{lang}").write_bytes(
            gzip.decompress((BUNDLED_DIR / f"val.{lang}.gz").read_bytes())
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="Multi30k only")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, *rest = args.child
        result = child_tmt(*rest) if kind == "tmt" else child_in_memory(*rest)
        print(json.dumps(result))
        return

    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="tmt-bench-data-") as tmp:
        corpora = {"multi30k": "multi30k"}
        if not args.quick:
            synthetic = Path(tmp, "synthetic")
            synthetic.mkdir()
            write_synthetic(synthetic, SYNTHETIC_PAIRS)
            corpora["synthetic_1m"] = str(synthetic)
        for name, corpus in corpora.items():
            cache = str(Path(tmp, f"cache-{name}"))
            cold = run_child("tmt", corpus, cache)
            warm = run_child("tmt", corpus, cache)
            peer = run_child("in_memory", corpus, cold.pop("tokenizer"))
            warm.pop("tokenizer")
            results[name] = {
                "cold": cold,
                "warm": warm,
                "in_memory_peer": peer,
                "warm_over_cold": round(warm["seconds"] / cold["seconds"], 4),
                "peer_rss_over_tmt_warm": round(peer["peak_rss_mib"] / warm["peak_rss_mib"], 2),
                "tmt_warm_speedup_over_peer": round(peer["seconds"] / warm["seconds"], 2),
            }
            print_report(name, results[name])
    print(json.dumps(results))


if __name__ == "__main__":
    from transformer_mt.common.exits import run_script

    run_script(main)
