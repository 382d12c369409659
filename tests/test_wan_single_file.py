"""Wan single files: the tiny Wan written in the original Wan-AI / ComfyUI layouts (the inverse of
diffusers' key map) is told apart by its keys, loads the folder's tensors, and goes through the
weight mode and the keep-in-fp32 list exactly as a folder does; the released size a file holds is
read from its header; the VAE conversion agrees with diffusers' on the released VAE."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import train_config

# diffusers WanTransformer3DModel names -> Wan-AI's (the inverse of convert_wan_transformer_to_diffusers);
# the I2V 14B's image embedder first (its norm2 is not a block's), and its blocks' image cross-attention
_TRANSFORMER = (("condition_embedder.image_embedder.norm1.", "img_emb.proj.0."),
                ("condition_embedder.image_embedder.ff.net.0.proj.", "img_emb.proj.1."),
                ("condition_embedder.image_embedder.ff.net.2.", "img_emb.proj.3."),
                ("condition_embedder.image_embedder.norm2.", "img_emb.proj.4."),
                (".add_k_proj.", ".k_img."), (".add_v_proj.", ".v_img."), (".norm_added_k.", ".norm_k_img."),
                ("condition_embedder.time_embedder.linear_1.", "time_embedding.0."),
                ("condition_embedder.time_embedder.linear_2.", "time_embedding.2."),
                ("condition_embedder.text_embedder.linear_1.", "text_embedding.0."),
                ("condition_embedder.text_embedder.linear_2.", "text_embedding.2."),
                ("condition_embedder.time_proj.", "time_projection.1."), (".attn1.", ".self_attn."),
                (".attn2.", ".cross_attn."), (".to_out.0.", ".o."), (".to_q.", ".q."), (".to_k.", ".k."),
                (".to_v.", ".v."), (".ffn.net.0.proj.", ".ffn.0."), (".ffn.net.2.", ".ffn.2."),
                (".norm2.", ".norm3."), ("proj_out.", "head.head."))


def transformer_to_original(state: dict) -> dict:
    out = {}
    for key, tensor in state.items():
        new = key
        for ours, theirs in _TRANSFORMER:
            new = new.replace(ours, theirs) if not ours.startswith(("condition", "proj_out")) else (
                theirs + new[len(ours):] if new.startswith(ours) else new)
        new = re.sub(r"^blocks\.(\d+)\.scale_shift_table$", r"blocks.\1.modulation", new)
        out["head.modulation" if new == "scale_shift_table" else new] = tensor
    return out


def vae_to_original(state: dict, per_stage: int) -> dict:
    """AutoencoderKLWan names -> the original Wan VAE's (Sequential residual blocks, flat
    down/upsample lists, `per_stage` entries per decoder stage)."""
    residual = {"norm1": "residual.0", "conv1": "residual.2", "norm2": "residual.3", "conv2": "residual.6",
                "conv_shortcut": "shortcut"}
    out = {}
    for key, tensor in state.items():
        new = re.sub(r"\.(norm1|conv1|norm2|conv2|conv_shortcut)\.", lambda m: f".{residual[m[1]]}.", key)
        new = re.sub(r"^(encoder|decoder)\.conv_in\.", r"\1.conv1.", new)
        new = re.sub(r"^(encoder|decoder)\.norm_out\.", r"\1.head.0.", new)
        new = re.sub(r"^(encoder|decoder)\.conv_out\.", r"\1.head.2.", new)
        new = re.sub(r"^(encoder|decoder)\.mid_block\.resnets\.(\d)\.", lambda m: f"{m[1]}.middle.{2 * int(m[2])}.", new)
        new = re.sub(r"^(encoder|decoder)\.mid_block\.attentions\.0\.", r"\1.middle.1.", new)
        new = new.replace("encoder.down_blocks.", "encoder.downsamples.")
        new = re.sub(r"^quant_conv\.", "conv1.", re.sub(r"^post_quant_conv\.", "conv2.", new))
        if match := re.match(r"^decoder\.up_blocks\.(\d+)\.(?:resnets\.(\d+)|upsamplers\.0)\.(.*)$", new):
            index = int(match[2]) if match[2] is not None else per_stage - 1
            new = f"decoder.upsamples.{int(match[1]) * per_stage + index}.{match[3]}"
        out[new] = tensor
    return out


def _folder_state(folder, part):
    from safetensors.torch import load_file

    return load_file(str(next((folder / part).glob("*.safetensors"))))


@pytest.fixture(scope="module")
def tiny_wan(tiny_family_model):
    return tiny_family_model("wan")


@pytest.fixture(scope="module")
def comfy_transformer(tiny_wan, tmp_path_factory):
    """The tiny transformer as ComfyUI's repackaged files hold it (under model.diffusion_model.)."""
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("wan-files") / "wan2.1_t2v_tiny_fp32.safetensors"
    state = transformer_to_original(_folder_state(tiny_wan, "transformer"))
    save_file({"model.diffusion_model." + k: v.contiguous() for k, v in state.items()}, str(path))
    return path


