"""Single-file checkpoints in the original layout (SD1.5: ldm; SDXL: sgm with OpenCLIP-G) load to
the same tensors as the diffusers folder they were written from; a part the file lacks is named
with the dotted config path that supplies it; ComfyUI scaled-fp8 weights keep their scales."""

from __future__ import annotations

import shutil

from pathlib import Path

import pytest
import torch
from conftest import train_config
from safetensors.torch import load_file, save_file

from modules.loading.diffusers_folder import ModelLoadError
from modules.model.keys.sdxl import sdxl_ldm_unet_module_name

# --- writing the original layout (the reverse of diffusers' converters) -----------------------


def _unet_to_ldm(unet, state: dict) -> dict:
    out = {}
    for key, tensor in state.items():
        module, _, attr = key.rpartition(".")
        out[f"model.diffusion_model.{sdxl_ldm_unet_module_name(unet, module)}.{attr}"] = tensor
    return out


_VAE_ATTENTION = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}


def _vae_to_ldm(vae, state: dict) -> dict:
    import re

    levels = len(vae.config.block_out_channels)
    out = {}
    for key, tensor in state.items():
        new = key.replace("conv_shortcut", "nin_shortcut").replace("conv_norm_out", "norm_out")
        new = re.sub(r"encoder\.down_blocks\.(\d+)\.resnets\.", r"encoder.down.\1.block.", new)
        new = re.sub(r"encoder\.down_blocks\.(\d+)\.downsamplers\.0\.", r"encoder.down.\1.downsample.", new)
        new = re.sub(r"decoder\.up_blocks\.(\d+)\.resnets\.",
                     lambda m: f"decoder.up.{levels - 1 - int(m.group(1))}.block.", new)
        new = re.sub(r"decoder\.up_blocks\.(\d+)\.upsamplers\.0\.",
                     lambda m: f"decoder.up.{levels - 1 - int(m.group(1))}.upsample.", new)
        new = re.sub(r"mid_block\.resnets\.(\d+)\.", lambda m: f"mid.block_{int(m.group(1)) + 1}.", new)
        if "mid_block.attentions.0." in new:
            head, _, rest = new.partition("mid_block.attentions.0.")
            module, _, attr = rest.rpartition(".")
            new = f"{head}mid.attn_1.{_VAE_ATTENTION[module]}.{attr}"
            if attr == "weight" and module != "group_norm":
                tensor = tensor[:, :, None, None]  # 1x1 convolutions in the original
        out["first_stage_model." + new] = tensor
    return out


def _clip_to_ldm(state: dict, prefix: str) -> dict:
    return {prefix + ("" if k.startswith("text_model.") else "text_model.") + k: v
            for k, v in state.items() if not k.endswith("position_ids")}


def _open_clip_to_ldm(state: dict, prefix: str) -> dict:
    out = {}
    names = {"layer_norm1": "ln_1", "layer_norm2": "ln_2", "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj",
             "self_attn.out_proj": "attn.out_proj"}
    for key, tensor in state.items():
        if key.endswith("position_ids"):
            continue
        if key == "text_projection.weight":
            out[prefix + "text_projection"] = tensor.T.contiguous()
        elif key == "text_model.embeddings.token_embedding.weight":
            out[prefix + "token_embedding.weight"] = tensor
        elif key == "text_model.embeddings.position_embedding.weight":
            out[prefix + "positional_embedding"] = tensor
        elif key.startswith("text_model.final_layer_norm."):
            out[prefix + "ln_final." + key.rpartition(".")[2]] = tensor
        elif ".self_attn.q_proj." in key:
            layer, attr = key.split(".")[3], key.rpartition(".")[2]
            parts = [state[key.replace("q_proj", p)] for p in ("q_proj", "k_proj", "v_proj")]
            out[f"{prefix}transformer.resblocks.{layer}.attn.in_proj_{attr}"] = torch.cat(parts)
        elif ".self_attn.k_proj." in key or ".self_attn.v_proj." in key:
            continue
        else:
            layer, rest = key.split(".")[3], key.split(".", 4)[4]
            for old, new in names.items():
                rest = rest.replace(old, new)
            out[f"{prefix}transformer.resblocks.{layer}.{rest}"] = tensor
    return out


def _folder_state(folder: Path) -> dict:
    return load_file(str(next(folder.glob("*.safetensors"))))


