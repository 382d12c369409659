"""Chroma kohya files in diffusers' `ChromaPipeline.load_lora_weights`: its converter (shared with
FLUX's sd-scripts one) splits `single_blocks.N.linear1` only at the released widths (3072 inner,
12288 MLP), so one real-width single block is checked; double blocks on a tiny one. Every adapter of
the transformer's attention and MLP loads, and the output equals the trainer's hooked model."""

from __future__ import annotations

import pytest
import torch
from conftest import train_config
from safetensors.torch import load_file

from modules.adapters.adapter_set import build_adapter_set
from modules.adapters.formats.files import save_adapter_file
from modules.config.train_config import AdapterConfig


def _transformer(kind: str):
    from diffusers import ChromaTransformer2DModel

    torch.manual_seed(0)
    if kind == "double":
        config = dict(num_layers=1, num_single_layers=0, attention_head_dim=16, num_attention_heads=2,
                      axes_dims_rope=(4, 6, 6))
    else:  # Chroma's real widths (FLUX's), one single block
        config = dict(num_layers=0, num_single_layers=1, attention_head_dim=128, num_attention_heads=24,
                      axes_dims_rope=(16, 56, 56))
    return ChromaTransformer2DModel(patch_size=1, in_channels=64, joint_attention_dim=32, approximator_hidden_dim=32,
                                    approximator_layers=1, **config).eval()


@pytest.fixture(scope="module", params=["double", "single"])
def family(request, tmp_path_factory, shape_images):
    from modules.model.chroma import ChromaFamily

    family = ChromaFamily(train_config(tmp_path_factory.mktemp("unused-model"), shape_images,
                                       tmp_path_factory.mktemp("chroma-kohya"), {"model": {"family": "chroma"}}))
    family.parts["transformer"] = _transformer(request.param)
    return family


def _output(transformer):
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        return transformer(hidden_states=torch.randn(1, 4, 64, generator=generator),
                           encoder_hidden_states=torch.randn(1, 3, 32, generator=generator),
                           timestep=torch.tensor([0.5]), img_ids=torch.zeros(4, 3), txt_ids=torch.zeros(3, 3),
                           return_dict=False)[0]


@pytest.mark.parametrize("preset", ["attn", "attn-mlp"])
def test_chroma_pipeline_loads_every_layer_and_matches(family, tmp_path, preset):
    from diffusers import ChromaPipeline

    transformer = family.transformer
    plain = _output(transformer)
    adapters = build_adapter_set(family, AdapterConfig(rank=4, alpha=2, layer_preset=preset), ["transformer"],
                                 torch.device("cpu"))
    try:
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for parameter in adapters.parameters():
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
        ours = _output(transformer)
        path = tmp_path / "chroma.safetensors"
        save_adapter_file(path, adapters, family, "kohya", torch.float32, {})
    finally:
        adapters.unhook()
    assert all(k.startswith("lora_unet_") for k in load_file(str(path)))
    pipe = ChromaPipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None, transformer=transformer)
    pipe.load_lora_weights(str(path))
    try:
        theirs = _output(transformer)
        with_lora = {name for name, module in transformer.named_modules() if hasattr(module, "lora_A")}
    finally:
        pipe.unload_lora_weights()
    assert {adapters.module_name_of[n] for n in adapters.modules} <= with_lora  # no adapter dropped
    assert (ours - plain).abs().max() > 1e-3
    assert (ours - theirs).abs().max() < 1e-5, (ours - theirs).abs().max()
