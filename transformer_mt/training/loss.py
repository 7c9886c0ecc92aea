"""Label-smoothed cross entropy (§5.4, Szegedy et al. 2016) over the non-pad target tokens.

Two ways to the same sums: `label_smoothed_nll` from the model's logits (the reference, and the
CPU's), and `chunked_label_smoothed_nll` from the decoder's last states and the output projection,
chunk of rows by chunk of rows, its gradients made in the forward pass (train.fused_loss). At the
paper's 25,000 tokens and a 37,000-piece vocabulary the logits are 0.9 billion numbers (3.7 GB in
float32, and autograd keeps them and their log-softmax for the backward pass); the chunked loss
keeps one chunk's at a time (Liger-Kernel's and torchtune's fused linear cross entropy do the
same).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn


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
    F.cross_entropy(label_smoothing=ε). Log-probabilities are computed once, in float32 (or in
    float64 for float64 logits: the tests' exact reference).
    """
    exact = torch.promote_types(logits.dtype, torch.float32)
    log_probs = F.log_softmax(logits.to(exact), dim=-1).reshape(-1, logits.size(-1))  # (B·T, V)
    target = target.flatten()
    real = target != pad_id
    nll = F.nll_loss(log_probs, target, ignore_index=pad_id, reduction="sum")
    uniform = -(log_probs.mean(dim=-1) * real).sum()
    return LossSums((1.0 - epsilon) * nll + epsilon * uniform, nll.detach(), real.sum())


CHUNK_SCORES = 1 << 26  # scores (rows × vocabulary) a chunk computes at once: 256 MB in float32


def chunked_label_smoothed_nll(
    hidden: torch.Tensor,
    projection: nn.Linear,
    target: torch.Tensor,
    pad_id: int,
    epsilon: float,
    chunk_rows: int = 0,
) -> LossSums:
    """label_smoothed_nll of the logits `projection(hidden)`, hidden (B, T, D) or (N, D), without
    keeping them: `chunk_rows` rows at a time (0: CHUNK_SCORES / V), in float32 from the
    projection's output in whatever precision autocast runs it."""
    hidden = hidden.reshape(-1, hidden.size(-1))  # (N, D)
    target = target.flatten()
    rows = chunk_rows or max(1, CHUNK_SCORES // projection.weight.size(0))
    loss, nll = _ChunkedLoss.apply(
        hidden, projection.weight, projection.bias, target, pad_id, epsilon, rows
    )
    return LossSums(loss, nll, (target != pad_id).sum())


class _ChunkedLoss(torch.autograd.Function):
    """Forward: for each chunk of rows, the logits z = h Wᵀ + b (float32), the loss and, since
    the loss ends the graph, its gradient dloss/dz = softmax(z) - ((1 - ε)·onehot + ε/V) on real
    rows (0 on padding), turned at once into the gradients of h, W and b. Backward: those,
    scaled by the incoming gradient of the loss (a number). The NLL is not differentiated."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,  # (N, D)
        weight: torch.Tensor,  # (V, D)
        bias: torch.Tensor | None,  # (V,)
        target: torch.Tensor,  # (N,)
        pad_id: int,
        epsilon: float,
        rows: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        vocab, device = weight.size(0), hidden.device.type
        # The product in autocast's precision where it is on (bf16: what F.linear would run),
        # else the inputs'; scores, sums and the weights' gradients in float32 or better.
        on = torch.is_autocast_enabled(device)
        compute = torch.get_autocast_dtype(device) if on else hidden.dtype
        exact = torch.promote_types(compute, torch.float32)
        w = weight.to(compute)  # once, not once a chunk
        b = bias.to(compute) if bias is not None else None
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=exact, device=weight.device)
        grad_bias = torch.zeros(vocab, dtype=exact, device=weight.device) if b is not None else None
        loss = torch.zeros((), dtype=exact, device=hidden.device)
        nll = loss.clone()
        with torch.autocast(device, enabled=False):
            for start in range(0, hidden.size(0), rows):
                h = hidden[start : start + rows].to(compute)  # (n, D)
                y = target[start : start + rows]  # (n,)
                z = F.linear(h, w, b).to(exact)  # (n, V)
                real = (y != pad_id).to(exact)  # (n,)
                index = y.clamp(0, vocab - 1)[:, None]  # a padding row's id: masked anyway
                log_z = torch.logsumexp(z, dim=-1)  # (n,)
                nll_rows = (log_z - z.gather(1, index)[:, 0]) * real
                uniform_rows = (log_z - z.mean(dim=-1)) * real  # -mean_k log p_k
                loss += ((1.0 - epsilon) * nll_rows + epsilon * uniform_rows).sum()
                nll += nll_rows.sum()
                # dloss/dz in place of z: softmax(z) - the smoothed target; 0 on padding rows.
                grad_z = z.sub_(log_z[:, None]).exp_().sub_(epsilon / vocab)
                grad_z.scatter_add_(1, index, -(1.0 - epsilon) * real[:, None])
                grad_z.mul_(real[:, None])
                g = grad_z.to(compute)
                grad_hidden[start : start + rows] = (g @ w).to(hidden.dtype)  # (n, D)
                grad_weight += (g.T @ h).to(exact)  # (V, D)
                if grad_bias is not None:
                    grad_bias += grad_z.sum(dim=0)
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(nll)
        return loss, nll

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor, _grad_nll: torch.Tensor) -> tuple:
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        weight = (grad_weight * grad_loss).to(ctx.weight_dtype)
        bias = (grad_bias * grad_loss).to(ctx.weight_dtype) if grad_bias is not None else None
        hidden = grad_hidden * grad_loss.to(grad_hidden.dtype)
        return hidden, weight, bias, None, None, None, None


@dataclass(frozen=True)
class Objective:
    """What a training step minimises: the label-smoothed loss of a batch, from the model's
    logits (the reference), or fused (`projection` given: the model's output projection) from
    the decoder's last states, which the step then asks the model for instead of logits."""

    epsilon: float  # optim.label_smoothing
    projection: nn.Linear | None = None

    @property
    def wants_logits(self) -> bool:
        return self.projection is None

    def __call__(self, out: torch.Tensor, target: torch.Tensor, pad_id: int) -> LossSums:
        """out: logits (B, T, V), or the last states (B, T, D) when fused."""
        if self.projection is None:
            return label_smoothed_nll(out, target, pad_id, self.epsilon)
        return chunked_label_smoothed_nll(out, self.projection, target, pad_id, self.epsilon)
