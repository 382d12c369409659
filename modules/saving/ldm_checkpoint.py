"""A whole model as one .safetensors file in the original layout (ldm for SD1.x, sgm for SDXL),
the file ComfyUI, A1111/Forge and diffusers' `from_single_file` load.

diffusers ships only the other direction (original -> diffusers); this is its reverse, written
per model class: the UNet by its module names (modules/model: ldm_unet_module_name, SDXL's
label_emb), the VAE by its block layout (decoder levels are numbered the other way round, the mid
attention's projections are 1x1 convolutions), CLIP-L under `<prefix>text_model.`, and OpenCLIP-G
with its fused q/k/v `in_proj` and transposed `text_projection`. Each part's key prefix in the
file is the one the family reads (its `single_file_part(...).prefixes`), so what this writes is
what the trainer's own single-file loader, and diffusers' converters, read back: the round trip
in tests/test_fine_tune_outputs.py proves the mapping tensor by tensor.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from modules.config.methods.fine_tune import SINGLE_FILE_FAMILIES


def single_file_families() -> tuple[str, ...]:
    return SINGLE_FILE_FAMILIES


def unet_to_ldm(unet: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from modules.model.keys.sdxl import sdxl_ldm_unet_module_name  # SD1.x names plus SDXL's label_emb

    out = {}
    for key, tensor in state.items():
        module, _, attribute = key.rpartition(".")
        out[f"{sdxl_ldm_unet_module_name(unet, module)}.{attribute}"] = tensor
    return out


_VAE_ATTENTION = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}


def vae_to_ldm(vae: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    levels = len(vae.config.block_out_channels)
    out = {}
    for key, tensor in state.items():
        name = key.replace("conv_shortcut", "nin_shortcut").replace("conv_norm_out", "norm_out")
        name = re.sub(r"^encoder\.down_blocks\.(\d+)\.resnets\.", r"encoder.down.\1.block.", name)
        name = re.sub(r"^encoder\.down_blocks\.(\d+)\.downsamplers\.0\.", r"encoder.down.\1.downsample.", name)
        # the decoder's up levels count from the lowest resolution in diffusers, from the highest in ldm
        name = re.sub(r"^decoder\.up_blocks\.(\d+)\.resnets\.",
                      lambda m: f"decoder.up.{levels - 1 - int(m.group(1))}.block.", name)
        name = re.sub(r"^decoder\.up_blocks\.(\d+)\.upsamplers\.0\.",
                      lambda m: f"decoder.up.{levels - 1 - int(m.group(1))}.upsample.", name)
        name = re.sub(r"mid_block\.resnets\.(\d+)\.", lambda m: f"mid.block_{int(m.group(1)) + 1}.", name)
        if "mid_block.attentions.0." in name:
            head, _, rest = name.partition("mid_block.attentions.0.")
            module, _, attribute = rest.rpartition(".")
            name = f"{head}mid.attn_1.{_VAE_ATTENTION[module]}.{attribute}"
            if attribute == "weight" and module != "group_norm":
                tensor = tensor[:, :, None, None]  # 1x1 convolutions in the original
        out[name] = tensor
    return out


def _text_model_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CLIP keys with the `text_model.` level (transformers 5 dropped it), position ids left out
    (a buffer the loaders make themselves)."""
    return {(k if k.startswith(("text_model.", "text_projection")) else "text_model." + k): v
            for k, v in state.items() if not k.endswith("position_ids")}


def clip_to_ldm(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return _text_model_keys(state)


_OPEN_CLIP = {"layer_norm1": "ln_1", "layer_norm2": "ln_2", "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj",
              "self_attn.out_proj": "attn.out_proj"}
_LAYER = re.compile(r"^text_model\.encoder\.layers\.(\d+)\.(.+)$")


def open_clip_to_ldm(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    state = _text_model_keys(state)
    out = {}
    for key, tensor in state.items():
        if key == "text_projection.weight":
            out["text_projection"] = tensor.T.contiguous()  # OpenCLIP multiplies from the right
        elif key == "text_model.embeddings.token_embedding.weight":
            out["token_embedding.weight"] = tensor
        elif key == "text_model.embeddings.position_embedding.weight":
            out["positional_embedding"] = tensor
        elif key.startswith("text_model.final_layer_norm."):
            out["ln_final." + key.rpartition(".")[2]] = tensor
        else:
            layer, rest = _LAYER.match(key).groups()
            if rest.startswith("self_attn.q_proj."):  # q, k, v stacked into one projection
                attribute = rest.rpartition(".")[2]
                out[f"transformer.resblocks.{layer}.attn.in_proj_{attribute}"] = torch.cat(
                    [state[f"text_model.encoder.layers.{layer}.self_attn.{p}_proj.{attribute}"] for p in "qkv"])
                continue
            if rest.startswith(("self_attn.k_proj.", "self_attn.v_proj.")):
                continue
            for old, new in _OPEN_CLIP.items():
                rest = rest.replace(old, new)
            out[f"transformer.resblocks.{layer}.{rest}"] = tensor
    return out


def _architecture(module: nn.Module) -> str:
    """The module's model class name; under a sharded run's FSDP<name> subclass (fully_shard makes
    one, modules/trainer/sharding.py) the class it was made from."""
    from torch.distributed.fsdp import FSDPModule

    cls = type(module)
    if issubclass(cls, FSDPModule):
        cls = next(base for base in cls.__bases__ if base is not FSDPModule)
    return cls.__name__


def part_to_ldm(module: nn.Module, state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """One part's diffusers/transformers state dict under its original names (with `prefix`)."""
    kind = _architecture(module)
    if kind == "UNet2DConditionModel":
        converted = unet_to_ldm(module, state)
    elif kind == "AutoencoderKL":
        converted = vae_to_ldm(module, state)
    elif kind in ("CLIPTextModel", "CLIPTextModelWithProjection") and prefix.endswith(".model."):
        converted = open_clip_to_ldm(state)  # OpenCLIP's own layout (SDXL's conditioner.embedders.1.model.)
    elif kind in ("CLIPTextModel", "CLIPTextModelWithProjection"):
        converted = clip_to_ldm(state)
    else:
        raise ValueError(f"no original-layout writer for {kind}")
    return {prefix + key: tensor for key, tensor in converted.items()}
