"""FLUX.2 with reference images (issue 29 item 2: multi-reference editing as Flux2KleinPipeline
and Flux2Pipeline take `image=`), on the tiny klein model: the references join the sequence where
the pipeline puts them, condition the prediction of the target alone, train from paired concepts
(the loss falls; resumed, offloaded and fp8/nf4 runs on pairs as plain ones), and condition the
sample."""

from __future__ import annotations

import pytest
import torch
from conftest import fixed_loss, train_config
from family_cross import initializes_and_steps, offloaded_training_matches, resumed_training_matches

from modules.data.synthetic_images import write_edit_pairs
from modules.trainer.generic_trainer import GenericTrainer

FLUX2 = {"model": {"family": "flux2"}}


@pytest.fixture(scope="module")
def family(tmp_path_factory, tiny_family_model, shape_images):
    from modules.model.flux2 import Flux2Family

    family = Flux2Family(train_config(tiny_family_model("flux2"), shape_images, tmp_path_factory.mktemp("flux2-refs"), FLUX2))
    family.load()
    return family


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("flux2-pairs")
    write_edit_pairs(folder, count=2)
    return folder


CHANNELS = 32  # the tiny model's patchified latent channels (128 at real size)


def _references(seed: int, count: int = 1, size: int = 2) -> torch.Tensor:
    return torch.randn(1, count, CHANNELS, size, size, generator=torch.Generator().manual_seed(seed))


def test_references_sit_where_the_pipeline_puts_them_and_only_the_target_is_predicted(family, monkeypatch):
    from diffusers import Flux2KleinPipeline

    latents = torch.randn(1, CHANNELS, 2, 2, generator=torch.Generator().manual_seed(1))
    text = family.encode_text(family.tokenize(["make the circle red"]))
    seen = {}
    forward = family.transformer.forward

    def spy(*args, **kwargs):
        seen.update(tokens=kwargs["hidden_states"], ids=kwargs["img_ids"])
        return forward(*args, **kwargs)

    monkeypatch.setattr(family.transformer, "forward", spy)
    references = _references(3, count=2, size=2)
    with torch.no_grad():
        first = family.denoise(latents, torch.tensor([0.5]), {**text, "control_latents": references})
    assert first.shape == latents.shape
    # the pipeline's packing and ids of the same two references (prepare_image_latents, given latents)
    packed = [Flux2KleinPipeline._pack_latents(references[:, i]) for i in range(2)]
    ids = Flux2KleinPipeline._prepare_image_ids([references[:, i] for i in range(2)])
    assert torch.equal(seen["tokens"][:, 4:], torch.cat(packed, dim=1))
    assert torch.equal(seen["ids"][:, 4:], ids) and seen["ids"][0, 4:, 0].tolist() == [10] * 4 + [20] * 4
    assert torch.equal(seen["ids"][:, :4], Flux2KleinPipeline._prepare_latent_ids(latents))
    monkeypatch.undo()
    with torch.no_grad():
        plain = family.denoise(latents, torch.tensor([0.5]), text)
        other = family.denoise(latents, torch.tensor([0.5]), {**text, "control_latents": _references(4, count=2)})
    assert (first - plain).abs().max() > 1e-4 and (first - other).abs().max() > 1e-4


def paired(folder) -> dict:
    return {**FLUX2, "concepts": [{"path": str(folder), "controls": {"source": "folders"}}]}


def test_flux2_trains_a_lora_on_pairs_the_loss_falls_and_a_sample_follows_its_reference(tmp_path, tiny_family_model,
                                                                                       pairs, family):
    from modules.config.train_config import SamplePromptConfig

    config = train_config(tiny_family_model("flux2"), pairs, tmp_path, paired(pairs), {
        "adapter": {"layer_preset": "all-linear"}, "schedule": {"epochs": 10, "batch_size": 1},
        "optimizer": {"lr": 1.5e-2}})
    trainer = GenericTrainer(config)
    trainer.start()
    assert trainer.dataset.collate([0], trainer.device).controls.shape[:3] == (1, 1, CHANNELS)
    before = fixed_loss(trainer, draws=8)
    trainer.train()  # the first step's guard checks every adapter learned
    after = fixed_loss(trainer, draws=8)
    assert trainer.step == 20 and after < before * 0.8, (before, after)
    trainer.end()

    def sample(controls):
        prompt = SamplePromptConfig(prompt="make the circle red", steps=2, cfg=1.0, width=64, height=64, seed=3,
                                    control_images=controls)
        return torch.tensor(list(family.sample(prompt, torch.device("cpu")).getdata()), dtype=torch.float32)

    first, second = sorted(str(p) for p in (pairs / "control").glob("*.png"))
    a, b, none = sample([first]), sample([second]), sample([])
    assert (a - b).abs().max() > 0 and (a - none).abs().max() > 0


def test_resume_on_pairs_equals_an_uninterrupted_run(tmp_path, tiny_family_model, pairs):
    resumed_training_matches(tiny_family_model("flux2"), pairs, tmp_path, "flux2", paired(pairs))


def test_offloading_half_the_transformer_trains_the_same_adapter_on_pairs(fake_device, tmp_path, tiny_family_model,
                                                                          pairs):
    offloaded_training_matches(tiny_family_model("flux2"), pairs, tmp_path, "flux2", "transformer", fake_device,
                               paired(pairs))


@pytest.mark.parametrize("mode", ["float8", "nf4"])
def test_a_quantized_transformer_trains_on_pairs(tmp_path, tiny_family_model, pairs, mode):
    initializes_and_steps(tiny_family_model("flux2"), pairs, tmp_path, "flux2", "transformer", mode, False,
                          paired(pairs))
