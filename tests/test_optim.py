"""Optimizers, LR schedules and EMA: each optimizer steps and resumes with its state, schedules as
tables, EMA math, and what samples and saved files use (EMA / schedule-free averaged weights)."""

from __future__ import annotations

import io

import pytest
import torch
from conftest import train_config
from safetensors.torch import load_file
from torch import nn

from modules.config.loading import build_config
from modules.config.train_config import LrSchedulerConfig
from modules.optim.ema import EMA
from modules.optim.optimizers import build_optimizer, evaluation_weights
from modules.optim.schedulers import lr_factor
from modules.trainer.callbacks import TrainCallbacks
from modules.trainer.commands import TrainCommands
from modules.trainer.generic_trainer import GenericTrainer

OPTIMIZERS = ["adamw", "adamw_8bit", "adafactor", "prodigy", "schedule_free_adamw", "lion", "came"]


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))


def _step(model, optimizer, seed):
    torch.manual_seed(100 + seed)
    x, y = torch.randn(16, 64), torch.randn(16, 8)
    optimizer.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()


@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_each_optimizer_steps_and_resumes_from_its_saved_state(kind):
    config = build_config([{"optimizer": {"type": kind}}]).optimizer
    straight = _model()
    before = [p.detach().clone() for p in straight.parameters()]
    optimizer = build_optimizer(config, [{"params": list(straight.parameters())}])
    for seed in range(2):
        _step(straight, optimizer, seed)
    assert any(not torch.equal(a, b) for a, b in zip(before, straight.parameters()))

    resumed = _model()
    resumed.load_state_dict(straight.state_dict())
    saved = io.BytesIO()
    torch.save(optimizer.state_dict(), saved)  # as a backup stores it, and reads it back safely
    saved.seek(0)
    again = build_optimizer(config, [{"params": list(resumed.parameters())}])
    again.load_state_dict(torch.load(saved, weights_only=True))
    for seed in (2, 3):
        _step(straight, optimizer, seed)
        _step(resumed, again, seed)
    for a, b in zip(straight.parameters(), resumed.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def _factors(total=10, **config):
    return [round(lr_factor(LrSchedulerConfig(**config), step, total), 4) for step in range(total)]


def test_schedule_curves():
    assert _factors(type="constant") == [1.0] * 10
    assert _factors(type="linear") == [1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1]
    assert _factors(type="cosine") == [1.0, 0.9755, 0.9045, 0.7939, 0.6545, 0.5, 0.3455, 0.2061, 0.0955, 0.0245]
    assert _factors(type="cosine_with_restarts", cycles=2) == [1.0, 0.9045, 0.6545, 0.3455, 0.0955,
                                                               1.0, 0.9045, 0.6545, 0.3455, 0.0955]
    assert _factors(type="polynomial", power=2.0) == [1.0, 0.81, 0.64, 0.49, 0.36, 0.25, 0.16, 0.09, 0.04, 0.01]
    assert _factors(type="linear", min_factor=0.5) == [1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55]
    # warmup never starts at zero, then the decay spans the remaining steps
    assert _factors(type="linear", warmup_steps=3) == [0.25, 0.5, 0.75, 1.0, 0.8571, 0.7143, 0.5714, 0.4286,
                                                      0.2857, 0.1429]


def test_ema_math_swap_and_state():
    weight = nn.Parameter(torch.zeros(3))
    ema = EMA([weight], decay=0.5, device=torch.device("cpu"))
    for value in (4.0, 8.0):
        with torch.no_grad():
            weight.fill_(value)
        ema.update()
    assert torch.equal(ema.shadow[0], torch.full((3,), 5.0))  # 0 -> 2 -> 5
    with ema.swapped_in():
        assert torch.equal(weight.detach(), torch.full((3,), 5.0))
    assert torch.equal(weight.detach(), torch.full((3,), 8.0))
    other = EMA([weight], decay=0.5, device=torch.device("cpu"))
    other.load_state_dict(ema.state_dict())
    assert torch.equal(other.shadow[0], ema.shadow[0]) and other.updates == 2


def test_schedule_free_evaluates_at_its_average_and_trains_at_its_own_point():
    model = _model()
    optimizer = build_optimizer(build_config([{"optimizer": {"type": "schedule_free_adamw"}}]).optimizer,
                                [{"params": list(model.parameters())}])
    for seed in range(3):
        _step(model, optimizer, seed)
    training_point = [p.detach().clone() for p in model.parameters()]
    with evaluation_weights(optimizer):
        averaged = [p.detach().clone() for p in model.parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(training_point, averaged))
    for a, b in zip(training_point, model.parameters()):  # back to the training point (float rounding)
        torch.testing.assert_close(a, b.detach(), atol=1e-6, rtol=0)


def _run(config, stop_at=None):
    commands = TrainCommands()

    class Stopper(TrainCallbacks):
        def on_progress(self, progress):
            if stop_at is not None and progress.step == stop_at:
                commands.stop()

    trainer = GenericTrainer(config, Stopper(), commands)
    trainer.start()
    trainer.train()
    return trainer


def test_ema_weights_go_into_the_saved_file_and_survive_resume(tmp_path, tiny_model, shape_images):
    overlay = {"schedule": {"epochs": 2, "batch_size": 2}, "ema": {"enabled": True, "decay": 0.9}}
    straight = _run(train_config(tiny_model, shape_images, tmp_path / "a", overlay))
    path = straight.end()
    saved = load_file(str(path))
    key = next(k for k in saved if k.endswith("lora_up.weight"))
    name = key.removesuffix(".lora_up.weight")
    index = [n for n, _ in straight.adapters.named_parameters()].index(f"{name}.lora_up.weight")
    torch.testing.assert_close(saved[key], straight.ema.shadow[index])
    assert not torch.equal(saved[key], dict(straight.adapters.named_parameters())[f"{name}.lora_up.weight"].detach())

    config = train_config(tiny_model, shape_images, tmp_path / "b", overlay)
    _run(config, stop_at=2)
    resumed = _run(config.model_copy(update={"backup": config.backup.model_copy(update={"resume": True})}))
    assert resumed.step == straight.step
    for ours, theirs in zip(resumed.ema.shadow, straight.ema.shadow):
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)


def test_scale_by_batch_size_multiplies_every_learning_rate(tmp_path, tiny_model, shape_images):
    config = train_config(tiny_model, shape_images, tmp_path, {
        "schedule": {"batch_size": 2, "gradient_accumulation": 3},
        "lr_scheduler": {"scale_by_batch_size": True},
        "optimizer": {"lr": 1e-4},
    })
    trainer = GenericTrainer(config, TrainCallbacks())
    trainer.start()
    assert [group["initial_lr"] for group in trainer.optimizer.param_groups] == [pytest.approx(6e-4)]


@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_each_optimizer_trains_the_adapters_in_a_run(kind, tmp_path, tiny_model, shape_images):
    # the first-step guard raises if any adapter parameter got no gradient or did not move
    config = train_config(tiny_model, shape_images, tmp_path, {"optimizer": {"type": kind},
                                                               "schedule": {"max_steps": 2}})
    trainer = _run(config)
    assert trainer.step == 2 and torch.isfinite(torch.tensor(trainer.last_loss))
    assert trainer.end().exists()
