"""train.precision=bf16_weights: the model bf16, Adam's float32 masters (training/master_weights.py).

A CPU computes bf16 without native support, slowly, but the same arithmetic: the promises are
checked here (checkpoints hold the masters, a resume is bit-exact, the loss is fp32's within
bf16); tests/test_gpu.py replays the same updates as CUDA graphs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from test_train import final_weights, numbers, records, with_train

from transformer_mt.config import Config
from transformer_mt.network.model import Transformer
from transformer_mt.training.master_weights import MasterWeights
from transformer_mt.training.train import train
from transformer_mt.translation import translate


def test_masters_stand_for_the_model_s_weights_tied_ones_once(tiny_cfg: Config) -> None:
    """One float32 master a parameter (the shared embeddings' one for all their names), the
    model bf16 in place; a checkpoint's state dict is the model's with the masters in it; the
    gradients gathered in float32 (None stays None), the masters rounded back into the model's
    own tensors, its gradients zeroed in place or freed."""
    torch.manual_seed(0)
    model = Transformer(tiny_cfg.model, 40, 0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = list(model.parameters())
    master = MasterWeights(model)
    assert [p is q for p, q in zip(model.parameters(), params, strict=True)] == [True] * len(params)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {b.dtype for b in model.buffers()} == {torch.bfloat16}  # positions: one dtype
    assert len(master.params) == len(params) and {m.dtype for m in master.params} == {torch.float32}
    saved = master.state_dict()
    assert saved.keys() == before.keys()
    assert all(torch.equal(saved[k], before[k]) and saved[k].dtype == torch.float32 for k in saved)
    tied = [k for k in saved if saved[k].data_ptr() == saved["output_projection.weight"].data_ptr()]
    assert len(tied) >= 2  # the shared embeddings: one master under each of its names

    first, second = master.model_params[0], master.model_params[1]
    first.grad = torch.full_like(first, 0.5)
    master.gather_grads()
    assert master.params[0].grad.dtype == torch.float32 and master.params[1].grad is None
    held = master.params[0].grad
    first.grad.fill_(0.25)
    master.gather_grads()
    assert master.params[0].grad is held and bool((held == 0.25).all())  # its buffer, kept
    for param in master.model_params:
        param.grad = torch.ones_like(param)
    master.gather_grads()  # makes the buffers still missing
    held_all = [m.grad for m in master.params]
    for param in master.model_params:
        param.grad.fill_(2.0)
    master.gather_grads()  # every buffer held: one copy of them all
    assert all(m.grad is h and bool((h == 2.0).all()) for m, h in zip(master.params, held_all))

    with torch.no_grad():
        master.params[1].add_(1e-3)  # an update smaller than bf16 can show on most weights
    storage = second.data_ptr()
    master.scatter_weights()
    assert second.data_ptr() == storage and torch.equal(second, master.params[1].bfloat16())
    grad = first.grad
    master.zero_model_grads(set_to_none=False)
    assert first.grad is grad and not first.grad.any()
    master.zero_model_grads(set_to_none=True)
    assert first.grad is None
    with pytest.raises(ValueError, match="float32 model"):
        MasterWeights(model)  # bf16 now


def test_bf16_weights_train_as_fp32_save_masters_and_resume_to_the_bit(
    tiny_cfg: Config, tmp_path: Path
) -> None:
    """A tiny run in bf16_weights: its losses fp32's within bf16; its checkpoints float32, the
    masters themselves (not bf16's roundings of them); stopped at step 4 and resumed to 8, every
    loss and weight the straight run's; its model translates."""
    cfg = dataclasses.replace(tiny_cfg, model=dataclasses.replace(tiny_cfg.model, dropout=0.0))
    cfg = with_train(cfg, max_steps=8, log_every=1, valid_every=4, save_every=4, keep_last=5)
    train(with_train(cfg, out_dir=str(tmp_path / "fp32")))
    bf16 = with_train(cfg, precision="bf16_weights")
    train(with_train(bf16, out_dir=str(tmp_path / "straight")))
    train(with_train(bf16, out_dir=str(tmp_path / "resumed"), max_steps=4))
    train(with_train(bf16, out_dir=str(tmp_path / "resumed")))

    fp32 = [r["loss"] for r in records(tmp_path / "fp32") if "loss" in r]
    straight = [r["loss"] for r in records(tmp_path / "straight") if "loss" in r]
    assert len(straight) == 8 and straight == pytest.approx(fp32, rel=1e-2)
    assert straight != fp32  # computed in bf16, not fp32 under another name
    assert numbers(tmp_path / "resumed") == numbers(tmp_path / "straight")
    a, b = final_weights(tmp_path / "straight", 8), final_weights(tmp_path / "resumed", 8)
    assert a.keys() == final_weights(tmp_path / "fp32", 8).keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert {v.dtype for v in a.values()} == {torch.float32}
    assert any(not torch.equal(v, v.bfloat16().float()) for v in a.values())  # the masters

    model = translate.load_translator(tmp_path / "straight")
    assert next(model.model.parameters()).dtype == torch.float32  # decode.precision's, as ever
    lines = translate.translate_text(model, ["kalo mi nu", "fari giri"])
    assert len(lines) == 2 and all(isinstance(line, str) for line in lines)


def test_a_fine_tuning_s_masters_are_its_parent_s_weights(
    trained_run: Path, tiny_cfg: Config, tmp_path: Path
) -> None:
    """train.init_from with bf16_weights: the parent's float32 weights loaded first, then made
    the masters (made from the fresh model's, they would be lost to its bf16 copy)."""
    from transformer_mt.common.distributed import DistInfo
    from transformer_mt.runs import run
    from transformer_mt.training.train import _build

    cfg = with_train(tiny_cfg, init_from=str(trained_run), out_dir=str(tmp_path / "child"),
                     precision="bf16_weights")  # fmt: skip
    parent = run.init_model(cfg)
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    model, opt, _, _ = _build(cfg, parent.tokenizer, info, saved=None, parent=parent)
    masters = opt.master.state_dict()
    assert masters.keys() == parent.state_dict.keys()
    assert all(torch.equal(masters[k], parent.state_dict[k]) for k in masters)
    assert all(a is b for a, b in zip(opt.params, opt.master.params, strict=True))  # Adam's
    assert next(model.parameters()).dtype == torch.bfloat16
