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

import logging
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)


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
    scaled by the incoming gradient of the loss (a number). The NLL is not differentiated.

    The chunk's scores are read and written as few times as the sums allow (on a CPU at
    Multi30k's sizes the passes over chunk × vocabulary took 40 % of its time, the products the
    rest): the product, its largest score, its softmax, its largest probability. What is the
    same for every token is applied to the small tensors instead of the scores: mean_k z_k is
    h·mean_k(W_k) + mean(b); the ε/V every score's gradient loses is ε/V·Σ_k W_k from each row
    of h's gradient and ε/V·Σ_i h_i from every row of W's, once; padding rows are left out by
    zeroing their states (W's gradient), their weights in b's (a product with the real rows)
    and their rows of h's gradient."""

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
        w_exact = w.to(exact)
        mean_w = w_exact.mean(dim=0)  # (D,): mean_k z_k = h · mean_w + mean(b)
        mean_b = b.to(exact).mean() if b is not None else 0.0
        smoothing = (epsilon / vocab) * w_exact.sum(dim=0)  # (D,): ε/V·Σ_k W_k
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=exact, device=weight.device)
        grad_bias = torch.zeros(vocab, dtype=exact, device=weight.device) if b is not None else None
        real_states = torch.zeros(hidden.size(1), dtype=exact, device=hidden.device)  # Σ_i h_i
        loss = torch.zeros((), dtype=exact, device=hidden.device)
        nll = loss.clone()
        n_real = loss.clone()
        with torch.autocast(device, enabled=False):
            for start in range(0, hidden.size(0), rows):
                chunk = slice(start, start + rows)
                real = (target[chunk] != pad_id).to(exact)[:, None]  # (n, 1)
                h = (hidden[chunk] * real.to(hidden.dtype)).to(compute)  # (n, D); padding 0
                h_exact = h.to(exact)
                mean_z = h_exact @ mean_w[:, None] + mean_b  # (n, 1): mean_k z_k
                sums, grad_z = _chunk_loss(h, w, b, target[chunk], real, mean_z, epsilon)
                loss += sums[0]
                nll += sums[1]
                n_real += real.sum()
                g = grad_z.to(compute)
                grad_rows = _product(g, w, exact) - smoothing  # (n, D)
                grad_hidden[chunk] = (grad_rows * real).to(hidden.dtype)
                grad_weight += _product(g.T, h, exact)  # (V, D); padding rows' h are 0
                real_states += h_exact.sum(dim=0)
                if grad_bias is not None:
                    grad_bias += (real.T @ grad_z)[0]  # (V,)
            grad_weight -= (epsilon / vocab) * real_states
            if grad_bias is not None:
                grad_bias -= (epsilon / vocab) * n_real
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


def _chunk_loss(
    h: torch.Tensor,  # (n, D), padding rows 0, in the product's precision
    w: torch.Tensor,  # (V, D)
    b: torch.Tensor | None,  # (V,)
    y: torch.Tensor,  # (n,)
    real: torch.Tensor,  # (n, 1): 1.0 on real rows, 0.0 on padding, in the sums' precision
    mean_z: torch.Tensor,  # (n, 1): mean_k z_k, from the mean of W's rows (and of b)
    epsilon: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's (loss, nll) sums and dloss/dz but its ε/V: softmax(z) less (1 - ε) at the
    reference, on real rows (padding rows: their softmax, left out by the caller). Scores and
    sums in `real`'s precision."""
    vocab = w.size(0)
    z = _float32_product(h, w.T) if _writes_float32(h, real.dtype) else None  # (n, V)
    if z is None:  # the bias inside the product, as the CPU's golden losses were made
        z = F.linear(h, w, b).to(real.dtype)
    elif b is not None:
        z.add_(b)
    index = y.clamp(0, vocab - 1)[:, None]  # a padding row's id: masked anyway
    top = z.amax(dim=-1, keepdim=True)  # (n, 1): its largest score
    grad_z = torch.softmax(z, dim=-1)
    # log Σ_k exp z_k from the largest probability, exp(top - log_z): at least 1/V, so its log
    # is exact, where torch.logsumexp would read z three more times (its max, z less it, exp)
    # and write a copy of it.
    log_z = top - grad_z.amax(dim=-1, keepdim=True).log()  # (n, 1)
    nll_rows = (log_z - z.gather(1, index)) * real
    uniform_rows = (log_z - mean_z) * real  # -mean_k log p_k
    loss = ((1.0 - epsilon) * nll_rows + epsilon * uniform_rows).sum()
    grad_z.scatter_add_(1, index, -(1.0 - epsilon) * real)
    return torch.stack([loss, nll_rows.sum()]), grad_z


def _writes_float32(a: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a product of bf16 or fp16 factors like `a` is written in float32 by cuBLAS
    itself (torch.mm's out_dtype, CUDA only), where a low-precision product would be written and
    then converted: that conversion of the scores was 5.0 of the 53 ms an update of the base
    model took on an H200 (docs/benchmarks.md, the fourth run), the largest kernel of its
    profile. A CPU has no such product."""
    return (a.dtype != dtype and dtype == torch.float32 and a.is_cuda and bool(torch.version.cuda)
            and _FLOAT32_PRODUCTS["work"])  # fmt: skip


# Whether torch.mm's out_dtype has worked in this process: a torch or card that refuses it is
# asked once (a step's first micro-batch is eager, before any CUDA graph records one), then the
# loss converts as before.
_FLOAT32_PRODUCTS = {"work": True}


def _float32_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """a @ b written in float32 by the product itself; None (and never again asked) where this
    torch or device refuses it."""
    try:
        return torch.mm(a, b, out_dtype=torch.float32)
    except (RuntimeError, TypeError, NotImplementedError) as err:
        _FLOAT32_PRODUCTS["work"] = False
        logger.warning("the fused loss converts its scores to float32 (torch.mm's out_dtype:"
                       " %s)", str(err).splitlines()[0][:200])  # fmt: skip
        return None


def _product(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """a @ b in `dtype` (float32 written by the product where _writes_float32)."""
    out = _float32_product(a, b) if _writes_float32(a, dtype) else None
    return out if out is not None else (a @ b).to(dtype)


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
