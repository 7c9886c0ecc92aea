"""What a way of decoding refuses, in one line naming the option: an engine asked for what it
cannot do as tmt promises it (check_engine), and an option given that the decoding asked for would
not read (check_options).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from transformer_mt.common.exits import TmtError
from transformer_mt.config import Config


def check_engine(cfg: Config, device: torch.device) -> None:
    """Refuse, naming the option, what an engine cannot do as tmt promises it."""
    decode, engine = cfg.decode, cfg.decode.engine
    if decode.precision == "fp16" and device.type != "cuda":
        raise TmtError("decode.precision=fp16 needs a GPU (decode.device); use bf16 or fp32")
    if engine == "torch" and decode.precision == "int8" and device.type != "cpu":
        raise TmtError(
            f"decode.precision=int8: the torch engine quantizes on CPU only (decode.device is"
            f" {device}); use fp16 or bf16 there, or decode.engine=ctranslate2"
        )
    if engine == "ctranslate2" and decode.alignment != "none":
        raise TmtError(
            f"decode.alignment={decode.alignment}: not with decode.engine=ctranslate2 (tmt aligns"
            " with the PyTorch model's cross-attention); use decode.engine=torch"
        )
    if engine == "ctranslate2" and decode.sampling != "none":
        raise TmtError(
            f"decode.sampling={decode.sampling}: not with decode.engine=ctranslate2 (its random"
            " streams depend on the batch, tmt's on the line alone); use decode.engine=torch"
        )


# Options that one way of decoding reads and another ignores: given for the other, refused.
_SAMPLING_ONLY = ("decode.temperature", "decode.seed")
_SEARCH_ONLY = ("decode.beam_size", "decode.length_penalty", "decode.length_penalty_form",
                "decode.early_stopping")  # fmt: skip
_TMT_SEARCH_ONLY = ("decode.length_penalty_form", "decode.early_stopping")


def check_options(cfg: Config, overrides: Sequence[str | tuple[str, str]]) -> None:
    """Refuse an option this command or request gave that its decoding would not read (each
    override is "key=value" or (that, the user's words)): --temperature without --sampling,
    --beam while sampling, tmt's stopping rule for CTranslate2's search."""
    decode = cfg.decode
    for item in overrides:
        text, typed = item if isinstance(item, tuple) else (item, f"--set {item}")
        key = text.partition("=")[0].strip()
        if key in _SAMPLING_ONLY and decode.sampling == "none":
            raise TmtError(f"{typed}: applies to sampling only; add decode.sampling (--sampling"
                           " full, topk:K or topp:P)")  # fmt: skip
        if key in _SEARCH_ONLY and decode.sampling != "none":
            raise TmtError(f"{typed}: not used while sampling (decode.sampling="
                           f"{decode.sampling}): nbest N draws N samples")  # fmt: skip
        if key in _TMT_SEARCH_ONLY and decode.engine == "ctranslate2":
            raise TmtError(f"{typed}: tmt's search only; CTranslate2's beam search has its own"
                           " (decode.engine=torch)")  # fmt: skip