def _file_family(path, tiny_wan, shape_images, tmp_path, parts=None, **transformer):
    from modules.model.wan import WanFamily

    parts = parts or {"text_encoder": {"path": str(tiny_wan / "text_encoder")}, "vae": {"path": str(tiny_wan / "vae")}}
    parts = {**parts, "transformer": transformer}
    config = train_config(path, shape_images, tmp_path, {"model": {"family": "wan", "parts": parts},
                                                         "train_dtype": "bfloat16"})
    family = WanFamily(config, {name: spec.get("weight_dtype", "float32") for name, spec in parts.items()})
    family.model_configs_dir = tiny_wan  # the tiny model's part configs
    return family


@pytest.fixture(scope="module")
def folder_family(tiny_wan, shape_images, tmp_path_factory):
    from modules.model.wan import WanFamily

    family = WanFamily(train_config(tiny_wan, shape_images, tmp_path_factory.mktemp("wan"), {"model": {"family": "wan"}}))
    family.load()
    return family


def _same_tensors(loaded, folder_family, what):
    for part, module in folder_family.parts.items():
        ours, theirs = loaded.parts[part].state_dict(), module.state_dict()
        assert set(ours) == set(theirs), (what, part)
        assert all(torch.equal(ours[k], theirs[k]) for k in ours), (what, part)


def test_the_comfyui_and_wan_ai_transformer_files_load_the_folders_tensors(tmp_path, tiny_wan, shape_images,
                                                                             comfy_transformer, folder_family):
    from safetensors.torch import save_file

    from modules.model.detect import detect_family

    bare = tmp_path / "diffusion_pytorch_model.safetensors"  # Wan-AI's original release: bare keys
    save_file({k: v.contiguous() for k, v in transformer_to_original(_folder_state(tiny_wan, "transformer")).items()},
              str(bare))
    for path in (comfy_transformer, bare):
        assert detect_family(path) == "wan", path.name
        from_file = _file_family(path, tiny_wan, shape_images, tmp_path)
        from_file.load()
        _same_tensors(from_file, folder_family, path.name)


