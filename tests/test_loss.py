"""Label-smoothed cross entropy: F.cross_entropy parity, pad handling, golden values."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from transformer_mt.training.loss import label_smoothed_nll

PAD = 0


def batch(seed: int = 0, vocab: int = 9) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 5, vocab, generator=g) * 3
    target = torch.randint(1, vocab, (3, 5), generator=g)
    target[1, 3:] = PAD
    target[2, 1:] = PAD
    return logits, target


def test_epsilon_zero_is_plain_cross_entropy() -> None:
    logits, target = batch()
    out = label_smoothed_nll(logits, target, PAD, 0.0)
    expected = F.cross_entropy(
        logits.flatten(0, 1), target.flatten(), ignore_index=PAD, reduction="sum"
    )
    torch.testing.assert_close(out.loss, expected)
    torch.testing.assert_close(out.nll, expected)
    assert out.n_tokens.item() == 5 + 3 + 1


@settings(max_examples=25, deadline=None)
@given(epsilon=st.floats(0.0, 0.5), seed=st.integers(0, 100))
def test_smoothing_matches_torch_label_smoothing(epsilon: float, seed: int) -> None:
    logits, target = batch(seed)
    out = label_smoothed_nll(logits, target, PAD, epsilon)
    expected = F.cross_entropy(
        logits.flatten(0, 1),
        target.flatten(),
        ignore_index=PAD,
        reduction="sum",
        label_smoothing=epsilon,
    )
    torch.testing.assert_close(out.loss, expected, rtol=1e-5, atol=1e-5)


def test_pad_positions_contribute_nothing() -> None:
    logits, target = batch()
    changed = logits.clone()
    changed[target == PAD] = torch.randn_like(changed[target == PAD]) * 100
    a, b = (
        label_smoothed_nll(logits, target, PAD, 0.1),
        label_smoothed_nll(changed, target, PAD, 0.1),
    )
    torch.testing.assert_close(a.loss, b.loss)
    only_pad = label_smoothed_nll(logits, torch.full_like(target, PAD), PAD, 0.1)
    assert only_pad.loss.item() == 0.0 and only_pad.n_tokens.item() == 0


def test_golden_values() -> None:
    # Uniform logits over V = 4: every per-token term is log 4, smoothed or not.
    uniform = label_smoothed_nll(torch.zeros(1, 2, 4), torch.tensor([[1, 2]]), PAD, 0.1)
    assert uniform.loss.item() == pytest.approx(2 * math.log(4))
    assert uniform.nll.item() == pytest.approx(2 * math.log(4))
    # logits (2, 0, 0), reference class 1, ε = 0.3, V = 3, by hand:
    z = math.log(math.exp(2) + 2)
    nll = z  # -log p_1 = -(0 - z)
    mean_neg_log = ((z - 2) + z + z) / 3
    out = label_smoothed_nll(
        torch.tensor([[[2.0, 0.0, 0.0]]]), torch.tensor([[1]]), pad_id=99, epsilon=0.3
    )
    assert out.nll.item() == pytest.approx(nll)
    assert out.loss.item() == pytest.approx(0.7 * nll + 0.3 * mean_neg_log)


def test_low_precision_logits_are_scored_in_float32() -> None:
    logits, target = batch()
    out = label_smoothed_nll(logits.bfloat16(), target, PAD, 0.1)
    assert out.loss.dtype == torch.float32
    reference = label_smoothed_nll(logits.bfloat16().float(), target, PAD, 0.1)
    torch.testing.assert_close(out.loss, reference.loss)


# --- the chunked loss fused with the output projection (train.fused_loss) -----------------------


def projected(seed: int, dtype: torch.dtype, bias: bool, vocab: int = 11, d: int = 6):
    """States (3, 5, d), a projection d -> vocab (a bias when asked) and targets with padding."""
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(3, 5, d, generator=g) * 2).to(dtype).requires_grad_()
    projection = torch.nn.Linear(d, vocab, bias=bias).to(dtype)
    with torch.no_grad():
        projection.weight.copy_(torch.randn(vocab, d, generator=g))
        if bias:
            projection.bias.copy_(torch.randn(vocab, generator=g))
    target = torch.randint(1, vocab, (3, 5), generator=g)
    target[1, 3:] = PAD
    target[2, 1:] = PAD
    return hidden, projection, target


def gradients(loss: torch.Tensor, hidden: torch.Tensor, projection: torch.nn.Linear) -> list:
    params = [hidden, projection.weight] + (
        [projection.bias] if projection.bias is not None else []
    )
    return list(torch.autograd.grad(loss * 0.37, params))  # a scale, as the step's 1/tokens


@settings(max_examples=25, deadline=None)
@given(
    epsilon=st.floats(0.0, 0.5), seed=st.integers(0, 100), chunk=st.integers(1, 16),
    bias=st.booleans(),
)  # fmt: skip
def test_the_chunked_loss_equals_the_reference_and_its_gradients_in_float64(
    epsilon: float, seed: int, chunk: int, bias: bool
) -> None:
    from transformer_mt.training.loss import chunked_label_smoothed_nll

    hidden, projection, target = projected(seed, torch.float64, bias)
    reference = label_smoothed_nll(projection(hidden), target, PAD, epsilon)
    chunked = chunked_label_smoothed_nll(hidden, projection, target, PAD, epsilon, chunk)
    torch.testing.assert_close(chunked.loss, reference.loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(chunked.nll, reference.nll, rtol=1e-12, atol=1e-12)
    assert chunked.n_tokens.item() == reference.n_tokens.item() == 9
    assert not chunked.nll.requires_grad
    expected = gradients(reference.loss, hidden, projection)
    for got, want in zip(gradients(chunked.loss, hidden, projection), expected, strict=True):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_the_chunked_loss_passes_torchs_gradient_check() -> None:
    from transformer_mt.training.loss import chunked_label_smoothed_nll

    hidden, projection, target = projected(3, torch.float64, bias=True)

    def loss(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        layer = SimpleNamespace(weight=w, bias=b)  # what it reads of an nn.Linear
        return chunked_label_smoothed_nll(h, layer, target, PAD, 0.1, chunk_rows=4).loss

    weight = projection.weight.detach().clone().requires_grad_()
    bias = projection.bias.detach().clone().requires_grad_()
    assert torch.autograd.gradcheck(loss, (hidden, weight, bias))


def test_the_chunked_loss_under_bf16_autocast_is_the_reference_within_bf16() -> None:
    """The training step's case on a GPU: float32 states, the product in bf16."""
    from transformer_mt.training.loss import chunked_label_smoothed_nll

    hidden, projection, target = projected(5, torch.float32, bias=False, vocab=40, d=16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference = label_smoothed_nll(projection(hidden), target, PAD, 0.1)
        chunked = chunked_label_smoothed_nll(hidden, projection, target, PAD, 0.1, chunk_rows=4)
    assert chunked.loss.dtype == torch.float32
    torch.testing.assert_close(chunked.loss, reference.loss, rtol=1e-3, atol=1e-3)
    want = gradients(reference.loss, hidden, projection)
    got = gradients(chunked.loss, hidden, projection)
    for a, b in zip(got, want, strict=True):  # bf16's rounding, at each tensor's scale
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=0, atol=0.02 * b.abs().max().item())


