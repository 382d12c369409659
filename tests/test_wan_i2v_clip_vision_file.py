"""Wan 2.1 I2V's CLIP image encoder from one file (issue 28): the tiny wan_i2v's CLIPVisionModel saved
in ComfyUI's layout (as its clip_vision_h.safetensors: transformers 4 names under `vision_model.`
with `visual_projection`) and in OpenCLIP's (`visual.`, q/k/v stacked) loads as
`model.parts.image_encoder.path` and gives the image embeddings of the diffusers folder's encoder;
a tower of another shape (a ViT-L clip_vision_l where ViT-H is wanted) is named by the preflight
and the load before any weight loads."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import train_config
from safetensors.torch import load_file, save_file

from modules.loading.diffusers_folder import ModelLoadError


@pytest.fixture(scope="module")
def tiny(tiny_family_model):
    return tiny_family_model("wan_i2v")


def _family(tiny, images, tmp_path, image_encoder: str | None = None, transformer: str | None = None):
    from modules.model.wan_i2v import WanI2VFamily

    parts = {"image_encoder": {"path": image_encoder}} if image_encoder else {}
    if transformer:
        parts["transformer"] = {"path": transformer}
    family = WanI2VFamily(train_config(tiny, images, tmp_path, {"model": {"family": "wan_i2v", "parts": parts}}))
    family.model_configs_dir = tiny  # the tiny model's image_encoder config stands for the released ViT-H's
    return family


def _to_open_clip(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 4 CLIP vision names -> OpenCLIP's `visual.` layout (the inverse of ComfyUI's conversion)."""
    names = {"embeddings.class_embedding": "class_embedding", "embeddings.patch_embedding.weight": "conv1.weight",
             "embeddings.position_embedding.weight": "positional_embedding", "pre_layrnorm.weight": "ln_pre.weight",
             "pre_layrnorm.bias": "ln_pre.bias", "post_layernorm.weight": "ln_post.weight",
             "post_layernorm.bias": "ln_post.bias"}
    block = {"layer_norm1": "ln_1", "layer_norm2": "ln_2", "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj",
             "self_attn.out_proj": "attn.out_proj"}
    out, layers = {}, {int(m.group(1)) for k in state if (m := re.match(r"vision_model\.encoder\.layers\.(\d+)\.", k))}
    for key, tensor in state.items():
        name = key.removeprefix("vision_model.")
        if name in names:
            out["visual." + names[name]] = tensor
        elif match := re.match(r"encoder\.layers\.(\d+)\.(.+)\.(weight|bias)$", name):
            layer, inner, kind = match.groups()
            if inner in block:
                out[f"visual.transformer.resblocks.{layer}.{block[inner]}.{kind}"] = tensor
    for layer in layers:
        for kind in ("weight", "bias"):
            out[f"visual.transformer.resblocks.{layer}.attn.in_proj_{kind}"] = torch.cat(
                [state[f"vision_model.encoder.layers.{layer}.self_attn.{p}_proj.{kind}"] for p in "qkv"])
    out["visual.proj"] = torch.randn(state["vision_model.post_layernorm.weight"].shape[0], 16)
    assert len(out) == len(state) + 1 - 6 * len(layers) + 2 * len(layers)  # q, k, v fused; the projection added
    return out


def test_comfyui_and_open_clip_files_give_the_folders_image_embeddings(tiny, shape_images, tmp_path):
    folder_state = load_file(str(tiny / "image_encoder" / "model.safetensors"))
    assert all(k.startswith("vision_model.") for k in folder_state)  # transformers 4 names, ComfyUI's layout
    projection = torch.randn(16, folder_state["vision_model.post_layernorm.weight"].shape[0])
    comfy, open_clip = tmp_path / "clip_vision_h.safetensors", tmp_path / "open_clip_vit_h.safetensors"
    save_file({**folder_state, "visual_projection.weight": projection}, str(comfy))
    save_file(_to_open_clip(folder_state), str(open_clip))

    frames = torch.rand(2, 3, 40, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    reference = _family(tiny, shape_images, tmp_path)
    reference.load()
    expected = reference.image_embeddings(frames)
    for path in (comfy, open_clip):
        family = _family(tiny, shape_images, tmp_path, image_encoder=str(path))
        family.load()
        assert family.from_single_file("image_encoder") and not family.from_single_file("transformer"), path.name
        loaded = family.parts["image_encoder"].state_dict()
        assert set(loaded) == set(reference.parts["image_encoder"].state_dict()), path.name
        assert torch.equal(family.image_embeddings(frames), expected), path.name


def _vit_l_header(path, layout: str = "vision_model."):
    """A header-only ViT-L/14 file (ComfyUI's clip_vision_l): 1024 wide, 24 layers, 257 positions."""
    tensors = {f"{layout}encoder.layers.{i}.layer_norm1.weight": torch.zeros(1024, dtype=torch.float8_e4m3fn)
               for i in range(24)}
    tensors[f"{layout}embeddings.patch_embedding.weight"] = torch.zeros(1024, 3, 14, 14, dtype=torch.float8_e4m3fn)
    tensors[f"{layout}embeddings.position_embedding.weight"] = torch.zeros(257, 1024, dtype=torch.float8_e4m3fn)
    save_file(tensors, str(path))
    return path


def test_a_vit_l_file_is_named_by_the_preflight_and_before_any_weight_loads(tiny, shape_images, tmp_path, monkeypatch):
    from modules.model.wan_i2v import WanI2VFamily
    from modules.trainer.preflight import _model_problems

    vit_l = _vit_l_header(tmp_path / "clip_vision_l.safetensors")
    config = train_config(tiny, shape_images, tmp_path, {"model": {
        "family": "wan_i2v", "parts": {"image_encoder": {"path": str(vit_l)}}}})
    # no model_configs_dir: the released ViT-H/14 config of resources/model_configs/wan_i2v/image_encoder/
    message = (r"^model\.parts\.image_encoder\.path: clip_vision_l\.safetensors holds a CLIP vision tower 1024 wide "
               r"with 24 layers over 14-pixel patches at 224 px \(ViT-L/14\); Wan 2.1 I2V 14B encodes its images "
               r"with a CLIP vision tower 1280 wide with 32 layers over 14-pixel patches at 224 px \(ViT-H/14\): "
               r"name clip_vision_h\.safetensors")
    problems, _ = _model_problems(config)
    assert any(re.match(message, str(problem)) for problem in problems), problems
    loaded = []
    monkeypatch.setattr(WanI2VFamily, "load_part", lambda self, part, *a, **k: loaded.append(part))
    with pytest.raises(ModelLoadError, match=message):
        WanI2VFamily(config).load()
    assert loaded == []

