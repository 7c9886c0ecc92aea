"""How many source tokens a decoding batch holds: decode.max_tokens, or, where it is 0, what suits
the device: 4,096 on a CPU (scripts/bench_decode.py); on CUDA what half its free memory holds
for the model, beam and vocabulary at hand, within GPU_BATCH_TOKENS (the CPU's default ran a GPU
at a third of what 16,384 tokens did: docs/benchmarks.md).
"""

from __future__ import annotations

from typing import Any

import torch

from transformer_mt.common import distributed
from transformer_mt.config import Config

CPU_BATCH_TOKENS = 4096  # decode.max_tokens 0 on a CPU (scripts/bench_decode.py)
GPU_BATCH_TOKENS = (4096, 32768)


def batch_tokens(translator: Any) -> int:
    """Source tokens a decoding batch holds: decode.max_tokens, or for 0 the device's: 4,096 on
    a CPU; on CUDA, what half of its free memory holds (gpu_batch_tokens)."""
    decode = translator.config.decode
    if decode.max_tokens:
        return decode.max_tokens
    device = torch.device(translator.device)
    if device.type != "cuda":
        return CPU_BATCH_TOKENS
    vocab = translator.tokenizer.vocab_size
    return gpu_batch_tokens(distributed.free_memory(device) // 2, translator.config, vocab)


def gpu_batch_tokens(room: int, cfg: Config, vocab_size: int) -> int:
    """Source tokens whose beam search fits in `room` bytes. Per source token, for each of its k
    rows (beam or n-best): the self-attention cache of every decoder layer (K and V, d_model
    each, up to max_len_a + max_len_b / 16 target positions a source token, for sentences of 16
    tokens and more; twice that, the cache grows by doubling) and one step's scores over the
    vocabulary (float32, log-softmax and top-k scratch: 4 copies, a row per 16 source tokens)."""
    decode, model = cfg.decode, cfg.model
    k = decode.nbest if decode.sampling != "none" else max(decode.beam_size, decode.nbest)
    element = 4 if decode.precision == "fp32" else 2
    positions = decode.max_len_a + decode.max_len_b / 16
    cache = model.n_decoder_layers * 2 * model.d_model * element * 2 * positions
    scores = vocab_size * 4 * 4 / 16
    per_token = k * (cache + scores) + 8 * model.d_model * element  # + the encoder's states
    low, high = GPU_BATCH_TOKENS
    return int(min(max(room // per_token, low), high))
