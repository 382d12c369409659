"""Loss options: the loss functions, SNR weightings as tables, noise offset, timestep
distributions, and the refusal of SNR weighting for flow-matching families."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import train_config

from modules.config.errors import ConfigError
from modules.config.loading import build_config
from modules.model.noise import Prediction, draw_noise, draw_unit_times
from modules.trainer.callbacks import TrainCallbacks
from modules.trainer.generic_trainer import GenericTrainer
from modules.trainer.loss import training_loss


def _loss(**options):
    return build_config([{"loss": options}]).loss


def test_loss_types_average_per_sample_then_over_the_batch():
    torch.manual_seed(0)
    prediction, target = torch.randn(3, 4, 5, 5) * 2, torch.randn(3, 4, 5, 5)
    out = Prediction(prediction, target)
    assert torch.allclose(training_loss(out, _loss()), F.mse_loss(prediction, target))
    assert torch.allclose(training_loss(out, _loss(type="l1")), F.l1_loss(prediction, target))
    assert torch.allclose(training_loss(out, _loss(type="huber", huber_delta=0.5)),
                          F.huber_loss(prediction, target, delta=0.5))


@pytest.mark.parametrize("options, v_prediction, expected", [
    ({"min_snr_gamma": 5.0}, False, [1.0, 1.0, 0.5, 0.05]),  # min(snr, 5) / snr
    ({"min_snr_gamma": 5.0}, True, [0.5, 0.8, 5 / 11, 5 / 101]),  # min(snr, 5) / (snr + 1)
    ({"debiased_estimation": True}, False, [1.0, 0.5, 0.1 ** 0.5, 0.1]),  # 1 / sqrt(snr)
])
def test_snr_weightings(options, v_prediction, expected):
    snr = torch.tensor([1.0, 4.0, 10.0, 100.0])
    per_sample = torch.arange(1.0, 5.0)  # sample i has loss i + 1: each weight shows separately
    prediction = per_sample.sqrt().view(4, 1)
    out = Prediction(prediction, torch.zeros_like(prediction), snr, v_prediction)
    expected_loss = (per_sample * torch.tensor(expected)).mean()
    assert torch.allclose(training_loss(out, _loss(**options)), expected_loss)


def test_noise_offset_adds_a_per_sample_per_channel_constant():
    latents = torch.zeros(64, 4, 8, 8)
    plain = draw_noise(latents, torch.Generator().manual_seed(0))
    offset = draw_noise(latents, torch.Generator().manual_seed(0), offset=0.5)
    shift = offset - plain
    assert torch.allclose(shift, shift[..., :1, :1].expand_as(shift), atol=1e-6)  # constant per channel
    assert 0.4 < shift[:, :, 0, 0].std() < 0.6 and torch.equal(plain, draw_noise(latents, torch.Generator().manual_seed(0)))


def test_timestep_distributions():
    uniform = draw_unit_times(20000, torch.Generator().manual_seed(0), "uniform")
    logit = draw_unit_times(20000, torch.Generator().manual_seed(0), "logit_normal")
    shifted = draw_unit_times(20000, torch.Generator().manual_seed(0), "logit_normal", mean=1.0)
    assert 0 < uniform.min() and uniform.max() < 1 and abs(uniform.mean() - 0.5) < 0.01
    assert abs(logit.mean() - 0.5) < 0.01 and logit.std() < uniform.std() * 0.8  # mass in the middle
    assert shifted.mean() > 0.65


def test_ddpm_families_map_times_onto_integer_timesteps_with_their_snr(tiny_model, shape_images, tmp_path):
    from modules.model.sd15 import SD15Family

    family = SD15Family(train_config(tiny_model, shape_images, tmp_path, {"loss": {"timesteps": "logit_normal"}}))
    family.load()
    timesteps = family.training_timesteps(4000, torch.Generator().manual_seed(0))
    assert timesteps.dtype == torch.long and 0 <= timesteps.min() and timesteps.max() <= 999
    assert 400 < timesteps.float().mean() < 600 and timesteps.float().std() < 250
    snr = family.snr(torch.tensor([0, 999]))
    assert snr[0] > 100 > 0.01 > snr[1]  # almost clean at t=0, almost pure noise at the end


def test_snr_weighting_is_refused_for_a_flow_matching_family(tmp_path, shape_images):
    config = build_config([{
        "model": {"family": "flux", "base": str(tmp_path / "nowhere")}, "concepts": [{"path": str(shape_images)}],
        "loss": {"min_snr_gamma": 5.0}, "workspace_dir": str(tmp_path / "ws"), "train_device": "cpu",
    }])
    with pytest.raises(ConfigError, match=r"loss\.min_snr_gamma: SNR weighting is for epsilon and v-prediction"):
        GenericTrainer(config, TrainCallbacks()).start()


def test_a_run_with_every_loss_option_learns(tmp_path, tiny_model, one_image):
    from conftest import fixed_loss

    config = train_config(tiny_model, one_image, tmp_path, {
        "loss": {"type": "huber", "min_snr_gamma": 5.0, "noise_offset": 0.05, "timesteps": "logit_normal"},
        "schedule": {"epochs": 16, "batch_size": 1}, "optimizer": {"lr": 1e-2},
    })
    trainer = GenericTrainer(config, TrainCallbacks())
    trainer.start()
    before = fixed_loss(trainer)
    trainer.train()
    assert fixed_loss(trainer) < before * 0.9


def test_validation_loss_is_the_same_for_the_same_weights_in_every_run(tmp_path, tiny_model, shape_images, one_image):
    class Seen(TrainCallbacks):
        def __init__(self):
            self.validations = []

        def on_validation(self, step, loss):
            self.validations.append((step, loss))

    def run(workspace):
        config = train_config(tiny_model, one_image, workspace, {
            "concepts": [{"path": str(one_image)}, {"path": str(shape_images), "validation": True}],
            "schedule": {"epochs": 2, "batch_size": 1, "validate_every": "1 steps"},
            "adapter": {"dropout": 0.2},
        })
        seen = Seen()
        trainer = GenericTrainer(config, seen)
        trainer.start()
        assert len(trainer.dataset.entries) == 1 and len(trainer.validation_set.entries) == 4
        first = trainer.validate()
        assert first == trainer.validate()  # fixed draws and no dropout: the same number twice
        trainer.train()
        # with trained (non-zero) adapters, dropout would change the number: validation turns it off
        assert trainer.validate() == trainer.validate()
        return [first] + [loss for _, loss in seen.validations[2:4]]

    first_run, second_run = run(tmp_path / "a"), run(tmp_path / "b")
    assert len(first_run) == 3 and first_run == second_run
    assert first_run[0] != first_run[-1]  # the adapter changed the validation loss


def test_a_concepts_loss_weight_scales_its_samples():
    prediction = torch.tensor([[1.0], [2.0]])
    out = Prediction(prediction, torch.zeros_like(prediction))
    assert training_loss(out, _loss(), torch.tensor([1.0, 0.5])) == pytest.approx((1 + 4 * 0.5) / 2)


def test_concept_loss_weights_reach_the_batch(tmp_path, tiny_model, shape_images, one_image):
    config = train_config(tiny_model, one_image, tmp_path, {
        "concepts": [{"path": str(one_image), "loss_weight": 0.25}, {"path": str(shape_images)}],
    })
    trainer = GenericTrainer(config, TrainCallbacks())
    trainer.start()
    indices = [i for i, e in enumerate(trainer.dataset.entries) if e.loss_weight == 0.25][:1] + [
        i for i, e in enumerate(trainer.dataset.entries) if e.loss_weight == 1.0][:1]
    batch = trainer.dataset.collate(indices, trainer.device)
    assert batch.loss_weights.tolist() == [0.25, 1.0]
