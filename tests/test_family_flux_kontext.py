"""FLUX.1 Kontext on a tiny offline model, trained on edit pairs (tests/test_paired_data.py has the
data side): the control's latents join the sequence as FluxKontextPipeline puts them, the loss
falls, a different control changes the prediction and the sample, and the files load in
FluxKontextPipeline.load_lora_weights."""

from __future__ import annotations

import pytest
import torch
from conftest import fixed_loss, train_config
from family_cross import (
    initializes_and_steps,
    offloaded_training_matches,
    perturbed_adapters,
    resumed_training_matches,
)

from modules.adapters.formats.files import save_adapter_file
from modules.config.loading import build_config
from modules.config.presets import list_presets, load_preset_overlay
from modules.data.synthetic_images import write_edit_pairs
from modules.trainer.generic_trainer import GenericTrainer

PAIRED = {"model": {"family": "flux_kontext"}}


@pytest.fixture(scope="session")
def tiny_kontext(tiny_family_model):
    return tiny_family_model("flux_kontext")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("edit-pairs")
    write_edit_pairs(folder, count=2)
    return folder


def paired(folder) -> dict:
    return {**PAIRED, "concepts": [{"path": str(folder), "controls": {"source": "folders"}}]}


@pytest.fixture(scope="module")
def family(tmp_path_factory, tiny_kontext, shape_images):
    from modules.model.flux_kontext import FluxKontextFamily

    family = FluxKontextFamily(train_config(tiny_kontext, shape_images, tmp_path_factory.mktemp("kontext"), PAIRED))
    family.load()
    return family


def _controls(seed: int) -> torch.Tensor:
    return torch.randn(1, 1, 16, 8, 8, generator=torch.Generator().manual_seed(seed))


def test_the_folder_is_detected_as_kontext(tiny_kontext):
    from modules.model.detect import detect_family

    assert detect_family(tiny_kontext) == "flux_kontext"


def test_kontext_trains_a_lora_on_pairs_and_the_loss_falls(tmp_path, tiny_kontext, pairs):
    config = train_config(tiny_kontext, pairs, tmp_path, paired(pairs), {
        "adapter": {"layer_preset": "all-linear"}, "schedule": {"epochs": 15, "batch_size": 1},
        "optimizer": {"lr": 3e-3}})
    trainer = GenericTrainer(config)
    trainer.start()
    assert trainer.dataset.collate([0], trainer.device).controls.shape == (1, 1, 16, 32, 32)
    before = fixed_loss(trainer, draws=8)
    trainer.train()  # the first step's guard checks every adapter learned
    after = fixed_loss(trainer, draws=8)
    path = trainer.end()
    assert after < before * 0.8, (before, after)
    from safetensors import safe_open

    with safe_open(str(path), "pt") as file:
        assert any(k.startswith("lora_unet_single_blocks_0_linear1.") for k in file.keys())  # noqa: SIM118 (safe_open is no dict)
        assert file.metadata()["modelspec.architecture"] == "flux-1-kontext-dev/lora"


def test_references_are_packed_and_placed_as_the_pipeline_places_them(family):
    """Our token sequence and position ids are FluxKontextPipeline.prepare_latents' (given latents)."""
    from modules.model.flux import image_ids, pack_latents
    from modules.model.flux_kontext import reference_ids

    pipe = family.pipeline()
    control = torch.randn(1, 16, 8, 12, generator=torch.Generator().manual_seed(0))
    # the pipeline's latent height/width are pixels / vae_scale_factor: 8 x 12 latents at 16 x 24 pixels here
    scale = pipe.vae_scale_factor
    _, image_latents, latent_ids, ids = pipe.prepare_latents(control, 1, 16, 6 * scale, 10 * scale, torch.float32,
                                                             torch.device("cpu"), torch.Generator().manual_seed(1))
    assert torch.equal(image_latents, pack_latents(control))
    assert torch.equal(ids, reference_ids(8, 12, "cpu", torch.float32))
    assert torch.equal(latent_ids, image_ids(6, 10, "cpu", torch.float32))


def test_the_control_conditions_the_prediction_and_only_the_target_is_predicted(family):
    latents = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(2))
    text = family.encode_text(family.tokenize(["make the circle red"]))
    with torch.no_grad():
        plain = family.denoise(latents, torch.tensor([0.5]), text)
        first = family.denoise(latents, torch.tensor([0.5]), {**text, "control_latents": _controls(3)})
        again = family.denoise(latents, torch.tensor([0.5]), {**text, "control_latents": _controls(3)})
        other = family.denoise(latents, torch.tensor([0.5]), {**text, "control_latents": _controls(4)})
    assert first.shape == plain.shape == latents.shape
    assert torch.equal(first, again)
    assert (first - other).abs().max() > 1e-3 and (first - plain).abs().max() > 1e-3


def test_encodings_equal_the_pipelines_encode_prompt(family):
    prompt = "make the circle red"
    pipe = family.pipeline()
    hidden, pooled, _ = pipe.encode_prompt(prompt, prompt_2=None, device="cpu",
                                           max_sequence_length=family.max_sequence_length)
    ours = family.encode_text(family.tokenize([prompt]))
    torch.testing.assert_close(ours["hidden_states"], hidden, atol=1e-6, rtol=0)
    torch.testing.assert_close(ours["pooled"], pooled, atol=1e-6, rtol=0)


