"""Full fine-tune of the tiny SD1.5 UNet (bfloat16 weights, stochastic rounding, fused backward,
gradient checkpointing):
the loss falls; the single file loads in diffusers' from_single_file and the diffusers folder in
from_pretrained, both with the trained weights; a resumed run ends where an uninterrupted one
does; the first-step guard names a weight the optimizer does not hold."""

from __future__ import annotations

import pytest
import torch
from conftest import fixed_loss, train_config

from modules.trainer.callbacks import TrainCallbacks
from modules.trainer.commands import TrainCommands
from modules.trainer.generic_trainer import GenericTrainer
from modules.trainer.guards import TrainingError

FINE_TUNE = {
    "method": {"type": "fine_tune"},  # fused_backward and stochastic_rounding are on by default
    # checkpointing: the fused step runs while blocks are recomputed in the backward pass
    "model": {"parts": {"unet": {"weight_dtype": "bfloat16", "gradient_checkpointing": True}}},
    "optimizer": {"lr": 1e-3},
    "schedule": {"epochs": 2, "max_steps": 4},
}


class StopAt(TrainCallbacks):
    def __init__(self, step: int, commands: TrainCommands):
        self.step, self.commands = step, commands

    def on_progress(self, progress):
        if progress.step == self.step:
            self.commands.stop()


def _run(config, callbacks=None, commands=None) -> GenericTrainer:
    trainer = GenericTrainer(config, callbacks, commands)
    trainer.start()
    trainer.train()
    trainer.end()
    return trainer


def _unet_state(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in trainer.family.parts["unet"].state_dict().items()}


@pytest.fixture(scope="module")
def straight(tmp_path_factory, tiny_model, shape_images):
    work = tmp_path_factory.mktemp("fine-tune")
    trainer = GenericTrainer(train_config(tiny_model, shape_images, work, FINE_TUNE))
    trainer.start()
    before = fixed_loss(trainer)
    trainer.train()
    after = fixed_loss(trainer)
    path = trainer.end()
    return trainer, path, before, after


def test_loss_falls_and_every_unet_weight_trains(straight, tiny_model):
    trainer, _, before, after = straight
    assert after < before * 0.9
    from diffusers import UNet2DConditionModel

    base = UNet2DConditionModel.from_pretrained(str(tiny_model / "unet")).state_dict()
    trained = _unet_state(trainer)
    assert trainer.family.parts["unet"].conv_in.weight.dtype == torch.bfloat16
    assert all(not torch.equal(trained[k], base[k].to(torch.bfloat16).float()) for k in trained)


def test_the_single_file_loads_in_diffusers_with_the_trained_weights(straight, tiny_model):
    from diffusers import StableDiffusionPipeline

    trainer, path, _, _ = straight
    assert path.suffix == ".safetensors" and path.is_file()
    pipe = StableDiffusionPipeline.from_single_file(str(path), config=str(tiny_model), local_files_only=True,
                                                    safety_checker=None, requires_safety_checker=False)
    reference = StableDiffusionPipeline.from_pretrained(str(tiny_model), safety_checker=None)
    expected = _unet_state(trainer)
    loaded = pipe.unet.state_dict()
    assert loaded.keys() == expected.keys()
    for key in expected:
        assert torch.equal(loaded[key].float(), expected[key]), key  # bfloat16 -> float32 output: exact
    for part in ("vae", "text_encoder"):  # the frozen parts are the base's
        theirs, ours = getattr(reference, part).state_dict(), getattr(pipe, part).state_dict()
        assert all(torch.equal(ours[k], theirs[k]) for k in theirs if k in ours and theirs[k].is_floating_point())


def test_resume_equals_uninterrupted_and_the_folder_loads_in_from_pretrained(straight, tmp_path, tiny_model,
                                                                           shape_images):
    from diffusers import StableDiffusionPipeline

    overlay = {"method": {"save_format": "diffusers"}}
    config = train_config(tiny_model, shape_images, tmp_path, FINE_TUNE, overlay)
    commands = TrainCommands()
    first = GenericTrainer(config, StopAt(2, commands), commands)
    first.start()
    first.train()
    assert first.step == 2
    halfway = _unet_state(first)
    resumed = _run(config.model_copy(update={"backup": config.backup.model_copy(update={"resume": True})}))
    assert resumed.step == 4
    expected, actual = _unet_state(straight[0]), _unet_state(resumed)
    for key in expected:
        assert torch.equal(expected[key], actual[key]), key
    assert any(not torch.equal(halfway[k], expected[k]) for k in expected)  # not vacuous

    folder = tmp_path / "out" / "lora"  # output.path without .safetensors
    pipe = StableDiffusionPipeline.from_pretrained(str(folder), safety_checker=None)
    loaded = pipe.unet.state_dict()
    assert all(torch.equal(loaded[k].float(), actual[k]) for k in actual)
    reference = StableDiffusionPipeline.from_pretrained(str(tiny_model), safety_checker=None)
    assert torch.equal(pipe.vae.decoder.conv_out.weight, reference.vae.decoder.conv_out.weight)


def test_the_guard_names_a_weight_the_optimizer_does_not_hold(tmp_path, tiny_model, shape_images, monkeypatch):
    from modules.methods.fine_tune import FineTuneMethod

    original = FineTuneMethod.parameter_groups

    def without_conv_in(self, config):
        groups = original(self, config)
        left_out = self.family.parts["unet"].conv_in.weight
        return [{**g, "params": [p for p in g["params"] if p is not left_out]} for g in groups]

    monkeypatch.setattr(FineTuneMethod, "parameter_groups", without_conv_in)
    trainer = GenericTrainer(train_config(tiny_model, shape_images, tmp_path, FINE_TUNE,
                                          {"schedule": {"max_steps": 1}}))
    trainer.start()
    with pytest.raises(TrainingError, match=r"fine_tune\.unet\.conv_in\.weight"):
        trainer.train()
