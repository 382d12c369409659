"""The first-step guard's watch (modules/trainer/guards.py, PendingMoves): a tensor the optimizer holds,
with a gradient, whose first step is below its resolution (FIBO-2's 1-element cross-attention gate at
0.5 under Adafactor's first warm-up step, a norm weight at 1.0 with a tiny lr) is watched, not stopped,
and passes once it moves; one that never moves (a stepped weight whose stored value is written back
from an old copy) stops the run at the end of the warm-up plus SETTLE_STEPS; a tensor outside the
optimizer still stops it at step 1. Then the trainer's wiring: the optimizer's and the fused
stepper's groups as membership, the deadline, the bfloat16 stepper's record of later steps."""

from __future__ import annotations

import pytest
import torch
from conftest import train_config
from torch import nn

from modules.trainer.callbacks import TrainCallbacks
from modules.trainer.first_step_guard import FirstStepGuard
from modules.trainer.generic_trainer import GenericTrainer
from modules.trainer.guards import SETTLE_STEPS, TrainingError, check_first_step, snapshot

# --- the guard on its own ------------------------------------------------------------------------


def _gate_and_weight():
    torch.manual_seed(0)
    gate, weight = nn.Parameter(torch.full((1,), 0.5)), nn.Parameter(torch.randn(4, 4))
    return [("layers.0.cross_attn_gate", gate), ("layers.0.to_q.weight", weight)]


def _step(optimizer, named, gradients=None):
    for name, parameter in named:
        parameter.grad = (gradients or {}).get(name, torch.full_like(parameter, 0.3))
    optimizer.step()


def test_a_one_element_gate_stepped_below_its_resolution_is_watched_and_passes_once_it_moves():
    named = _gate_and_weight()
    gate = named[0][1]
    before = snapshot(named)
    optimizer = torch.optim.Adafactor([p for _, p in named], lr=5e-6 / 101)  # the warm-up's first lr
    upward = {"layers.0.cross_attn_gate": torch.full((1,), -0.3)}  # (float32's spacing above 0.5 is 6e-8)
    _step(optimizer, named, upward)
    assert torch.equal(gate.detach(), before["layers.0.cross_attn_gate"])  # 0.5 + 2.5e-8 is 0.5 in float32
    with pytest.raises(TrainingError, match=r"had a gradient but did not change .*: layers\.0\.cross_attn_gate\n"):
        check_first_step(named, before)  # membership unknown: what the guard said before it watched
    pending = check_first_step(named, before, in_optimizer={id(p) for _, p in named})
    assert pending.names == {"layers.0.cross_attn_gate"}
    optimizer.param_groups[0]["lr"] = 5e-6  # the warm-up's end
    _step(optimizer, named, upward)
    pending.check(named, 2)
    assert pending.done and pending.unresolved() is None


def test_a_norm_weight_at_one_with_a_tiny_lr_is_watched_and_its_module_not_called_unchanged():
    norm, linear = nn.Parameter(torch.ones(8)), nn.Parameter(torch.randn(8, 8))
    named = [("norm.weight", norm), ("linear.weight", linear)]
    before = snapshot(named)
    optimizer = torch.optim.SGD([{"params": [norm], "lr": 1e-9}, {"params": [linear], "lr": 1e-2}])
    _step(optimizer, named, {"norm.weight": torch.ones(8)})  # 1.0 - 1e-9 is 1.0 in float32
    assert torch.equal(norm.detach(), before["norm.weight"])
    pending = check_first_step(named, before, in_optimizer={id(norm), id(linear)})
    assert pending.names == {"norm.weight"}  # and no "module(s) did not change at all: norm"
    assert "norm.weight" in pending.unresolved()  # what a run shorter than the deadline says at its end


def test_a_watched_tensor_that_never_moves_stops_the_run_at_the_deadline():
    """A stale write-back: the optimizer steps the weight, then its old value is copied over it (as a
    parked weight restored from an old copy would be). It has a gradient and is in the optimizer, so
    step 1 cannot tell it from a step below its resolution; the deadline can."""
    named = _gate_and_weight()
    gate = named[0][1]
    before = snapshot(named)
    optimizer = torch.optim.SGD([p for _, p in named], lr=0.1)

    def stale_step():
        _step(optimizer, named)
        with torch.no_grad():
            gate.copy_(before["layers.0.cross_attn_gate"])

    stale_step()
    pending = check_first_step(named, before, in_optimizer={id(p) for _, p in named}, deadline=4)
    for step in (2, 3):
        stale_step()
        pending.check(named, step)
    stale_step()
    with pytest.raises(TrainingError, match=r"by step 4, 1 tensor\(s\) in the optimizer had a gradient but never "
                                            r"changed .*: layers\.0\.cross_attn_gate$"):
        pending.check(named, 4)