def test_comfyuis_three_files_load_and_a_file_of_another_part_is_named(tmp_path, tiny_wan, shape_images,
                                                                        comfy_transformer, folder_family):
    """ComfyUI ships Wan as three files: the transformer (model.base), the VAE in its original layout
    and UMT5 under transformers' names (model.parts.<part>.path); each loads the folder's tensors.
    A file given for the wrong part is named, from its keys, before any weight loads."""
    from diffusers import AutoencoderKLWan
    from safetensors.torch import save_file

    from modules.loading.diffusers_folder import ModelLoadError
    from modules.model.detect import detect_model, family_mismatch

    vae_model = AutoencoderKLWan.from_pretrained(str(tiny_wan / "vae"))
    vae_file, umt5_file = tmp_path / "wan_2.1_vae.safetensors", tmp_path / "umt5_xxl_tiny.safetensors"
    vae = vae_to_original(_folder_state(tiny_wan, "vae"), len(vae_model.decoder.up_blocks[0].resnets) + 1)
    assert "decoder.upsamples.3.shortcut.weight" in vae and "conv1.weight" in vae  # the original names
    save_file(vae, str(vae_file))
    save_file(_folder_state(tiny_wan, "text_encoder"), str(umt5_file))
    parts = {"text_encoder": {"path": str(umt5_file)}, "vae": {"path": str(vae_file)}}
    from_files = _file_family(comfy_transformer, tiny_wan, shape_images, tmp_path, parts)
    from_files.load()
    _same_tensors(from_files, folder_family, "three files")
    for path, part in ((vae_file, "vae"), (umt5_file, "text_encoder"), (comfy_transformer, None)):
        assert detect_model(path).part == part, path.name
    assert "give this file as model.parts.vae.path" in family_mismatch(vae_file, "wan")
    assert family_mismatch(umt5_file, "wan").endswith("model.parts.text_encoder.path")
    swapped = {"text_encoder": {"path": str(vae_file)}, "vae": {"path": str(umt5_file)}}
    with pytest.raises(ModelLoadError, match=r"model\.parts\.text_encoder\.path: wan_2\.1_vae\.safetensors holds no "
                                             r"text_encoder weights"):
        _file_family(comfy_transformer, tiny_wan, shape_images, tmp_path, swapped).load()


def test_a_single_file_goes_through_the_weight_mode_and_the_keep_in_fp32_list(tmp_path, tiny_wan, shape_images,
                                                                               comfy_transformer):
    """Issue 28: a single-file Wan load once left its fp8 toggle inert. From the file, float8 stores
    the blocks' linears quantized, while WanTransformer3DModel's `_keep_in_fp32_modules` stay float32
    and its `_skip_layerwise_casting_patterns` (the condition embedder) stay dense."""
    from modules.quantization.base import QuantizedLinear

    family = _file_family(comfy_transformer, tiny_wan, shape_images, tmp_path, weight_dtype="float8")
    family.load()
    assert family.from_single_file("transformer")
    transformer = family.transformer
    assert isinstance(transformer.get_submodule("blocks.0.attn1.to_q"), QuantizedLinear)
    assert isinstance(transformer.get_submodule("blocks.1.ffn.net.2"), QuantizedLinear)
    assert not isinstance(transformer.get_submodule("condition_embedder.text_embedder.linear_1"), QuantizedLinear)
    report = family.quantization_reports["transformer"]
    assert "_skip_layerwise_casting_patterns" in report.skipped["condition_embedder.text_embedder.linear_1"]
    state = transformer.state_dict()
    for name in ("scale_shift_table", "blocks.0.scale_shift_table", "blocks.1.norm2.weight",
                 "condition_embedder.time_embedder.linear_1.weight"):
        assert state[name].dtype == torch.float32, name
    assert state["condition_embedder.text_embedder.linear_1.weight"].dtype == torch.bfloat16


