"""FLUX kohya files: LoRA on the transformer is written on BFL's original layers (fused q/k/v and
linear1 block-diagonal, formats/fused.py), which diffusers' `FluxPipeline.load_lora_weights`
converts for every layer of every layer preset: no key ignored, output equal to the trainer's
hooked model. diffusers splits `single_blocks.N.linear1` only at the released widths (its
converter hard-codes 3072/12288), so single blocks are checked on a real-width block, double
blocks on a tiny one (the embedders of all-linear it drops, see below). The file loads back into per-module adapters (continuing training)."""

from __future__ import annotations

import pytest
import torch
from conftest import train_config
from safetensors.torch import load_file

from modules.adapters.adapter_set import build_adapter_set
from modules.adapters.formats.files import load_adapter_file, save_adapter_file
from modules.config.train_config import AdapterConfig

PRESETS = ["attn", "attn-mlp", "all-linear"]
# diffusers 0.42's kohya-FLUX converter maps the embedders and the final layer (all-linear)
# without the `transformer.` prefix, so it drops them: README's table says so
DIFFUSERS_PRESETS = ["attn", "attn-mlp"]


def _transformer(kind: str):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    if kind == "double":  # tiny widths: diffusers splits a double block's qkv at any width
        config = dict(num_layers=1, num_single_layers=0, attention_head_dim=16, num_attention_heads=2,
                      axes_dims_rope=(4, 6, 6), guidance_embeds=True)
    else:  # FLUX.1's real widths (3072 inner, 12288 MLP), one single block
        config = dict(num_layers=0, num_single_layers=1, attention_head_dim=128, num_attention_heads=24,
                      axes_dims_rope=(16, 56, 56), guidance_embeds=False)
    return FluxTransformer2DModel(patch_size=1, in_channels=64, joint_attention_dim=32, pooled_projection_dim=32,
                                  **config).eval()


@pytest.fixture(scope="module", params=["double", "single"])
def family(request, tmp_path_factory, shape_images):
    from modules.model.flux import FluxFamily

    # the family needs a config only; its transformer is set here, not loaded
    family = FluxFamily(train_config(tmp_path_factory.mktemp("unused-model"), shape_images,
                                     tmp_path_factory.mktemp("flux-kohya"), {"model": {"family": "flux"}}))
    family.parts["transformer"] = _transformer(request.param)
    return family


def _perturbed(family, preset, seed=0):
    adapters = build_adapter_set(family, AdapterConfig(rank=4, alpha=2, layer_preset=preset), ["transformer"],
                                 torch.device("cpu"))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in adapters.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return adapters


def _output(transformer):
    generator = torch.Generator().manual_seed(1)
    guidance = torch.tensor([1.0]) if transformer.config.guidance_embeds else None
    with torch.no_grad():
        return transformer(
            hidden_states=torch.randn(1, 4, 64, generator=generator),
            encoder_hidden_states=torch.randn(1, 3, 32, generator=generator),
            pooled_projections=torch.randn(1, 32, generator=generator), timestep=torch.tensor([0.5]),
            guidance=guidance, img_ids=torch.zeros(4, 3), txt_ids=torch.zeros(3, 3), return_dict=False)[0]


@pytest.mark.parametrize("preset", DIFFUSERS_PRESETS)
def test_diffusers_loads_every_layer_and_matches(family, tmp_path, preset):
    from diffusers import FluxPipeline

    transformer = family.transformer
    plain = _output(transformer)
    adapters = _perturbed(family, preset)
    try:
        ours = _output(transformer)
        path = tmp_path / "flux.safetensors"
        save_adapter_file(path, adapters, family, "kohya", torch.float32, {})
    finally:
        adapters.unhook()
    keys = load_file(str(path))
    assert all(k.startswith("lora_unet_") for k in keys), sorted(keys)[:4]  # sd-scripts' names only
    pipe = FluxPipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None, text_encoder_2=None,
                        tokenizer_2=None, transformer=transformer)
    pipe.load_lora_weights(str(path))
    try:
        theirs = _output(transformer)
        with_lora = {name for name, module in transformer.named_modules() if hasattr(module, "lora_A")}
    finally:
        pipe.unload_lora_weights()
    # no key ignored: every adapted module got its LoRA (and only zero blocks besides)
    assert {adapters.module_name_of[n] for n in adapters.modules} <= with_lora
    assert (ours - plain).abs().max() > 1e-3
    assert (ours - theirs).abs().max() < 1e-5, (ours - theirs).abs().max()