def test_a_tensor_outside_the_optimizer_still_stops_the_run_at_step_one():
    named = _gate_and_weight()
    before = snapshot(named)
    optimizer = torch.optim.SGD([named[1][1]], lr=0.1)  # the gate left out
    _step(optimizer, named)
    with pytest.raises(TrainingError, match=r"had a gradient but did not change \(not in the optimizer\?\): "
                                            r"layers\.0\.cross_attn_gate\n"):
        check_first_step(named, before, in_optimizer={id(named[1][1])})


# --- the trainer's wiring ---------------------------------------------------------------------


class _Warnings(TrainCallbacks):
    def __init__(self):
        super().__init__()
        self.warnings: list[str] = []

    def on_warning(self, message):
        self.warnings.append(message)


def _fine_tune(tiny_model, one_image, tmp_path, overlay: dict):
    base = {"method": {"type": "fine_tune"}, "schedule": {"batch_size": 1, "epochs": 100}, "seed": 3}
    return train_config(tiny_model, one_image, tmp_path, base, overlay)


def _watched_after_step_one(monkeypatch) -> list[set[str]]:
    watched = []
    real = FirstStepGuard.first_step

    def spy(guard, before):
        pending = real(guard, before)
        watched.append(set(pending.names) if pending is not None else set())
        return pending

    monkeypatch.setattr(FirstStepGuard, "first_step", spy)
    return watched


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "after-backward"])
def test_a_bfloat16_fine_tune_whose_norms_round_back_in_the_first_warm_up_step_trains(
        fused, tmp_path, tiny_model, one_image, monkeypatch):
    """The Krea-2 / FIBO-2 full fine-tune's recipe (bfloat16, stochastic rounding, Adafactor, 100
    warm-up steps) at lr 2e-6: step 1 moves a norm weight at 1.0 by 2e-8, under half float32's
    spacing on either side of 1.0 (its float32 copy rounds back); step 2 by 4e-8, which moves those
    stepped down. The stepper's record of step 2 must reach the guard: the bfloat16 values barely move
    (stochastic rounding moves an element with probability 4e-8 / 0.004)."""
    watched = _watched_after_step_one(monkeypatch)
    callbacks = _Warnings()
    trainer = GenericTrainer(_fine_tune(tiny_model, one_image, tmp_path, {
        "method": {"fused_backward": fused, "stochastic_rounding": True},
        "model": {"parts": {"unet": {"weight_dtype": "bfloat16"}}},
        "optimizer": {"type": "adafactor", "lr": 2e-6}, "lr_scheduler": {"warmup_steps": 100},
        "schedule": {"max_steps": 2}}), callbacks)
    trainer.start()
    trainer.train()
    assert trainer.step == 2
    assert watched[0] and all("norm" in name.split(".")[-2] and name.endswith(".weight") for name in watched[0])
    assert not [w for w in callbacks.warnings if "did not change" in w]  # they moved since
    trainer.release()


def test_a_fine_tune_that_cannot_move_stops_at_the_end_of_the_warm_up_plus_the_settle_steps(
        tmp_path, tiny_model, one_image):
    """Adafactor's step is lr x the weight's RMS: at lr 1e-9 no float32 weight moves, ever."""
    trainer = GenericTrainer(_fine_tune(tiny_model, one_image, tmp_path, {
        "optimizer": {"type": "adafactor", "lr": 1e-9}, "lr_scheduler": {"warmup_steps": 2},
        "schedule": {"max_steps": 3 + SETTLE_STEPS}}))
    trainer.start()
    with pytest.raises(TrainingError, match=rf"by step {2 + SETTLE_STEPS}, \d+ tensor\(s\) in the optimizer had a "
                                            r"gradient but never changed"):
        trainer.train()
    assert trainer.step == 1 + SETTLE_STEPS  # (counted after the check)
    trainer.release()


def test_a_run_shorter_than_the_deadline_says_what_never_moved(tmp_path, tiny_model, one_image):
    callbacks = _Warnings()
    trainer = GenericTrainer(_fine_tune(tiny_model, one_image, tmp_path, {
        "optimizer": {"type": "adafactor", "lr": 1e-9}, "schedule": {"max_steps": 2}}), callbacks)
    trainer.start()
    trainer.train()
    assert trainer.step == 2
    assert [w for w in callbacks.warnings if "had a gradient but did not change in this run" in w]
    trainer.release()


def test_a_weight_the_fused_stepper_does_not_hold_stops_the_run_at_step_one(tmp_path, tiny_model, one_image):
    """The optimizer's groups still list it, but the fused backward steps only what its stepper's
    groups hold: membership is the stepper's, so it is named at once rather than watched."""
    trainer = GenericTrainer(_fine_tune(tiny_model, one_image, tmp_path, {
        "method": {"fused_backward": True}, "schedule": {"max_steps": 1}}))
    trainer.start()
    [method] = trainer.methods
    name, lost = next((n, p) for n, p in method.named if n.endswith("conv_in.weight"))
    del method.fused.stepper.group_of[id(lost)]
    with pytest.raises(TrainingError, match=rf"had a gradient but did not change \(not in the optimizer\?\): "
                                            rf"fine_tune\.{name}$"):
        trainer.train()
    trainer.release()
