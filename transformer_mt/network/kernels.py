"""How a model computes: scaled_dot_product_attention's kernels (model.attention_backend, in
training and decoding); while it decodes, its precision on its device, torchao's dynamic int8,
and on a CPU its float32 and bf16 linear layers through oneDNN with their weights packed once.

PyTorch computes a float32 linear layer on x86 with MKL's sgemm, which on AMD CPUs does not
use AVX-512 (MKL picks its kernels by vendor); oneDNN, also inside every PyTorch wheel, does.
On the AVX-512 machine of docs/benchmarks.md the decoder's products run 1.5-2.5x faster
through it, and beam search as a whole 1.4x (scripts/bench_decode.py). The products are the
same ones: bit for bit for 128-wide inputs there, wider ones summed in another order (a median
relative difference of 3e-7 at 512). On the demo model's 1,000 test sentences every output was
the same. decode.cpu_linear=torch keeps torch's own kernels. A packed layer has no gradient, so
with autograd on it computes as before.

A CPU with bf16 arithmetic (x86: AVX512_BF16, or AMX) multiplies packed bf16 weights 1.2-2x
faster than packed float32 ones at a decoding step's shapes (half the bytes read, twice the
products an instruction): decode.precision=bf16 decodes an OPUS-MT-sized model 1.76x faster
there (the 128-wide demo model 1.1x at beam 4, slower greedy). A CPU without it emulates bf16,
slower than float32, in decoding and training alike: check_bf16 warns.
"""

from __future__ import annotations

import contextlib
import logging
import platform
import warnings
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from transformer_mt.common.exits import TmtError

logger = logging.getLogger(__name__)

# model.attention_backend's kernels, and each one's place in auto's order on CUDA.
ATTENTION_KERNELS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}


def attention_kernels(choice: str, device: torch.device) -> list[SDPBackend] | None:
    """The kernels scaled_dot_product_attention may use for model.attention_backend, in order
    of preference (None: PyTorch's own choice). A kernel chosen comes first, the others after it
    for the calls it cannot take (flash takes no padding mask: the encoder's and the cross
    attention's go to the next one). auto on CUDA puts cuDNN's fused attention last: it builds
    an execution plan for every new shape (~0.4 s each on an H200, 47 s of a 2-minute Multi30k
    run), which flash and memory-efficient attention do not; scripts/bench_gpu.sh measures the
    four over a first epoch. auto on a CPU: PyTorch's choice."""
    if choice == "auto":
        if device.type != "cuda":
            return None
        choice = "flash"  # then efficient, cudnn, math: ATTENTION_KERNELS' order
    first = ATTENTION_KERNELS[choice]
    return [first, *(k for k in ATTENTION_KERNELS.values() if k != first)]


@contextlib.contextmanager
def attention(choice: str, device: torch.device | str) -> Iterator[None]:
    """Attention computed with model.attention_backend's kernels inside the block."""
    kernels = attention_kernels(choice, torch.device(device))
    if kernels is None:
        yield
        return
    with sdpa_kernel(kernels, set_priority=True):
        yield


def check_bf16(key: str, precision: str, device: torch.device) -> None:
    """`key`=bf16 (or bf16_weights) on a device without bf16 arithmetic. A GPU before Ampere (a
    T4, a V100): refused in one line where PyTorch cannot even emulate it, a warning where it
    emulates it, slowly; both name fp16, which such a card's tensor cores run. A CPU without
    AVX512_BF16 or AMX (cpu_has_bf16): a warning that it is emulated, slower than float32.
    Decoding an OPUS-MT-shaped model there ran 2.4x slower than in float32 (docs/benchmarks.md:
    oneDNN held to AVX-512 without its bf16 instructions), where a CPU with them decodes it 1.76x
    faster and trains a base-sized model 1.48x faster."""
    if precision not in ("bf16", "bf16_weights"):
        return
    if device.type == "cpu" and cpu_has_bf16() is False:
        logger.warning("%s=%s: this CPU has no bf16 arithmetic (AVX512_BF16 or AMX); it is"
                       " emulated, slower than fp32 here", key, precision)  # fmt: skip
    if device.type != "cuda":
        return
    if torch.cuda.is_bf16_supported(including_emulation=False):
        return
    card = torch.cuda.get_device_name(device)
    if not torch.cuda.is_bf16_supported(including_emulation=True):
        raise TmtError(f"{key}={precision}: {card} has no bf16 arithmetic; set {key}=fp16 or"
                       " fp32")  # fmt: skip
    logger.warning("%s=%s: %s emulates bf16, slowly; %s=fp16 runs on its tensor cores", key,
                   precision, card, key)  # fmt: skip


