"""Layer offloading of trained weights with the fused step: a parked block's weights are stepped on
the train device in their own backward, the update goes home with them (not lost on a copy), and
their optimizer state travels with them. The train device is the fake second device
(tests/fake_device.py), so a weight, gradient or state left on the wrong side raises as on CUDA."""

from __future__ import annotations


import pytest
import torch
from conftest import train_config
from test_offload import start, toy_stack

from modules.offload.layer_tensors import layer_tensors
from modules.optim.fused_backward import FusedBackward
from modules.optim.single_parameter_step import SingleParameterStepper
from modules.trainer.callbacks import TrainCallbacks
from modules.trainer.generic_trainer import GenericTrainer


def _fused_adamw(model, lr=1e-2):
    named = list(model.named_parameters())
    fused = FusedBackward(named, max_grad_norm=None)
    optimizer = torch.optim.AdamW([p for _, p in named], lr=lr)
    fused.attach(SingleParameterStepper(optimizer, stochastic_rounding=False))
    return optimizer


def _train_toy(fake_device, fraction: float, steps: int = 2):
    model, blocks = toy_stack(quantized=False)
    model.requires_grad_(True)  # after the conductor starts, as a fine-tune method sets it
    conductor = start(model, blocks, fake_device, fraction) if fraction else None
    if conductor is None:
        model.to(fake_device)
    optimizer = _fused_adamw(model)
    if conductor:
        conductor.carry_optimizer_state(optimizer)
    torch.manual_seed(1)
    inputs = [torch.randn(4, 32) for _ in range(steps)]
    for x in inputs:
        model(x.to(fake_device)).square().mean().backward()
    if conductor:
        conductor.evict()  # every parked block home: what a save or a sample sees
    return model, blocks, conductor, optimizer


def test_a_parked_trained_block_keeps_its_update_and_its_state_parks_with_it(fake_device):
    initial, _ = toy_stack(quantized=False)
    plain, *_ = _train_toy(fake_device, 0.0)
    parked, blocks, conductor, optimizer = _train_toy(fake_device, 0.5)
    assert conductor.parked and conductor.moves > len(conductor.parked)
    for (name, ours), theirs, before in zip(parked.named_parameters(), plain.parameters(), initial.parameters()):
        torch.testing.assert_close(ours.detach().cpu(), theirs.detach().cpu(), atol=1e-6, rtol=0, msg=name)
        # stepping a copy and parking the old home would leave a parked weight where it started
        assert not torch.equal(ours.detach().cpu(), before.detach()), name
    for index in conductor.parked:
        for tensor in layer_tensors(blocks[index]):
            state = optimizer.state[tensor.get()]
            assert tensor.get().device.type == "cpu"
            assert {state[k].device.type for k in ("exp_avg", "exp_avg_sq")} == {"cpu"}, "state parks with it"


def test_training_resumes_after_an_eviction_with_the_parked_updates(fake_device):
    """A third step after every block went home (a sample or save in between) still equals the plain run."""
    plain, *_ = _train_toy(fake_device, 0.0, steps=3)
    model, blocks, conductor, optimizer = _train_toy(fake_device, 0.5, steps=2)
    conductor.materialize()
    torch.manual_seed(1)
    x = [torch.randn(4, 32) for _ in range(3)][2]
    model(x.to(fake_device)).square().mean().backward()
    conductor.evict()
    for ours, theirs in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(ours.detach().cpu(), theirs.detach().cpu(), atol=1e-6, rtol=0)


def _fine_tune(tmp_path, tiny_model, images, device, fraction: float) -> GenericTrainer:
    config = train_config(tiny_model, images, tmp_path, {
        "method": {"type": "fine_tune"},  # fused_backward by default
        "model": {"parts": {"unet": {"weight_dtype": "float32", "gradient_checkpointing": True,
                                     "offload_fraction": fraction}}},
        "optimizer": {"lr": 1e-3},
        "schedule": {"epochs": 2, "batch_size": 1},
        "train_device": str(device),
    })
    trainer = GenericTrainer(config, TrainCallbacks())
    trainer.start()
    trainer.train()
    return trainer


def test_a_fine_tune_with_half_the_unet_offloaded_equals_one_without(fake_device, tmp_path, tiny_model, one_image):
    plain = _fine_tune(tmp_path / "plain", tiny_model, one_image, fake_device, 0.0)
    half = _fine_tune(tmp_path / "half", tiny_model, one_image, fake_device, 0.5)
    conductor = half.conductors["unet"]
    assert conductor.parked and half.step == plain.step == 2
    assert conductor.kit is not None  # CUDA's path: asynchronous write-back (tests/fake_device_streams.py)
    conductor.evict()
    ours, theirs = half.family.parts["unet"].state_dict(), plain.family.parts["unet"].state_dict()
    for key in theirs:
        torch.testing.assert_close(ours[key].cpu(), theirs[key].cpu(), atol=1e-5, rtol=0, msg=key)
    parked_weight = next(t.get() for i in conductor.parked for t in layer_tensors(conductor.blocks[i]))
    assert parked_weight.device.type == "cpu"
    assert {v.device.type for v in half.optimizer.state[parked_weight].values() if v.dim()} == {"cpu"}


def test_weights_written_around_a_forward_only_pass_go_home(fake_device):
    """Sampling with an EMA: the average is swapped in, forward-only passes bring blocks, the trained
    values are written back into whatever copy is resident, then training resumes."""
    model, blocks, conductor, optimizer = _train_toy(fake_device, 0.5, steps=1)
    trained = [p.detach().cpu().clone() for p in model.parameters()]
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()  # the EMA swapped in (parked: into the home copies)
        model(torch.randn(2, 32, device=fake_device))  # leaves some parked blocks resident
        assert conductor.resident
        for parameter, value in zip(model.parameters(), trained):
            parameter.copy_(value.to(parameter.device))  # the trained values back, into the resident copies
    conductor.materialize()
    conductor.evict()
    for parameter, value in zip(model.parameters(), trained):
        assert torch.equal(parameter.detach().cpu(), value)


def test_auto_offload_counts_a_fine_tunes_optimizer_state_with_its_weights(tmp_path, tiny_model, one_image):
    from modules.offload.planning import trained_bytes_factor

    def factor(overlay):
        return trained_bytes_factor(train_config(tiny_model, one_image, tmp_path, overlay), "unet")

    fine_tune = {"method": {"type": "fine_tune"}, "model": {"parts": {"unet": {"weight_dtype": "float32"}}}}
    assert factor(fine_tune) == pytest.approx(3.0, abs=1e-3)  # AdamW: two float32 moments a float32 weight
    assert factor({**fine_tune, "optimizer": {"type": "adamw_8bit"}}) < 1.6  # two bytes of state, plus scales
    assert factor({}) == 1.0  # an adapter: the part's weights have no state
