"""Adding a model family is one family file (+ its tiny builder and resources): a toy family
defined only in this file, built from the shared components (CLIP text encoder, SD VAE, a
UNet2DConditionModel, flow matching), registered at runtime, trains a LoRA through the normal
trainer and saves it under the key layout it declares. No other file knows it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors import safe_open

from conftest import fixed_loss, train_config
from modules.errors import UserError
from modules.model.base import ModelFamily, PartSpec
from modules.model.components.clip import (
    clip_encoder_layers,
    clip_input_ids,
    load_clip_text_encoder,
    load_clip_tokenizer,
)
from modules.model.components.flow_matching import FlowMatchingTraining
from modules.model.components.ldm_unet_keys import ldm_unet_module_name
from modules.model.components.unet import unet_checkpoint_blocks
from modules.model.components.vae import encode_latents, load_vae
from modules.model.keys.layout import KOHYA_STEMS, ComfyStems, KeyLayout
from modules.config.families import family_names, register_family, unregister_family
from modules.trainer.generic_trainer import GenericTrainer
from modules.util.torch_utils import make_generator

TOY = "toy_flow"


class ToyFlowFamily(FlowMatchingTraining, ModelFamily):
    """A CLIP-conditioned UNet trained as a rectified flow (the UNet's timestep input is 1000 * sigma)."""

    name = TOY
    label = "Toy flow UNet"
    pipeline_classes = ("ToyFlowPipeline",)  # what its tiny builder writes in model_index.json
    part_specs = (
        PartSpec("text_encoder", "text_encoder", "lora_te"),
        PartSpec("unet", "unet", "lora_unet", default_train=True),
        PartSpec("vae", "vae", None),
    )
    kohya_base_version = "toy_flow"
    modelspec_architecture = "toy-flow/lora"
    key_layout = KeyLayout(text_model_parts=("text_encoder",),
                           comfy={"unet": ComfyStems("diffusion_model.", ldm_unet_module_name),
                                  "text_encoder": KOHYA_STEMS})
    layer_presets = {
        "attn": ([r"^unet\..*\.attn[12]\.(to_q|to_k|to_v|to_out\.0)$"], False),
        "attn-mlp": ([r"^unet\..*\.(attn[12]\.(to_q|to_k|to_v|to_out\.0)|ff\.net\.(0\.proj|2))$",
                      r"^text_encoder\..*\.(self_attn|mlp)\."], False),
        "all-linear": ([r"^(unet|text_encoder)\."], False),
        "all": ([r"^(unet|text_encoder)\."], True),
    }
    nominal_part_parameters = {"text_encoder": 100_000, "unet": 1_000_000, "vae": 1_000_000}
    denoiser_part = "unet"
    text_parts = ("text_encoder",)
    image_parts = ("vae",)

    def load(self) -> None:
        from diffusers import UNet2DConditionModel

        self.parts["text_encoder"] = load_clip_text_encoder(self, "text_encoder")
        self.parts["unet"] = self.load_part("unet", UNet2DConditionModel)
        self.parts["vae"] = load_vae(self)
        self.tokenizer = load_clip_tokenizer(self)
        self.load_flow_scheduler()

    def checkpoint_blocks(self, part: str) -> list[torch.nn.Module]:
        if part == "unet":
            return unet_checkpoint_blocks(self.parts["unet"])
        return clip_encoder_layers(self.parts[part]) if part == "text_encoder" else []

    def encode_images(self, pixels):
        return encode_latents(self.parts["vae"], pixels, self.compute_dtype("vae"))

    def tokenize(self, captions):
        return {"input_ids": clip_input_ids(self.tokenizer, captions)}

    def encode_text(self, tokens):
        encoder = self.parts["text_encoder"]
        return {"hidden_states": encoder(tokens["input_ids"].to(encoder.device))[0]}

    def denoise(self, noisy, sigmas, text):
        dtype = self.compute_dtype("unet")
        return self.parts["unet"](noisy.to(dtype), sigmas * 1000,
                                  encoder_hidden_states=text["hidden_states"].to(dtype)).sample

    @torch.no_grad()
    def run_sampling_pipeline(self, prompt, device):
        # Euler steps of the flow from noise to latents (no classifier-free guidance), then the VAE
        from diffusers import FlowMatchEulerDiscreteScheduler

        scheduler = FlowMatchEulerDiscreteScheduler.from_config(self.noise_scheduler.config)
        scheduler.set_timesteps(prompt.steps, device=device)
        vae = self.parts["vae"]
        text = self.encode_text({k: v.to(device) for k, v in self.tokenize([prompt.prompt]).items()})
        shape = (1, vae.config.latent_channels, prompt.height // 2, prompt.width // 2)
        latents = torch.randn(shape, generator=make_generator(device, prompt.seed), device=device)
        for t in scheduler.timesteps:
            velocity = self.denoise(latents, (t / 1000).expand(1), text)
            latents = scheduler.step(velocity.float(), t, latents).prev_sample
        pixels = vae.decode((latents / vae.config.scaling_factor).to(self.sampling_dtype("vae"))).sample
        array = ((pixels[0].float().clamp(-1, 1) + 1) * 127.5).round().byte().permute(1, 2, 0).cpu().numpy()
        return Image.fromarray(array)

    @classmethod
    def make_tiny_model(cls, out, seed: int = 0) -> Path:
        from diffusers import FlowMatchEulerDiscreteScheduler, UNet2DConditionModel

        from modules.model.tiny.parts import tiny_clip, tiny_sd_vae

        out = Path(out)
        torch.manual_seed(seed)
        tokenizer, text_encoder = tiny_clip(out / "tokenizer")
        tokenizer.save_pretrained(str(out / "tokenizer"))
        text_encoder.save_pretrained(str(out / "text_encoder"))
        UNet2DConditionModel(
            sample_size=32, block_out_channels=(32, 32), layers_per_block=1, norm_num_groups=32,
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=text_encoder.config.hidden_size, attention_head_dim=8,
        ).save_pretrained(str(out / "unet"))
        tiny_sd_vae().save_pretrained(str(out / "vae"))
        FlowMatchEulerDiscreteScheduler(shift=1.0).save_pretrained(str(out / "scheduler"))
        (out / "model_index.json").write_text(json.dumps({"_class_name": "ToyFlowPipeline"}))
        return out


@pytest.fixture(scope="module")
def toy_model(tmp_path_factory):
    register_family(ToyFlowFamily)
    try:
        yield ToyFlowFamily.make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-toy")
    finally:
        unregister_family(TOY)


def test_a_family_registered_at_runtime_trains_a_lora_saves_and_samples(toy_model, one_image, tmp_path):
    config = train_config(toy_model, one_image, tmp_path, {
        "model": {"family": TOY, "parts": {"text_encoder": {"train": True}}},
        "schedule": {"epochs": 4, "batch_size": 1},
        "optimizer": {"lr": 1e-2},
        "sampling": {"prompts": [{"prompt": "a red circle", "steps": 2, "width": 64, "height": 64, "seed": 1}]},
    })
    trainer = GenericTrainer(config)
    trainer.start()
    assert type(trainer.family) is ToyFlowFamily
    before = fixed_loss(trainer, draws=4)
    trainer.train()
    after = fixed_loss(trainer, draws=4)
    [sample] = trainer.sample()
    path = trainer.end()

    assert after < before, (before, after)
    assert Image.open(sample).size == (64, 64)
    with safe_open(str(path), "pt") as file:
        stems = {key.split(".")[0] for key in file.keys()}
        metadata = file.metadata()
    adapters = trainer.adapters
    expected = {trainer.family.adapter_name(adapters.part_of[name], adapters.module_name_of[name])
                for name in adapters.modules}
    assert stems == expected  # the names its declared key layout gives
    assert any(s.startswith("lora_unet_down_blocks_0_attentions_0_") for s in stems)
    assert any(s.startswith("lora_te_text_model_encoder_layers_0_") for s in stems)
    assert metadata["ss_base_model_version"] == "toy_flow" and metadata["difftrainer.family"] == TOY


def test_the_config_knows_a_family_only_while_it_is_registered(toy_model, one_image, tmp_path):
    overlay = {"model": {"family": TOY}}
    assert train_config(toy_model, one_image, tmp_path, overlay).model.parts["unet"].train
    unregister_family(TOY)
    try:
        assert TOY not in family_names()
        with pytest.raises(UserError, match=r"model\.family.*unknown family 'toy_flow'"):
            train_config(toy_model, one_image, tmp_path, overlay)
    finally:
        register_family(ToyFlowFamily)
