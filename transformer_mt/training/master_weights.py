"""train.precision=bf16_weights: the model in bf16, Adam's weights in float32.

Under autocast (train.precision=bf16) the weights stay float32: every product casts its inputs
to bf16, and layer norm, the residual stream and the elementwise kernels around them run in
float32. On an H200 a warm update of the base model spent ~10 of its 53 ms on copies and ~10 on
layer norm and reductions (docs/benchmarks.md). Here the model's weights, and so its activations
and gradients, are bf16 throughout, and a float32 master copy of each weight is what Adam
updates (fairseq's --bf16, Marian's --precision float16 float32): bf16's 8 bits of mantissa
would round away most of an update of ~1e-4 of a weight. After each applied update the masters
are rounded into the model's weights.

The masters are the run's weights: checkpoints hold them (float32, as with every other
precision), a resume reads them back bit for bit, and the bf16 model is made from them again.
"""

from __future__ import annotations

import torch


class MasterWeights:
    """Float32 copies of `model`'s parameters (Adam's), made from its float32 weights; the model
    itself then turned bf16, buffers included."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.model_params = list(model.parameters())  # the model's order, each tied one once
        if any(p.dtype != torch.float32 for p in self.model_params):
            raise ValueError("master weights are made from a float32 model")
        self.params = [
            torch.nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
            for p in self.model_params
        ]
        model.to(torch.bfloat16)  # in place: the same Parameter objects, now bf16

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict with each parameter's float32 master in its place (tied
        weights under each of their names, as the model's own): what a checkpoint holds."""
        master_of = {id(p): m for p, m in zip(self.model_params, self.params, strict=True)}
        return {
            name: master_of[id(value)].detach() if id(value) in master_of else value.detach()
            for name, value in self.model.state_dict(keep_vars=True).items()
        }

    @torch.no_grad()
    def gather_grads(self) -> None:
        """Each master's gradient: the model's bf16 one in float32 (kept in the master's own
        buffer once made); None where the model's is None, which Adam then skips, as it would
        the model's own parameter."""
        grads = [p.grad for p in self.model_params]
        held = [m.grad for m in self.params]
        if all(g is not None for g in grads) and all(g is not None for g in held):
            torch._foreach_copy_(held, grads)  # every update but the first: one call
            return
        for param, master in zip(self.model_params, self.params, strict=True):
            if param.grad is None:
                master.grad = None
            elif master.grad is None:
                master.grad = param.grad.float()
            else:
                master.grad.copy_(param.grad)

    @torch.no_grad()
    def scatter_weights(self) -> None:
        """The masters, rounded to bf16, into the model's weights (in place: the tensors that
        DDP's buckets and CUDA graphs hold)."""
        torch._foreach_copy_(self.model_params, self.params)

    def zero_model_grads(self, set_to_none: bool) -> None:
        """The model's gradients cleared for the next update: freed, or zeroed in place where
        CUDA graphs add into them."""
        if set_to_none:
            for param in self.model_params:
                param.grad = None
            return
        grads = [p.grad for p in self.model_params if p.grad is not None]
        if grads:
            torch._foreach_zero_(grads)