def test_the_chunked_loss_never_holds_the_whole_batchs_scores() -> None:
    """Its forward keeps one chunk of scores at a time (the reference: every row's, twice)."""
    from transformer_mt.training import loss as loss_module

    hidden, projection, target = projected(1, torch.float32, bias=False, vocab=500, d=8)
    sizes = []
    real_linear = loss_module.F.linear

    def spy(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        out = real_linear(x, w, b)
        sizes.append(out.numel())
        return out

    loss_module.F.linear = spy
    try:
        loss_module.chunked_label_smoothed_nll(hidden, projection, target, PAD, 0.1, chunk_rows=4)
    finally:
        loss_module.F.linear = real_linear
    assert sizes and max(sizes) == 4 * 500 < hidden.shape[0] * hidden.shape[1] * 500


def test_the_chunked_loss_repeats_itself_bit_for_bit() -> None:
    """What bit-exact resume asks of a loss (the CPU's default from a 4,000-piece vocabulary):
    the same inputs, the same sums and gradients, to the bit, whatever the chunks before."""
    from transformer_mt.training.loss import chunked_label_smoothed_nll

    hidden, projection, target = projected(7, torch.float32, bias=True, vocab=300, d=16)
    runs = []
    for _ in range(2):
        sums = chunked_label_smoothed_nll(hidden, projection, target, PAD, 0.1, chunk_rows=4)
        runs.append([sums.loss.detach(), sums.nll, *gradients(sums.loss, hidden, projection)])
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def test_a_torch_that_refuses_float32_products_is_asked_once_and_the_loss_converts(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """On CUDA the fused loss asks cuBLAS for float32 products of bf16 factors (torch.mm's
    out_dtype); where that is refused (this CPU's torch has no such product: a real refusal), the
    loss says so once and converts its scores as before, the same sums."""
    from transformer_mt.training import loss as module

    monkeypatch.setitem(module._FLOAT32_PRODUCTS, "work", True)
    a, b = torch.randn(4, 8).bfloat16(), torch.randn(8, 3).bfloat16()
    with caplog.at_level("WARNING", logger=module.__name__):
        assert module._float32_product(a, b) is None
    assert module._FLOAT32_PRODUCTS["work"] is False
    assert "converts its scores to float32" in caplog.text
    assert torch.equal(module._product(a, b, torch.float32), (a @ b).float())
