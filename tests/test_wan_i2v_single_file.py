"""Wan 2.1 I2V 14B from single files (issue 28): the tiny wan_i2v's transformer written in the original
Wan-AI layout (image cross-attention `cross_attn.k_img` / `v_img`, the image embedder `img_emb.proj.*`),
bare and under ComfyUI's `model.diffusion_model.`, is told from a T2V file and from a Wan 2.2 I2V
expert by its keys, loads the folder's tensors, and goes through the weight mode; a file whose
architecture no released config has is named before any weight loads."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import train_config
from test_wan_single_file import transformer_to_original

from modules.loading.diffusers_folder import ModelLoadError


def _folder_state(folder, part):
    from safetensors.torch import load_file

    return load_file(str(next((folder / part).glob("*.safetensors"))))


@pytest.fixture(scope="module")
def tiny_i2v(tiny_family_model):
    return tiny_family_model("wan_i2v")


@pytest.fixture(scope="module")
def i2v_files(tiny_i2v, tmp_path_factory):
    """(ComfyUI's file, Wan-AI's bare one) of the tiny I2V transformer."""
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("wan-i2v-files")
    state = transformer_to_original(_folder_state(tiny_i2v, "transformer"))
    assert "blocks.1.cross_attn.k_img.weight" in state and "img_emb.proj.4.weight" in state  # the original names
    comfy, bare = folder / "wan2.1_i2v_480p_tiny_fp32.safetensors", folder / "diffusion_pytorch_model.safetensors"
    save_file({"model.diffusion_model." + k: v.contiguous() for k, v in state.items()}, str(comfy))
    save_file({k: v.contiguous() for k, v in state.items()}, str(bare))
    return comfy, bare


def _file_family(path, tiny_i2v, images, tmp_path, **transformer):
    from modules.model.wan_i2v import WanI2VFamily

    parts = {part: {"path": str(tiny_i2v / part)} for part in ("text_encoder", "image_encoder", "vae")}
    parts["transformer"] = transformer
    config = train_config(path, images, tmp_path, {"model": {"family": "wan_i2v", "parts": parts},
                                                   "train_dtype": "bfloat16"})
    family = WanI2VFamily(config, {name: spec.get("weight_dtype", "float32") for name, spec in parts.items()})
    family.model_configs_dir = tiny_i2v  # the tiny model's part configs stand for resources/model_configs/wan_i2v/
    return family


def _header_file(path, channels, image_width=None):
    """A file of the released width (5120, 40 blocks) with only its header's shapes to read."""
    from safetensors.torch import save_file

    tensors = {"patch_embedding.weight": torch.zeros(5120, channels, 1, 2, 2, dtype=torch.float8_e4m3fn),
               **{f"blocks.{i}.self_attn.norm_q.weight": torch.zeros(1) for i in range(40)}}
    if image_width:
        tensors["img_emb.proj.1.weight"] = torch.zeros(image_width, image_width, dtype=torch.float8_e4m3fn)
        tensors["blocks.0.cross_attn.k_img.weight"] = torch.zeros(1, dtype=torch.float8_e4m3fn)
    save_file(tensors, str(path))
    return path


def test_the_comfyui_and_wan_ai_i2v_files_are_told_apart_and_load_the_folders_tensors(tmp_path, tiny_i2v,
                                                                                     shape_images, i2v_files):
    from modules.model.detect import detect_family, family_mismatch

    t2v = _header_file(tmp_path / "wan2.1_t2v_14B.safetensors", 16)
    expert = _header_file(tmp_path / "wan2.2_i2v_high_noise_14B.safetensors", 36)  # 36 channels, no img_emb
    assert [detect_family(p) for p in (*i2v_files, t2v, expert)] == ["wan_i2v", "wan_i2v", "wan", "wan22_i2v"]
    assert "set model.family to 'wan_i2v'" in family_mismatch(i2v_files[0], "wan")
    assert "set model.family to 'wan'" in family_mismatch(t2v, "wan_i2v")
    assert "set model.family to 'wan22_i2v'" in family_mismatch(expert, "wan_i2v")
    folder = _folder_state(tiny_i2v, "transformer")
    for path in i2v_files:
        family = _file_family(path, tiny_i2v, shape_images, tmp_path)
        family.load()
        assert family.from_single_file("transformer") and not family.from_single_file("image_encoder")
        loaded = family.transformer.state_dict()
        assert set(loaded) == set(folder), path.name
        assert all(torch.equal(loaded[k], folder[k]) for k in folder), path.name


def test_an_i2v_file_goes_through_the_weight_mode(tmp_path, tiny_i2v, shape_images, i2v_files):
    """As for Wan 2.1 T2V (test_wan_single_file.py): from the file, float8 stores the blocks' linears,
    the image cross-attention's included, quantized; the image embedder (in WanTransformer3DModel's
    `_skip_layerwise_casting_patterns`, the condition embedder) stays dense."""
    from modules.quantization.base import QuantizedLinear

    family = _file_family(i2v_files[0], tiny_i2v, shape_images, tmp_path, weight_dtype="float8")
    family.load()
    transformer = family.transformer
    for name in ("blocks.0.attn2.add_k_proj", "blocks.1.attn2.add_v_proj", "blocks.0.attn1.to_q", "blocks.1.ffn.net.2"):
        assert isinstance(transformer.get_submodule(name), QuantizedLinear), name
    embedder = "condition_embedder.image_embedder.ff.net.0.proj"
    assert not isinstance(transformer.get_submodule(embedder), QuantizedLinear)
    assert "_skip_layerwise_casting_patterns" in family.quantization_reports["transformer"].skipped[embedder]


def test_the_released_i2v_shape_picks_its_config_and_another_is_named_before_any_weight_loads(tmp_path, shape_images,
                                                                                              monkeypatch):
    """A header-only file of the released I2V 14B (5120 wide, 40 blocks, 36 channels, a 1280-wide image
    embedder) is built from resources/model_configs/wan_i2v/transformer/; one with another image width
    is named for what it holds by the preflight and by the load, before any part loads."""
    from modules.model.wan_i2v import WanI2VFamily
    from modules.trainer.preflight import _model_problems

    def config(path):
        parts = {part: {"path": str(tmp_path)} for part in ("text_encoder", "image_encoder", "vae")}
        return train_config(path, shape_images, tmp_path, {"model": {"family": "wan_i2v", "parts": parts}})

    released = _header_file(tmp_path / "wan2.1_i2v_720p_14B_fp8.safetensors", 36, 1280)
    folder = WanI2VFamily(config(released)).part_folder("transformer")
    assert (folder.parent.name, folder.name) == ("wan_i2v", "transformer")
    other = _header_file(tmp_path / "wan_i2v_other.safetensors", 36, 1024)
    message = (r"^model\.base: the file holds a Wan transformer 5120 wide with 40 blocks \(image-to-video, with an "
               r"image embedder 1024 wide\); no config in .*transformer\*/ has that architecture")
    problems, _ = _model_problems(config(other))
    assert any(re.match(message, str(problem)) for problem in problems), problems
    loaded = []
    monkeypatch.setattr(WanI2VFamily, "load_part", lambda self, part, *a, **k: loaded.append(part))
    with pytest.raises(ModelLoadError, match=message):
        WanI2VFamily(config(other)).load()
    assert loaded == []