def in_precision(model: nn.Module, precision: str, device: torch.device) -> nn.Module:
    """The model on `device` in the decoding precision (float32 for int8: int8() quantizes it)."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    return model.to(device=device, dtype=dtype)


def int8(model: nn.Module) -> nn.Module:
    """Dynamic int8 of the linear layers (torchao: int8 weights per channel, activations per
    token at each call). The stacked Q/K/V projections stay float32: cross attention slices
    theirs, which a quantized tensor cannot. Unlike float32, a line's output may differ in rare
    lines with its batch (149 of 150 test sentences identical alone and batched, demo model)."""
    # torchao's import logs the GPU kernels it cannot load on this machine: not the user's news.
    logging.disable(logging.WARNING)
    try:
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_
        from torchao.utils import should_reduce_range
    except ImportError:
        raise TmtError(
            'decode.precision=int8 needs the torchao package: pip install "transformer_mt[int8]"'
        ) from None
    finally:
        logging.disable(logging.NOTSET)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # Without VNNI, int8 products summed in pairs can saturate: a reduced range avoids it.
        config = Int8DynamicActivationInt8WeightConfig(
            reduce_range=should_reduce_range(torch.device("cpu"))
        )
        quantize_(model, config, filter_fn=_quantizable)
    return model


def _quantizable(module: nn.Module, name: str) -> bool:
    return isinstance(module, nn.Linear) and not name.endswith("in_proj")


class PackedLinear(nn.Linear):
    """An nn.Linear (the same parameters and state dict) that multiplies by a copy of its
    weight in oneDNN's layout, made by pack_linears. The copy is not updated if the weight
    changes: pack a model once its weights are final."""

    packed: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


PACKED_DTYPES = (torch.float32, torch.bfloat16)  # what oneDNN's packed product takes


def available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this PyTorch has oneDNN's packed linear product for `dtype` (float32 or bf16) on
    the CPU, and it agrees with F.linear on a probe (bf16: within bf16's rounding). oneDNN packs
    bf16 only from AVX-512 (or AVX-NE-CONVERT) up: elsewhere a bf16 model keeps torch's
    kernels."""
    if dtype not in PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    try:
        weight, x = torch.randn(24, 40).to(dtype), torch.randn(3, 40).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        with torch.inference_mode():
            y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except (AttributeError, RuntimeError):  # an op missing or refused in this build or CPU
        return False
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    return torch.allclose(y.float(), F.linear(x, weight).float(), rtol=tolerance, atol=tolerance)


def pack_linears(model: nn.Module) -> bool:
    """Make every float32 or bf16 CPU nn.Linear of `model` a PackedLinear, in place; False (and
    the model untouched) where oneDNN cannot (see available)."""
    on_cpu = [m for m in model.modules() if type(m) is nn.Linear and m.weight.device.type == "cpu"]
    dtypes = {m.weight.dtype for m in on_cpu}
    packable = {dtype for dtype in PACKED_DTYPES if dtype in dtypes and available(dtype)}
    linears = [m for m in on_cpu if m.weight.dtype in packable]
    if not linears:
        return False
    for module in linears:
        # A plain attribute, not a buffer: state_dict (and the weights' fingerprint) unchanged.
        module.packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), None)
        module.__class__ = PackedLinear
    return True


def cpu_has_bf16() -> bool | None:
    """Whether this CPU multiplies bf16 in hardware: x86 with AVX512_BF16 or AMX; None where
    PyTorch cannot say (not x86)."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        return None
    probes = (getattr(torch.cpu, name, None) for name in
              ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))  # fmt: skip
    return any(bool(probe()) for probe in probes if probe is not None)
