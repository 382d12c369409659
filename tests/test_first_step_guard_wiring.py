"""The first-step guard (modules/trainer/guards.py) as the trainer and the steppers feed it: an
embedding looked up but not stepped is named; a fused backward records a zero gradient as zero
(not "had a gradient"); a bfloat16 fine-tune whose tiny first step rounds back to every stored
value is not stopped, because the trainer passes the stepper's float32 record of what moved."""

from __future__ import annotations

import pytest
import torch
from conftest import train_config
from torch import nn

from modules.optim.fused_backward import FusedBackward
from modules.optim.single_parameter_step import SingleParameterStepper
from modules.trainer.generic_trainer import GenericTrainer
from modules.trainer.guards import TrainingError, check_first_step, snapshot


def test_an_embedding_looked_up_but_not_stepped_is_named_by_the_guard(tmp_path, tiny_model, one_image):
    """Both placeholders are in every caption; the optimizer loses <b>'s vectors (as a group built
    from other tensors would): its gradient is non-zero and it did not move."""
    config = train_config(tiny_model, one_image, tmp_path, {
        "method": {"type": "embedding"}, "schedule": {"max_steps": 1, "batch_size": 1},
        "embeddings": [{"placeholder": "<a>", "init_text": "a"}, {"placeholder": "<b>", "init_text": "c"}],
        "concepts": [{"path": str(one_image), "captions": {"prefix": "<a> <b> "}}]})
    trainer = GenericTrainer(config)
    trainer.start()
    [group] = [g for g in trainer.optimizer.param_groups if g.get("name") == "embedding <b>"]
    group["params"] = []
    with pytest.raises(TrainingError, match=r"1 tensor\(s\) had a gradient but did not change[^:]*: "
                                            r"embedding\.<b>\.text_encoder$"):
        trainer.train()
    trainer.release()


def test_a_fused_backward_records_which_gradients_were_zero():
    """`dead` reaches the loss times zero (its gradients are all zero, so it rightly stays put);
    `unstepped` has a gradient but the optimizer does not hold it. Recording every gradient as
    non-zero would call `dead` unstepped; recording none would let `unstepped` pass."""
    torch.manual_seed(0)
    live, dead, unstepped = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
    named = [(f"{label}.{name}", p) for label, module in (("live", live), ("dead", dead), ("unstepped", unstepped))
             for name, p in module.named_parameters()]
    optimizer = torch.optim.SGD([*live.parameters(), *dead.parameters()], lr=0.1)
    fused = FusedBackward(named, max_grad_norm=None)
    fused.attach(SingleParameterStepper(optimizer, stochastic_rounding=False))
    before = snapshot(named)
    x = torch.randn(2, 4)
    (live(x).square().mean() + 0.0 * dead(x).sum() + unstepped(x).mean()).backward()
    seen = fused.take_gradients_seen()
    assert seen == {"live.weight": True, "live.bias": True, "dead.weight": False, "dead.bias": False,
                    "unstepped.weight": True, "unstepped.bias": True}
    assert all(p.grad is None for _, p in named)  # freed in the backward pass: only the record tells
    with pytest.raises(TrainingError) as raised:
        check_first_step(named, before, seen)
    message = str(raised.value)
    assert "2 tensor(s) had a gradient but did not change (not in the optimizer?): unstepped.weight, unstepped.bias" \
        in message and "dead" not in message.split("did not change at all")[0]


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "after-backward"])
def test_a_tiny_bfloat16_first_step_that_rounds_back_does_not_stop_the_trainer(fused, tmp_path, tiny_model, one_image):
    """lr 1e-6 moves every float32 copy (norm weights at 1.0 too) but leaves some bfloat16 tensors bit for bit as they were
    (stochastic rounding moves an element with probability step / spacing). The stored values alone
    say "did not change"; the trainer must hand the guard the stepper's record instead."""
    config = train_config(tiny_model, one_image, tmp_path, {
        "method": {"type": "fine_tune", "fused_backward": fused, "stochastic_rounding": True},
        "model": {"parts": {"unet": {"weight_dtype": "bfloat16"}}},
        "optimizer": {"lr": 1e-6}, "schedule": {"max_steps": 1, "batch_size": 1}, "seed": 3})
    trainer = GenericTrainer(config)
    trainer.start()
    named = trainer.named_trained_parameters()
    before = snapshot(named)
    trainer.train()
    assert trainer.step == 1
    unchanged = [name for name, p in named if torch.equal(p.detach().cpu(), before[name])]
    assert unchanged  # what the guard would have called "did not change" from the stored values
    trainer.release()
