"""Label-smoothed cross entropy (§5.4, Szegedy et al. 2016) over the non-pad target tokens."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class LossSums(NamedTuple):
    """Sums over the non-pad target tokens of a batch; divide by a token count to normalise."""

    loss: torch.Tensor  # label-smoothed cross entropy (what is optimised)
    nll: torch.Tensor  # plain negative log-likelihood (what perplexity is made of)
    n_tokens: torch.Tensor


def label_smoothed_nll(
    logits: torch.Tensor, target: torch.Tensor, pad_id: int, epsilon: float
) -> LossSums:
    """logits (B, T, V) and target (B, T), or logits (N, V) and target (N,).

    The smoothed target puts 1 - ε on the reference and ε/V on every class (the uniform prior
    u(k) = 1/V of Szegedy et al.), so loss = (1 - ε)·nll + ε·mean_k(-log p_k), which is
    F.cross_entropy(label_smoothing=ε). Log-probabilities are computed once, in float32.
    """
    log_probs = F.log_softmax(logits.float(), dim=-1).reshape(-1, logits.size(-1))  # (B·T, V)
    target = target.flatten()
    real = target != pad_id
    nll = F.nll_loss(log_probs, target, ignore_index=pad_id, reduction="sum")
    uniform = -(log_probs.mean(dim=-1) * real).sum()
    return LossSums((1.0 - epsilon) * nll + epsilon * uniform, nll.detach(), real.sum())
