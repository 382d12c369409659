"""An adapter.init_from file of another model family is refused by the preflight, before the base
model loads, naming the file and the family its header or its keys say it belongs to
(modules/trainer/init_from_family.py)."""

from __future__ import annotations

import torch
from safetensors.torch import save_file

from conftest import train_config
from modules.trainer.preflight import preflight_problems


def _lora(path, stems, metadata=None):
    tensors = {}
    for stem in stems:
        tensors[f"{stem}.lora_down.weight"] = torch.zeros(4, 8)
        tensors[f"{stem}.lora_up.weight"] = torch.zeros(8, 4)
        tensors[f"{stem}.alpha"] = torch.tensor(4.0)
    save_file(tensors, str(path), metadata=metadata)
    return path


def _init_from_lines(tiny_model, shape_images, tmp_path, init_from):
    config = train_config(tiny_model, shape_images, tmp_path, {"adapter": {"init_from": str(init_from)}})
    return [line for line in preflight_problems(config) if line.startswith("adapter.init_from")]


# sd-scripts' FLUX.1 LoRA names the original (BFL) layers, with no header saying whose it is
FLUX_STEMS = ("lora_unet_double_blocks_0_img_attn_qkv", "lora_unet_single_blocks_3_linear1")


def test_a_flux_lora_without_a_header_is_named_from_its_keys_before_an_sd15_run_loads(tiny_model, shape_images,
                                                                                      tmp_path):
    path = _lora(tmp_path / "flux-style.safetensors", FLUX_STEMS)
    (line,) = _init_from_lines(tiny_model, shape_images, tmp_path, path)
    assert line.startswith("adapter.init_from: flux-style.safetensors: none of its 6 keys names a layer of ")
    assert "it is an adapter of FLUX.1 (model.family 'flux': 6 of its keys name that model's layers)" in line
    assert line.endswith("this run trains model.family 'sd15'")


def test_a_lora_whose_header_names_sdxl_is_named_so(tiny_model, shape_images, tmp_path):
    path = _lora(tmp_path / "xl.safetensors", ("lora_unet_input_blocks_4_1_transformer_blocks_9_attn1_to_q",),
                 {"ss_base_model_version": "sdxl_base_v1-0"})
    (line,) = _init_from_lines(tiny_model, shape_images, tmp_path, path)
    assert "it is an adapter of Stable Diffusion XL (model.family 'sdxl': its header says so)" in line


def test_a_lora_of_the_run_s_own_family_passes(tiny_model, shape_images, tmp_path):
    # the same header as above (a mislabelled file) but keys of SD 1.5's layers: the keys decide
    path = _lora(tmp_path / "own.safetensors", ("lora_unet_down_blocks_0_attentions_0_proj_in",
                                                "lora_te_text_model_encoder_layers_0_self_attn_q_proj"),
                 {"ss_base_model_version": "sdxl_base_v1-0"})
    assert _init_from_lines(tiny_model, shape_images, tmp_path, path) == []