def test_a_comfyui_scaled_fp8_file_keeps_its_scales(tmp_path, tiny_wan, shape_images):
    """ComfyUI's wan2.1_*_fp8_scaled files: e4m3 codes in X.weight, the scale in X.scale_weight, a
    `scaled_fp8` marker. Loaded as float8, the weights the blocks' layers stand for are the file's
    codes times its scales (a scale is never dropped)."""
    from safetensors.torch import save_file

    tensors, expected = {"scaled_fp8": torch.zeros(0, dtype=torch.float8_e4m3fn)}, {}
    for key, tensor in transformer_to_original(_folder_state(tiny_wan, "transformer")).items():
        if key.startswith("blocks.") and key.endswith(".weight") and tensor.dim() == 2:
            scale = tensor.abs().max() / 448
            tensors["model.diffusion_model." + key] = codes = (tensor / scale).to(torch.float8_e4m3fn)
            tensors["model.diffusion_model." + key[: -len("weight")] + "scale_weight"] = scale.reshape(1)
            expected[key] = codes.float() * scale
        else:
            tensors["model.diffusion_model." + key] = tensor.contiguous()
    save_file(tensors, str(tmp_path / "wan2.1_t2v_tiny_fp8_scaled.safetensors"))
    family = _file_family(tmp_path / "wan2.1_t2v_tiny_fp8_scaled.safetensors", tiny_wan, shape_images, tmp_path,
                          weight_dtype="float8")
    family.load()
    for ours, theirs in (("blocks.0.attn1.to_q", "blocks.0.self_attn.q"), ("blocks.1.ffn.net.2", "blocks.1.ffn.2")):
        layer = family.transformer.get_submodule(ours)
        assert torch.allclose(layer.unquantized_weight(torch.float32, torch.device("cpu")), expected[theirs + ".weight"])


def test_the_released_size_a_file_holds_picks_its_config(tmp_path, shape_images):
    """A 14B file (5120 wide, 40 blocks: only its header is read) is built from transformer_14b/,
    a 1.3B one (1536, 30) from transformer/; an image-to-video 14B file (36 input channels), which
    no shipped config builds, is named for what it holds before any weight loads."""
    from safetensors.torch import save_file

    from modules.loading.diffusers_folder import ModelLoadError
    from modules.model.wan import WanFamily

    def family_of(width, blocks, channels):
        tensors = {"patch_embedding.weight": torch.zeros(width, channels, 1, 2, 2, dtype=torch.float8_e4m3fn)}
        tensors.update({f"blocks.{i}.self_attn.norm_q.weight": torch.zeros(1) for i in range(blocks)})
        path = tmp_path / f"wan_{width}_{channels}.safetensors"
        save_file(tensors, str(path))
        return WanFamily(train_config(path, shape_images, tmp_path, {"model": {"family": "wan", "parts": {
            "text_encoder": {"path": str(tmp_path)}, "vae": {"path": str(tmp_path)}}}}))

    for width, blocks, folder in ((5120, 40, "transformer_14b"), (1536, 30, "transformer")):
        assert family_of(width, blocks, 16).part_folder("transformer").name == folder
    with pytest.raises(ModelLoadError, match=r"a Wan transformer 5120 wide with 40 blocks \(image-to-video\); no "
                                             r"config in .*transformer\*/ has that architecture"):
        family_of(5120, 40, 36).part_folder("transformer")


def test_the_vae_conversion_agrees_with_diffusers_on_the_released_vae():
    """diffusers' converter spells out the released decoder's indices; ours reads the stage length
    from the model. On the released Wan 2.1 VAE (meta tensors) both give the model's own keys."""
    from pathlib import Path

    from accelerate import init_empty_weights
    from diffusers import AutoencoderKLWan
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    from modules.model.wan_single_file import wan_vae_to_diffusers

    folder = Path(__file__).resolve().parents[1] / "resources" / "model_configs" / "wan" / "vae"
    with init_empty_weights():
        model = AutoencoderKLWan.from_config(AutoencoderKLWan.load_config(str(folder)))
    original = vae_to_original(model.state_dict(), len(model.decoder.up_blocks[0].resnets) + 1)
    assert "decoder.upsamples.12.residual.0.gamma" in original and "encoder.middle.1.to_qkv.weight" in original
    ours = wan_vae_to_diffusers(dict(original), model)
    theirs = convert_wan_vae_to_diffusers(dict(original))
    assert set(ours) == set(theirs) == set(model.state_dict())
    assert all(ours[k] is theirs[k] for k in ours)
