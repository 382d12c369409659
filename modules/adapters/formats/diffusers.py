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
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from modules.adapters.base import AdapterModule

# weight decomposition's magnitude, whatever the algorithm; each algorithm names its own tensors
# (AdapterModule.peft_names, .peft_scaled)
_MAGNITUDE = {"dora_scale": "lora_magnitude_vector"}


def local_keys() -> tuple[str, ...]:
    """The peft tensor names of the registered algorithms that differ from their kohya names."""
    from modules.adapters.registry import adapter_classes

    return (*_MAGNITUDE.values(), *(name for cls in adapter_classes().values() for name in cls.peft_names.values()))


def to_peft(adapter: AdapterModule, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter's own state dict -> peft local keys, scale folded in, alpha dropped."""
    out = {}
    for key, tensor in local.items():
        if key == "alpha":
            continue
        if key in adapter.peft_scaled:
            tensor = tensor * adapter.scale
        if key == "dora_scale":
            tensor = tensor.reshape(1, -1, 1, 1) if adapter.is_conv else tensor.reshape(-1)
        out[{**adapter.peft_names, **_MAGNITUDE}.get(key, key)] = tensor
    return out


def from_peft(adapter: AdapterModule, tensors: dict[str, torch.Tensor], file_scale: float) -> dict[str, torch.Tensor]:
    """peft local keys -> the adapter's own keys, keeping the adapter's alpha: the folded factor is
    rescaled from the file's scale to the adapter's."""
    own = adapter.state_dict()
    back = {peft: ours for ours, peft in {**adapter.peft_names, **_MAGNITUDE}.items()}
    out = {}
    for key, tensor in tensors.items():
        local = back.get(key, key)
        if local in adapter.peft_scaled:
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
