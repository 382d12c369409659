"""A CLIP vision tower in one .safetensors file, as ComfyUI's "Load CLIP Vision" reads it
(clip_vision_h.safetensors in its Wan 2.1 I2V workflows, clip_vision_l, clip_vision_g), loaded into
transformers' CLIPVisionModel: the class diffusers' WanImageToVideoPipeline holds as its
`image_encoder` and reads at its penultimate hidden states.

The two key layouts ComfyUI reads (facts from comfy/clip_vision.py `load` and
`convert_to_transformers`, comfy/clip_model.py and comfy/utils.py `transformers_convert`):

- its own, transformers' CLIPVisionModelWithProjection as transformers 4 named it (the layout of the
  repackaged clip_vision_h.safetensors): `vision_model.embeddings.{class_embedding,
  patch_embedding, position_embedding}`, `vision_model.pre_layrnorm`, `vision_model.encoder.layers.N.`
  `{layer_norm1, self_attn.{q,k,v,out}_proj, layer_norm2, mlp.fc1, mlp.fc2}`,
  `vision_model.post_layernorm`, and `visual_projection.weight`;
- OpenCLIP's, under `visual.`: `class_embedding`, `conv1` (the patch embedding), `positional_embedding`,
  `ln_pre`, `transformer.resblocks.N.{ln_1, attn.in_proj_weight/bias (q, k, v stacked on the rows),
  attn.out_proj, ln_2, mlp.c_fc, mlp.c_proj}`, `ln_post` and `proj` (the projection, transposed).

CLIPVisionModel has no projection, and the penultimate hidden states never pass through it, so
`visual_projection` (outside the part's prefixes) and OpenCLIP's `proj` are not loaded. The tower's
shape (width, layers, patch side, positions) is read from the header and compared with the config
the part is built from before any weight loads, so a ViT-L file where ViT-H is wanted is named then.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

OPEN_CLIP = "visual."
TRANSFORMERS = "vision_model."
PREFIXES = (TRANSFORMERS, OPEN_CLIP)

_OPEN_CLIP_NAMES = {"class_embedding": "embeddings.class_embedding", "conv1.weight": "embeddings.patch_embedding.weight",
                    "positional_embedding": "embeddings.position_embedding.weight",
                    "ln_pre.weight": "pre_layrnorm.weight", "ln_pre.bias": "pre_layrnorm.bias",
                    "ln_post.weight": "post_layernorm.weight", "ln_post.bias": "post_layernorm.bias"}
_OPEN_CLIP_BLOCK = {"ln_1": "layer_norm1", "ln_2": "layer_norm2", "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2",
                    "attn.out_proj": "self_attn.out_proj"}
_LAYER = re.compile(r"^(?:vision_model\.encoder\.layers|visual\.transformer\.resblocks)\.(\d+)\.")

# the CLIP vision towers people meet, by (width, layers, patch side)
KNOWN_TOWERS = {(768, 12, 32): "ViT-B/32", (768, 12, 16): "ViT-B/16", (1024, 24, 14): "ViT-L/14",
                (1280, 32, 14): "ViT-H/14", (1664, 48, 14): "ViT-bigG/14"}


def to_clip_vision_model(state: dict[str, torch.Tensor], model=None) -> dict[str, torch.Tensor]:
    """Either layout's keys -> CLIPVisionModel's (transformers 5: no `vision_model.` level)."""
    out = {}
    for key, tensor in state.items():
        if key.startswith(TRANSFORMERS):
            if not key.endswith(".position_ids"):  # a buffer transformers 4 saved, rebuilt by the model
                out[key.removeprefix(TRANSFORMERS)] = tensor
            continue
        name = key.removeprefix(OPEN_CLIP)
        if name in _OPEN_CLIP_NAMES:
            out[_OPEN_CLIP_NAMES[name]] = tensor
        elif match := re.match(r"^transformer\.resblocks\.(\d+)\.attn\.in_proj_(weight|bias)$", name):
            for projection, part in zip(("q_proj", "k_proj", "v_proj"), tensor.chunk(3, dim=0)):
                out[f"encoder.layers.{match.group(1)}.self_attn.{projection}.{match.group(2)}"] = part
        elif (match := re.match(r"^transformer\.resblocks\.(\d+)\.(.+)\.(weight|bias)$", name)) and (
                match.group(2) in _OPEN_CLIP_BLOCK):
            layer, inner, kind = match.groups()
            out[f"encoder.layers.{layer}.{_OPEN_CLIP_BLOCK[inner]}.{kind}"] = tensor
        elif name != "proj":  # (OpenCLIP's projection: CLIPVisionModel has none)
            out[key] = tensor  # a key of neither layout: the strict load names it as unexpected
    return out


@dataclass(frozen=True)
class TowerShape:
    width: int
    layers: int
    patch: int
    side: int  # the picture side its position embedding is for

    def describe(self) -> str:
        known = KNOWN_TOWERS.get((self.width, self.layers, self.patch))
        return (f"a CLIP vision tower {self.width} wide with {self.layers} layers over {self.patch}-pixel patches at "
                f"{self.side} px" + (f" ({known})" if known else ""))


def file_tower_shape(stream) -> TowerShape:
    """The tower in a single file, from its header (either layout)."""
    keys = stream.keys()
    open_clip = not any(k.startswith(TRANSFORMERS) for k in keys)

    def shape(transformers_key, open_clip_key):
        key = (OPEN_CLIP + open_clip_key) if open_clip else (TRANSFORMERS + transformers_key)
        return tuple(stream.shape(key)) if key in keys else ()

    norm = shape("encoder.layers.0.layer_norm1.weight", "transformer.resblocks.0.ln_1.weight")
    patch = shape("embeddings.patch_embedding.weight", "conv1.weight")
    positions = shape("embeddings.position_embedding.weight", "positional_embedding")
    layers = {int(m.group(1)) for k in keys if (m := _LAYER.match(k))}
    side = patch[-1] * math.isqrt(positions[0] - 1) if patch and positions else 0  # one class token first
    return TowerShape(norm[0] if norm else 0, max(layers, default=-1) + 1, patch[-1] if patch else 0, side)


def config_tower_shape(folder: Path) -> TowerShape:
    """The tower a CLIPVisionConfig folder builds (CLIPVisionConfig's defaults where it is silent)."""
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    return TowerShape(config.get("hidden_size", 768), config.get("num_hidden_layers", 12),
                      config.get("patch_size", 32), config.get("image_size", 224))


def check_clip_vision_file(stream, folder: Path, where: str, label: str, released_file: str) -> None:
    """ModelLoadError at `where` when the file's tower is not the one `folder`'s config builds."""
    from modules.loading.diffusers_folder import ModelLoadError

    held, wanted = file_tower_shape(stream), config_tower_shape(folder)
    if held != wanted:
        raise ModelLoadError(f"{where}: {stream.path.name} holds {held.describe()}; {label} encodes its images with "
                             f"{wanted.describe()}: name {released_file} (ComfyUI's \"Load CLIP Vision\" file) or "
                             "a diffusers image_encoder/ folder of the model here")


def single_file_part():
    """Where a CLIP vision tower sits in its file, for ModelFamily.single_file_part."""
    from modules.loading.single_file import SingleFilePart

    return SingleFilePart(PREFIXES, to_clip_vision_model)