def write_original_layout(model_folder: Path, family: str, path: Path, skip: tuple[str, ...] = ()) -> Path:
    """The tiny diffusers model at `model_folder` as one original-layout .safetensors file."""
    from diffusers import AutoencoderKL, UNet2DConditionModel

    unet = UNet2DConditionModel.from_pretrained(str(model_folder / "unet"))
    vae = AutoencoderKL.from_pretrained(str(model_folder / "vae"))
    tensors = {**_unet_to_ldm(unet, _folder_state(model_folder / "unet")),
               **_vae_to_ldm(vae, _folder_state(model_folder / "vae"))}
    if family == "sd15" and "text_encoder" not in skip:
        tensors.update(_clip_to_ldm(_folder_state(model_folder / "text_encoder"), "cond_stage_model.transformer."))
    if family == "sdxl":
        if "text_encoder" not in skip:
            tensors.update(_clip_to_ldm(_folder_state(model_folder / "text_encoder"),
                                        "conditioner.embedders.0.transformer."))
        if "text_encoder_2" not in skip:
            tensors.update(_open_clip_to_ldm(_folder_state(model_folder / "text_encoder_2"),
                                             "conditioner.embedders.1.model."))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return path


# --- tests ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_sdxl(tiny_family_model):
    return tiny_family_model("sdxl")  # the session's, shared with the SDXL family tests


def _family(name, base, images, workspace, configs=None, parts=None, **model):
    from modules.config.families import get_family_class

    config = train_config(base, images, workspace, {"model": {"family": name, "parts": parts or {}, **model}})
    family = get_family_class(name)(config)
    family.model_configs_dir = configs
    return family


def _assert_same_parts(ours, theirs):
    assert set(ours.parts) == set(theirs.parts)
    for part in ours.parts:
        mine, other = ours.parts[part].state_dict(), theirs.parts[part].state_dict()
        assert set(mine) == set(other), part
        for key in mine:
            assert mine[key].dtype == other[key].dtype, (part, key)
            assert torch.equal(mine[key], other[key]), (part, key)


@pytest.mark.parametrize("name", ["sd15", "sdxl"])
def test_a_single_file_loads_the_same_tensors_as_the_folder(request, tmp_path, shape_images, name):
    folder = request.getfixturevalue("tiny_model" if name == "sd15" else "tiny_sdxl")
    file = write_original_layout(folder, name, tmp_path / f"{name}.safetensors")
    from_folder = _family(name, folder, shape_images, tmp_path / "a")
    from_folder.load()
    from_file = _family(name, file, shape_images, tmp_path / "b", configs=folder)
    from_file.load()
    _assert_same_parts(from_file, from_folder)
    assert from_file.tokenize(["a cat"])["input_ids"].tolist() == from_folder.tokenize(["a cat"])["input_ids"].tolist()
    assert from_file.part_parameters() == from_folder.part_parameters()  # read from the file's header
    assert from_file.fingerprint("vae") != from_folder.fingerprint("vae")


def test_a_part_missing_from_the_file_is_named_and_its_path_supplies_it(tmp_path, shape_images, tiny_sdxl):
    file = write_original_layout(tiny_sdxl, "sdxl", tmp_path / "no-te.safetensors",
                                 skip=("text_encoder", "text_encoder_2"))
    family = _family("sdxl", file, shape_images, tmp_path / "a", configs=tiny_sdxl)
    with pytest.raises(ModelLoadError) as error:
        family.load()
    message = str(error.value)
    assert "model.parts.text_encoder.path" in message and "model.parts.text_encoder_2.path" in message
    parts = {"text_encoder": {"path": str(tiny_sdxl / "text_encoder")},
             "text_encoder_2": {"path": str(tiny_sdxl / "text_encoder_2")}}
    family = _family("sdxl", file, shape_images, tmp_path / "b", configs=tiny_sdxl, parts=parts)
    family.load()
    reference = _family("sdxl", tiny_sdxl, shape_images, tmp_path / "c")
    reference.load()
    _assert_same_parts(family, reference)


