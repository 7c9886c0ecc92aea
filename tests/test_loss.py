"""Label-smoothed cross entropy: F.cross_entropy parity, pad handling, golden values."""

from __future__ import annotations

import math

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
