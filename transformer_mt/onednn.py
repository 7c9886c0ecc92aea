"""Decoding's linear layers on a CPU through oneDNN, their weights packed once.

PyTorch computes a float32 linear layer on x86 with MKL's sgemm, which on AMD CPUs does not
use AVX-512 (MKL picks its kernels by vendor); oneDNN, also inside every PyTorch wheel, does.
On the AVX-512 machine of docs/benchmarks.md the decoder's products run 1.5-2.5x faster
through it, and beam search as a whole 1.4x (scripts/bench_decode.py). The products are the
same ones: bit for bit for 128-wide inputs there, wider ones summed in another order (a median
relative difference of 3e-7 at 512). On the demo model's 1,000 test sentences every output was
the same. decode.cpu_linear=torch keeps torch's own kernels.

Only for decoding: a packed layer has no gradient, so with autograd on it computes as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class PackedLinear(nn.Linear):
    """An nn.Linear (the same parameters and state dict) that multiplies by a copy of its
    weight in oneDNN's layout, made by pack_linears. The copy is not updated if the weight
    changes: pack a model once its weights are final."""

    packed: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def available() -> bool:
    """Whether this PyTorch has oneDNN's packed linear product for float32 on the CPU, and it
    agrees with F.linear on a probe."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        weight, x = torch.randn(24, 40), torch.randn(3, 40)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        with torch.inference_mode():
            y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except (AttributeError, RuntimeError):  # an op missing or refused in this build
        return False
    return torch.allclose(y, F.linear(x, weight), rtol=1e-5, atol=1e-5)


def pack_linears(model: nn.Module) -> bool:
    """Make every float32 CPU nn.Linear of `model` a PackedLinear, in place; False (and the model
    untouched) where oneDNN cannot (see available)."""
    on_cpu = [m for m in model.modules() if type(m) is nn.Linear and m.weight.device.type == "cpu"]
    linears = [m for m in on_cpu if m.weight.dtype == torch.float32]
    if not linears or not available():
        return False
    for module in linears:
        # A plain attribute, not a buffer: state_dict (and the weights' fingerprint) unchanged.
        module.packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), None)
        module.__class__ = PackedLinear
    return True
