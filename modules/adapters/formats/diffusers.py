"""diffusers/peft keys: `unet.<module>.lora_A.weight`, `lora_B.weight`, `lora_magnitude_vector`,
`hada_w1_a`..., `lokr_w1`...: what diffusers' `load_lora_weights` and peft's
`set_peft_model_state_dict` take (after the `unet.`/`text_encoder.` prefix).

Such files carry no alpha: diffusers then takes alpha = rank (scale 1), so the scale is folded
into one factor on save (lora_B, hada_w1_a, lokr_w1 or lokr_w1_a, where diffusers' own LoKr
converter folds it too). On load the file's scale (1, or what a `lora_adapter_metadata` header
says) is converted back into the run's own alpha, so a round trip gives the same adapter.
peft's DoRA magnitude is (out,) for a Linear and (1, out, 1, 1) for a Conv2d, on the output axis.
"""

from __future__ import annotations

import re

import torch

from modules.adapters.base import AdapterModule

# the factor that carries the folded scale, per algorithm
_SCALED = {"lora": ("lora_up.weight",), "loha": ("hada_w1_a",), "lokr": ("lokr_w1", "lokr_w1_a")}
_RENAME = {"lora_down.weight": "lora_A.weight", "lora_up.weight": "lora_B.weight",
           "dora_scale": "lora_magnitude_vector"}
_RENAME_BACK = {v: k for k, v in _RENAME.items()}
LOCAL_KEYS = tuple(_RENAME.values())


def unsupported(algorithm: str, dora_axis: str | None, decomposed: bool) -> str | None:
    """Why an adapter cannot be written as diffusers/peft keys, or None."""
    if algorithm == "oft":
        return ("peft's OFT rotates a layer's input features and LyCORIS/ComfyUI's OFT (this one) its "
                "output channels, so no peft layout holds it; use 'kohya' or 'comfy'")
    if decomposed and algorithm != "lora":
        return "peft's LoKr has no weight decomposition; use 'kohya' or 'comfy'"
    if decomposed and dora_axis != "output":
        return "peft's DoRA decomposes on the output axis (adapter.dora_axis: input cannot be written); use 'kohya' or 'comfy'"
    return None


def lokr_split_problem(adapters: list[AdapterModule]) -> str | None:
    """Why diffusers would not rebuild these LoKr adapters' shapes, or None. Its loader keeps no
    factor in the file: it tries each w1 height as peft's `decompose_factor` (then -1) until peft's
    factorization reproduces every layer's split. peft keeps a dividing factor first where
    LyCORIS (this trainer) sorts it, so a factor whose square exceeds a width may find none."""
    from peft.tuners.lokr.layer import factorization

    splits = [a.splits for a in adapters if a.algorithm == "lokr"]
    if not splits:
        return None
    for candidate in sorted({out[0] for out, _ in splits}) + [-1]:
        if all(factorization(o[0] * o[1], candidate) == o and factorization(i[0] * i[1], candidate) == i
               for o, i in splits):
            return None
    return ("diffusers re-derives LoKr's factor splits with peft's rule, which differs from LyCORIS's where "
            "adapter.lokr_factor squared exceeds a layer's width; use 'kohya' or 'comfy', or a smaller lokr_factor")


def to_peft(adapter: AdapterModule, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter's own state dict -> peft local keys, scale folded in, alpha dropped."""
    out = {}
    for key, tensor in local.items():
        if key == "alpha":
            continue
        if key in _SCALED.get(adapter.algorithm, ()):
            tensor = tensor * adapter.scale
        if key == "dora_scale":
            tensor = tensor.reshape(1, -1, 1, 1) if adapter.is_conv else tensor.reshape(-1)
        out[_RENAME.get(key, key)] = tensor
    return out


def from_peft(adapter: AdapterModule, tensors: dict[str, torch.Tensor], file_scale: float) -> dict[str, torch.Tensor]:
    """peft local keys -> the adapter's own keys, keeping the adapter's alpha: the folded factor is
    rescaled from the file's scale to the adapter's."""
    own = adapter.state_dict()
    out = {}
    for key, tensor in tensors.items():
        local = _RENAME_BACK.get(key, key)
        if local in _SCALED.get(adapter.algorithm, ()):
            tensor = tensor.float() * (file_scale / adapter.scale)
        if local == "dora_scale" and "dora_scale" in own and tensor.numel() == own["dora_scale"].numel():
            tensor = tensor.reshape(own["dora_scale"].shape)
        out[local] = tensor
    if "alpha" in own:
        out["alpha"] = own["alpha"].detach().clone()
    return out


def _pattern_matches(pattern: str, module: str) -> bool:
    # peft's rank/alpha patterns: a module-name suffix, or a full-name regex after "^"
    if pattern.startswith("^"):
        return re.fullmatch(pattern[1:], module) is not None
    return re.fullmatch(rf"(.*\.)?{pattern}", module) is not None


def metadata_scale(metadata: dict | None, part: str, module: str) -> float:
    """The scale peft would apply to `module` of `part` under diffusers' `lora_adapter_metadata`
    (keys "unet.r", "unet.lora_alpha", "unet.rank_pattern", ...); 1 without it."""
    if not metadata:
        return 1.0
    prefix = f"{part}."
    rank = metadata.get(prefix + "r")
    alpha = metadata.get(prefix + "lora_alpha", metadata.get(prefix + "alpha"))
    for name, value in (metadata.get(prefix + "rank_pattern") or {}).items():
        if _pattern_matches(name, module):
            rank = value
    for name, value in (metadata.get(prefix + "alpha_pattern") or {}).items():
        if _pattern_matches(name, module):
            alpha = value
    if not rank or alpha is None:
        return 1.0
    return float(alpha) / (rank ** 0.5 if metadata.get(prefix + "use_rslora") else float(rank))