def test_a_single_file_without_configs_or_tokenizers_says_where_to_look(tmp_path, shape_images, tiny_model):
    file = write_original_layout(tiny_model, "sd15", tmp_path / "sd15.safetensors")
    family = _family("sd15", file, shape_images, tmp_path / "a", configs=tmp_path / "nowhere")
    with pytest.raises(ModelLoadError, match="config.json"):
        family.load()
    configs = tmp_path / "configs"
    for part in ("unet", "vae", "text_encoder"):
        (configs / part).mkdir(parents=True)
        (configs / part / "config.json").write_text((tiny_model / part / "config.json").read_text())
    # the scheduler is read before the tokenizers (every part and the scheduler first: modules/plan/)
    shutil.copytree(tiny_model / "scheduler", configs / "scheduler")
    family = _family("sd15", file, shape_images, tmp_path / "b", configs=configs)
    with pytest.raises(ModelLoadError, match=r"no tokenizer/ folder"):
        family.load()


def test_scaled_fp8_single_file_keeps_its_scales(tmp_path, shape_images, tiny_model):
    """ComfyUI's scaled fp8: codes in X.weight, the scale in X.scale_weight; the load multiplies
    the scale in (dense part) or keeps it as the layer's scale (float8 part), never drops it."""
    file = write_original_layout(tiny_model, "sd15", tmp_path / "sd15.safetensors")
    tensors = load_file(str(file))
    scaled = {}
    for key, tensor in list(tensors.items()):
        is_linear = key.endswith(".weight") and tensor.dim() == 2 and "emb" not in key and "norm" not in key
        if key.startswith(("model.diffusion_model.", "cond_stage_model.")) and is_linear:
            scale = tensor.abs().max() / 448
            tensors[key] = (tensor / scale).to(torch.float8_e4m3fn)
            tensors[key[: -len("weight")] + "scale_weight"] = scale.reshape(1)
            scaled[key] = tensors[key].to(torch.float32) * scale
    tensors["model.diffusion_model.scaled_fp8"] = torch.zeros(0, dtype=torch.float8_e4m3fn)
    save_file(tensors, str(tmp_path / "scaled.safetensors"))
    family = _family("sd15", tmp_path / "scaled.safetensors", shape_images, tmp_path / "a", configs=tiny_model)
    family.load()
    unet = family.parts["unet"].state_dict()
    expected = scaled["model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn1.to_q.weight"]
    assert torch.equal(unet["down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.weight"], expected)
    text = family.parts["text_encoder"].state_dict()
    expected = scaled["cond_stage_model.transformer.text_model.encoder.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(text["encoder.layers.0.self_attn.q_proj.weight"], expected)
    fp8 = _family("sd15", tmp_path / "scaled.safetensors", shape_images, tmp_path / "b", configs=tiny_model,
                  parts={"unet": {"weight_dtype": "float8"}})
    fp8.load()
    layer = fp8.parts["unet"].get_submodule("down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q")
    weight = layer.unquantized_weight(torch.float32, torch.device("cpu"))
    assert torch.allclose(weight, scaled["model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn1.to_q.weight"])


_CLASSES = {
    "sd15": {"unet": "diffusers.UNet2DConditionModel", "vae": "diffusers.AutoencoderKL",
             "text_encoder": "transformers.CLIPTextModel"},
    "sdxl": {"unet": "diffusers.UNet2DConditionModel", "vae": "diffusers.AutoencoderKL",
             "text_encoder": "transformers.CLIPTextModel",
             "text_encoder_2": "transformers.CLIPTextModelWithProjection"},
    "flux": {"transformer": "diffusers.FluxTransformer2DModel", "vae": "diffusers.AutoencoderKL",
             "text_encoder": "transformers.CLIPTextModel", "text_encoder_2": "transformers.T5EncoderModel"},
    "z_image": {"transformer": "diffusers.ZImageTransformer2DModel", "vae": "diffusers.AutoencoderKL",
                "text_encoder": "transformers.Qwen3Model"},
    "sd3": {"transformer": "diffusers.SD3Transformer2DModel", "vae": "diffusers.AutoencoderKL",
            "text_encoder": "transformers.CLIPTextModelWithProjection",
            "text_encoder_2": "transformers.CLIPTextModelWithProjection", "text_encoder_3": "transformers.T5EncoderModel"},
    "chroma": {"transformer": "diffusers.ChromaTransformer2DModel", "vae": "diffusers.AutoencoderKL",
               "text_encoder": "transformers.T5EncoderModel"},
    "flux2": {"transformer": "diffusers.Flux2Transformer2DModel", "vae": "diffusers.AutoencoderKLFlux2",
              "text_encoder": "transformers.Qwen3Model"},
    "qwen_image": {"transformer": "diffusers.QwenImageTransformer2DModel", "vae": "diffusers.AutoencoderKLQwenImage",
                   "text_encoder": "transformers.Qwen2_5_VLTextModel"},
}


@pytest.mark.parametrize("name", list(_CLASSES))
def test_the_shipped_configs_build_the_released_architectures(tmp_path, shape_images, name):
    """resources/model_configs/<family>/: each part's config builds (on meta) a model of the
    released model's parameter count, so a real single file loads without any download."""
    from accelerate import init_empty_weights

    from modules.loading.streamed_load import empty_model

    family = _family(name, tmp_path / "model.safetensors", shape_images, tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")  # a file, so parts come from the shipped configs
    classes = _CLASSES[name]
    import importlib

    for spec in family.part_specs:
        module, _, cls = classes[spec.name].rpartition(".")
        with init_empty_weights():
            model = empty_model(getattr(importlib.import_module(module), cls), family.part_folder(spec.name), "t")
        assert sum(p.numel() for p in model.parameters()) == family.nominal_part_parameters[spec.name]
    assert (family.model_config_folder() / "scheduler" / "scheduler_config.json").is_file()


def test_training_runs_from_a_single_file(tmp_path, tiny_sdxl, one_image, monkeypatch):
    """The trainer end to end on a single file: load, cache keys from the file, a step, a save."""
    from modules.model.sdxl import SDXLFamily
    from modules.trainer.generic_trainer import GenericTrainer

    file = write_original_layout(tiny_sdxl, "sdxl", tmp_path / "sdxl.safetensors")
    monkeypatch.setattr(SDXLFamily, "model_config_folder", lambda self: tiny_sdxl)
    config = train_config(file, one_image, tmp_path, {
        "model": {"family": "sdxl", "parts": {"unet": {"weight_dtype": "auto"}}},
        "schedule": {"epochs": 2, "max_steps": 2, "batch_size": 1}})
    trainer = GenericTrainer(config)
    trainer.start()  # auto sizes the UNet from the file's header
    trainer.train()
    path = trainer.end()
    assert trainer.step == 2 and path.is_file()
    assert trainer.dataset.cache_stats["latents"][1] == 1  # encoded once, keyed by the file


def test_a_skeleton_part_reads_none_of_its_tensors_from_the_file(tmp_path, shape_images, tiny_model, monkeypatch):
    """`launch.py cache` on a single file: the UNet is built from its config, and of the file only
    the encoders' tensors are read (a single file is read lazily, part by part)."""
    from modules.loading.safetensors_stream import SafetensorsStream

    file = write_original_layout(tiny_model, "sd15", tmp_path / "sd15.safetensors")
    family = _family("sd15", file, shape_images, tmp_path, configs=tiny_model)
    family.skeleton_parts = frozenset({"unet"})
    read, stream_read = [], SafetensorsStream.read
    monkeypatch.setattr(SafetensorsStream, "read", lambda stream, key: (read.append(key), stream_read(stream, key))[1])
    family.load()
    assert any(key.startswith("first_stage_model.") for key in read)
    assert not [key for key in read if key.startswith("model.diffusion_model.")]
    assert all(p.is_meta for p in family.parts["unet"].parameters())


def test_each_converted_tensor_is_freed_once_it_is_loaded(tmp_path, shape_images, tiny_model, monkeypatch):
    """A converted tensor (computed from the file's, e.g. the VAE's mid attention) is handed over
    and no longer held: at most the last one handed out is alive at a read (the loader's own
    variable until it reads the next), so a load's peak stays one tensor above the model, as from a
    folder (for Flux most of the transformer is converted)."""
    import weakref

    import modules.loading.single_file as single_file

    file = write_original_layout(tiny_model, "sd15", tmp_path / "sd15.safetensors")
    handed, alive_at_reads = [], []
    read = single_file.ConvertedPart.read

    def watching_read(part, name):
        alive_at_reads.append(sum(alive() is not None for _, alive in handed))
        tensor = read(part, name)
        if name not in part.renamed:
            handed.append((name, weakref.ref(tensor)))
        return tensor

    monkeypatch.setattr(single_file.ConvertedPart, "read", watching_read)
    _family("sd15", file, shape_images, tmp_path, configs=tiny_model).load()
    assert len(handed) >= 8 and max(alive_at_reads) <= 1, alive_at_reads
    assert all(alive() is None for _, alive in handed)