@pytest.mark.parametrize("preset", PRESETS)
def test_the_fused_file_loads_back_into_per_module_adapters(family, tmp_path, preset):
    adapters = _perturbed(family, preset, seed=0)
    try:
        state = adapters.state_dict()
        path = tmp_path / "flux.safetensors"
        save_adapter_file(path, adapters, family, "kohya", torch.float32, {})
    finally:
        adapters.unhook()
    again = _perturbed(family, preset, seed=5)
    try:
        load_adapter_file(path, again, family)
        for key, tensor in again.state_dict().items():
            assert torch.allclose(tensor, state[key], atol=1e-7), key
    finally:
        again.unhook()


def test_a_dense_fused_lora_from_sd_scripts_loads_exactly(family, tmp_path):
    """sd-scripts without split_qkv: one down shared by q, k, v (and the MLP input)."""
    from safetensors.torch import save_file

    transformer = family.transformer
    single = len(transformer.single_transformer_blocks) > 0
    stem, members = (("lora_unet_single_blocks_0_linear1",
                      ["attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"]) if single else
                     ("lora_unet_double_blocks_0_img_attn_qkv", ["attn.to_q", "attn.to_k", "attn.to_v"]))
    block = transformer.single_transformer_blocks[0] if single else transformer.transformer_blocks[0]
    modules = dict(block.named_modules())
    rows = sum(modules[m].out_features for m in members)
    generator = torch.Generator().manual_seed(2)
    down = torch.randn(4, modules[members[0]].in_features, generator=generator) * 0.02
    up = torch.randn(rows, 4, generator=generator) * 0.02
    path = tmp_path / "dense.safetensors"
    save_file({f"{stem}.lora_down.weight": down, f"{stem}.lora_up.weight": up, f"{stem}.alpha": torch.tensor(2.0)},
              str(path))
    prefix = "single_transformer_blocks.0." if single else "transformer_blocks.0."
    config = AdapterConfig(rank=4, alpha=4, layer_filter=[rf"^transformer\.{prefix}({'|'.join(members)})$"])
    adapters = build_adapter_set(family, config, ["transformer"], torch.device("cpu"))
    try:
        load_adapter_file(path, adapters, family)
        delta = torch.cat([adapters.modules[family.adapter_name("transformer", prefix + m)].delta_weight()
                           for m in members])
    finally:
        adapters.unhook()
    assert torch.allclose(delta, up @ down * 0.5, atol=1e-7)


def test_the_run_names_the_layers_diffusers_drops_from_an_all_linear_file(family, tmp_path):
    """What format_warnings says diffusers will not load is what its converter leaves without
    the `transformer.` prefix (README's table: all-linear's embedders and final layer)."""
    import re

    from diffusers import FluxPipeline

    from modules.adapters.formats.files import format_warnings

    adapters = _perturbed(family, "all-linear")
    try:
        path = tmp_path / "flux.safetensors"
        save_adapter_file(path, adapters, family, "kohya", torch.float32, {})
        warnings = format_warnings("kohya", adapters, family)
        assert format_warnings("diffusers", adapters, family) == []  # peft keys name every layer
    finally:
        adapters.unhook()
    converted = FluxPipeline.lora_state_dict(str(path))
    dropped = sorted({k.split(".lora_")[0] for k in converted if not k.startswith("transformer.")})
    assert dropped
    assert len(warnings) == 1 and "diffusers' load_lora_weights will not load" in warnings[0]
    assert "adapter.layer_preset" in warnings[0] and "output.format: 'kohya'" in warnings[0]
    assert f"{len(dropped)} of these adapters" in warnings[0]
    assert re.search(r"\(e\.g\. transformer\.([^)]*)\)", warnings[0]).group(1) in dropped
