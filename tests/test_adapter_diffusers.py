"""diffusers loads the files we write for SD1.5 and computes what the trainer's hooked model does.

- LoRA as kohya keys and as diffusers keys: `StableDiffusionPipeline.load_lora_weights`, UNet
  (Linear and Conv2d layers) and text encoder.
- DoRA as diffusers keys: `load_lora_weights`, UNet. (diffusers 0.42 drops kohya `dora_scale`
  for SD1.5 with a warning, and on transformers 5 its text-encoder path loses peft's magnitude.)
- LoKr as diffusers keys: diffusers' model-level LoKr loader `unet.load_lora_adapter` (its
  pipeline-level `load_lora_weights` for SD1.5 accepts only LoRA keys, and its LoKr loader only
  Linear layers). LoHa and OFT: diffusers has no loader for SD1.5.
"""

from __future__ import annotations

import pytest
import torch
from conftest import train_config
from safetensors.torch import load_file

from modules.adapters.adapter_set import build_adapter_set
from modules.adapters.formats.files import save_adapter_file
from modules.config.train_config import AdapterConfig


@pytest.fixture(scope="module")
def family(tmp_path_factory, tiny_model, shape_images):
    from modules.model.sd15 import SD15Family

    family = SD15Family(train_config(tiny_model, shape_images, tmp_path_factory.mktemp("diffusers")))
    family.load()
    for part in family.parts.values():
        part.eval()
    return family


def pipeline(tiny_model):
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(str(tiny_model), safety_checker=None, local_files_only=True)
    pipe.unet.eval()
    pipe.text_encoder.eval()
    return pipe


def written(family, tmp_path, fmt, parts, **options):
    """Perturbed adapters saved in `fmt`; returns (path, adapters), the adapters still hooked."""
    config = AdapterConfig(**{"rank": 4, "alpha": 2, **options})
    adapters = build_adapter_set(family, config, parts, torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in adapters.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    path = tmp_path / f"adapter-{fmt}.safetensors"
    save_adapter_file(path, adapters, family, fmt, torch.float32, {})
    return path, adapters


def compare(family, pipe, adapters, with_text: bool):
    ids = family.tokenize(["a red circle on a blue background"])["input_ids"]
    latents = torch.randn(1, 4, 32, 32, generator=torch.Generator().manual_seed(1))
    timestep = torch.tensor([500])
    with torch.no_grad():
        ours_text = family.encode_text({"input_ids": ids})["hidden_states"]
        ours = family.unet(latents, timestep, encoder_hidden_states=ours_text).sample
        theirs = pipe.unet(latents, timestep, encoder_hidden_states=ours_text).sample
        theirs_text = pipe.text_encoder(ids)[0]
        adapters.unhook()
        plain_text = family.encode_text({"input_ids": ids})["hidden_states"]
        plain = family.unet(latents, timestep, encoder_hidden_states=ours_text).sample
    assert (ours - plain).abs().max() > 1e-2  # the adapter does something worth matching
    assert (ours - theirs).abs().max() < 1e-5
    if with_text:
        assert (ours_text - plain_text).abs().max() > 1e-2
        assert (ours_text - theirs_text).abs().max() < 1e-5


@pytest.mark.parametrize("fmt, options, parts", [
    ("kohya", {}, ["unet", "text_encoder"]),
    ("diffusers", {}, ["unet", "text_encoder"]),
    ("diffusers", {"dora": True, "dora_axis": "output"}, ["unet"]),
], ids=["kohya-lora", "diffusers-lora", "diffusers-dora"])
def test_load_lora_weights_matches_the_hooked_model(family, tiny_model, tmp_path, fmt, options, parts):
    path, adapters = written(family, tmp_path, fmt, parts, layer_preset="all", **options)
    try:
        pipe = pipeline(tiny_model)
        pipe.load_lora_weights(str(path))
        compare(family, pipe, adapters, with_text="text_encoder" in parts)
    finally:
        adapters.unhook()


@pytest.mark.parametrize("options", [{"rank": 2}, {"rank": 1, "decompose_both": True, "factor": 4},
                                     {"rank": 2, "full_matrix": True}], ids=["default", "both-factor4", "full"])
def test_lokr_loads_with_diffusers_lokr_loader_and_matches(family, tiny_model, tmp_path, options):
    path, adapters = written(family, tmp_path, "diffusers", ["unet"], type="lokr", layer_preset="attn-mlp", **options)
    try:
        pipe = pipeline(tiny_model)
        pipe.unet.load_lora_adapter(load_file(str(path)), prefix="unet")
        compare(family, pipe, adapters, with_text=False)
    finally:
        adapters.unhook()


def test_loha_in_diffusers_layout_loads_into_peft_and_matches(family, tiny_model, tmp_path):
    """diffusers has no LoHa loader; peft's LoHa takes the file's keys (alpha = rank: scale folded in)."""
    from peft import LoHaConfig, inject_adapter_in_model, set_peft_model_state_dict

    path, adapters = written(family, tmp_path, "diffusers", ["unet"], type="loha", layer_preset="all")
    try:
        state = {k.removeprefix("unet."): v for k, v in load_file(str(path)).items()}
        modules = sorted({k.rpartition(".hada_")[0] for k in state})
        pipe = pipeline(tiny_model)
        inject_adapter_in_model(LoHaConfig(r=4, alpha=4, target_modules=modules), pipe.unet)
        result = set_peft_model_state_dict(pipe.unet, state)
        assert not result.unexpected_keys
        pipe.unet.eval()
        compare(family, pipe, adapters, with_text=False)
    finally:
        adapters.unhook()