def test_a_sample_with_another_control_differs(family, pairs):
    from modules.config.train_config import SamplePromptConfig

    def sample(controls):
        prompt = SamplePromptConfig(prompt="make the circle red", steps=2, cfg=2.5, width=64, height=64, seed=3,
                                    control_images=controls)
        return torch.tensor(list(family.sample(prompt, torch.device("cpu")).getdata()), dtype=torch.float32)

    first, second = sorted(str(p) for p in (pairs / "control").glob("*.png"))
    a, again, b, none = sample([first]), sample([first]), sample([second]), sample([])
    assert torch.equal(a, again)
    assert (a - b).abs().max() > 0 and (a - none).abs().max() > 0


def test_a_missing_sample_control_is_named(family, tmp_path):
    from modules.config.train_config import SamplePromptConfig
    from modules.errors import UserError

    prompt = SamplePromptConfig(prompt="x", steps=1, width=64, height=64, control_images=[str(tmp_path / "no.png")])
    with pytest.raises(UserError, match=r"sampling: control image .*no\.png cannot be read"):
        family.sample(prompt, torch.device("cpu"))


def test_the_runs_sample_event_names_the_control_images_it_was_made_from(tmp_path, tiny_kontext, pairs):
    """What the GUI's gallery shows beside a sample (docs/run-protocol.md: `sample`'s control_images)."""
    from modules.trainer.callbacks import TrainCallbacks
    from modules.trainer.outputs import sample

    class Samples(TrainCallbacks):
        def __init__(self):
            self.seen = []

        def on_sample(self, path, control_images=None):
            self.seen.append((path, control_images))

    control = str(pairs / "control" / "000.png")
    small = {"steps": 1, "width": 64, "height": 64}
    config = train_config(tiny_kontext, pairs, tmp_path, paired(pairs), {"sampling": {"prompts": [
        {"prompt": "make it red", "control_images": [control], **small}, {"prompt": "a plain one", **small}]}})
    received = Samples()
    trainer = GenericTrainer(config, callbacks=received)
    trainer.start()
    paths = sample(trainer)
    assert received.seen == [(str(paths[0]), [control]), (str(paths[1]), None)]


def test_load_lora_weights_loads_every_adapter_and_matches_the_hooked_model(family, tiny_kontext, tmp_path):
    from diffusers import FluxKontextPipeline

    adapters = perturbed_adapters(family, ["transformer", "text_encoder"], layer_preset="all-linear")
    latents = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(1))

    def prediction(transformer, clip):
        tokens = family.tokenize(["make the circle red"])
        original = family.parts["transformer"]
        family.parts["transformer"] = transformer
        try:
            with torch.no_grad():
                text = {"pooled": clip(tokens["input_ids"]).pooler_output,
                        "hidden_states": family.parts["text_encoder_2"](tokens["input_ids_2"])[0],
                        "control_latents": _controls(5)}
                return family.denoise(latents, torch.tensor([0.5]), text)
        finally:
            family.parts["transformer"] = original

    try:
        path = tmp_path / "kontext.safetensors"
        save_adapter_file(path, adapters, family, "diffusers", torch.float32, {})
        ours = prediction(family.transformer, family.parts["text_encoder"])
        hooked = {part: sum(1 for p in adapters.part_of.values() if p == part) for part in ("transformer", "text_encoder")}
        pipe = FluxKontextPipeline.from_pretrained(str(tiny_kontext), local_files_only=True)
        pipe.load_lora_weights(str(path))
        loaded = {"transformer": sum(hasattr(m, "lora_A") for m in pipe.transformer.modules()),
                  "text_encoder": sum(hasattr(m, "lora_A") for m in pipe.text_encoder.modules())}
        assert loaded == hooked  # no key dropped
        theirs = prediction(pipe.transformer, pipe.text_encoder)
        adapters.unhook()
        plain = prediction(family.transformer, family.parts["text_encoder"])
        assert (ours - plain).abs().max() > 1e-3
        assert (ours - theirs).abs().max() < 1e-5
    finally:
        adapters.unhook()


def test_offloading_half_the_transformer_trains_the_same_adapter_on_pairs(fake_device, tmp_path, tiny_kontext, pairs):
    offloaded_training_matches(tiny_kontext, pairs, tmp_path, "flux_kontext", "transformer", fake_device, paired(pairs))


@pytest.mark.parametrize("mode", ["float8", "nf4"])
def test_a_quantized_transformer_trains_on_pairs(tmp_path, tiny_kontext, pairs, mode):
    initializes_and_steps(tiny_kontext, pairs, tmp_path, "flux_kontext", "transformer", mode, False, paired(pairs))


def test_resume_on_pairs_equals_an_uninterrupted_run(tmp_path, tiny_kontext, pairs):
    resumed_training_matches(tiny_kontext, pairs, tmp_path, "flux_kontext", paired(pairs))


def test_kontext_presets_are_listed_and_valid():
    names = sorted(p.name for p in list_presets() if p.family == "flux_kontext")
    assert names == ["Flux Kontext LoRA 16GB", "Flux Kontext LoRA 24GB", "Flux Kontext embedding 8GB",
                     "Flux Kontext full fine-tune 12GB"]
    for name in names:
        config = build_config([load_preset_overlay(name)])
        assert config.model.family == "flux_kontext"
        assert config.model.parts["transformer"].gradient_checkpointing
