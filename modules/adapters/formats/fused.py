"""kohya LoRA keys on a family's original layers (ModelFamily.original_layers), for families
whose kohya files name those rather than diffusers modules (FLUX: sd-scripts writes
`lora_unet_double_blocks_0_img_attn_qkv`, and diffusers' `load_lora_weights` converts every
transformer layer from these names, but only attention layers from OneTrainer's per-module ones).

An original layer may stack several diffusers modules along its output rows (q, k, v and the
MLP input of FLUX's `single_blocks.N.linear1`). Their LoRAs are written as one LoRA, exactly:
down = the members' downs stacked, up = their ups block-diagonal, each member's block as wide as
the largest rank (zero-padded), a member without an adapter a zero block. The delta of each row
block is then exactly that member's. diffusers recognises the block-diagonal up and splits it
back into one LoRA per module; ComfyUI and Forge apply it to the fused weight. alpha is the
members' scale times the stacked rank (so alpha / rank is their scale); members of different
scales get theirs folded into the up blocks and alpha = rank.

Reading takes such files (ours, sd-scripts', or a dense fused LoRA, whose down every member
shares) back into per-module adapters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from modules.adapters.adapter_set import AdapterSet
    from modules.model.base import ModelFamily
    from modules.model.keys.layout import OriginalLayer

_DOWN, _UP, _ALPHA = "lora_down.weight", "lora_up.weight", "alpha"


def _swap(up: torch.Tensor) -> torch.Tensor:
    first, second = up.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


def fused_parts(adapters: AdapterSet, family: ModelFamily) -> dict[str, list[OriginalLayer]]:
    """part -> its original layers, for the parts whose adapters are written on them: plain LoRA
    only (a Hadamard or Kronecker product, or a per-module norm, does not stack), and only where
    every adapter of the part sits in one of those layers."""
    out = {}
    for part in sorted(set(adapters.part_of.values())):
        layers = family.original_layers(part)
        if not layers:
            continue
        names = [n for n, p in adapters.part_of.items() if p == part]
        members = {m for layer in layers for m in layer.members}
        if all(adapters.modules[n].algorithm == "lora" and getattr(adapters.modules[n], "dora_axis", None) is None
               and adapters.module_name_of[n] in members for n in names):
            out[part] = layers
    return out


def fused_state(adapters: AdapterSet, family: ModelFamily) -> dict[str, torch.Tensor]:
    """The kohya keys of the adapters in fused parts, on the original layers' stems."""
    by_module = {(adapters.part_of[n], adapters.module_name_of[n]): a for n, a in adapters.modules.items()}
    out: dict[str, torch.Tensor] = {}
    for part, layers in fused_parts(adapters, family).items():
        for layer in layers:
            present = [by_module.get((part, m)) for m in layer.members]
            if not any(present):
                continue
            if len(layer.members) == 1:
                adapter = present[0]
                up = adapter.lora_up.weight.detach()
                out[f"{layer.stem}.{_DOWN}"] = adapter.lora_down.weight.detach()
                out[f"{layer.stem}.{_UP}"] = _swap(up) if layer.swap_halves else up
                out[f"{layer.stem}.{_ALPHA}"] = adapter.alpha.detach()
                continue
            width = max(a.rank for a in present if a)
            rank = width * len(layer.members)
            one = next(a for a in present if a)
            scales = {a.scale for a in present if a}
            fold = len(scales) > 1
            down = torch.zeros(rank, one.in_dim, dtype=one.lora_down.weight.dtype, device=one.device)
            up = torch.zeros(sum(layer.rows), rank, dtype=one.lora_up.weight.dtype, device=one.device)
            row = 0
            for j, (adapter, rows) in enumerate(zip(present, layer.rows)):
                if adapter is not None:
                    down[j * width: j * width + adapter.rank] = adapter.lora_down.weight.detach()
                    block = adapter.lora_up.weight.detach() * (adapter.scale if fold else 1.0)
                    up[row: row + rows, j * width: j * width + adapter.rank] = block
                row += rows
            out[f"{layer.stem}.{_DOWN}"] = down
            out[f"{layer.stem}.{_UP}"] = up
            alpha = float(rank) if fold else scales.pop() * rank
            out[f"{layer.stem}.{_ALPHA}"] = torch.tensor(alpha, device=one.device)
    return out


def fused_names(adapters: AdapterSet, family: ModelFamily) -> set[str]:
    """The adapters that fused_state writes."""
    parts = fused_parts(adapters, family)
    return {n for n, p in adapters.part_of.items() if p in parts}


def unfuse(tensors: dict[str, torch.Tensor], adapters: AdapterSet,
           family: ModelFamily) -> tuple[dict[str, torch.Tensor], list[str]]:
    """A file's keys with those on original layers replaced by per-adapter kohya keys; and the
    original-layer keys whose (non-zero) rows belong to a module without an adapter in this run."""
    name_of = {(adapters.part_of[n], adapters.module_name_of[n]): n for n in adapters.modules}
    out = dict(tensors)
    unmapped: list[str] = []
    for part in sorted(set(adapters.part_of.values())):
        for layer in family.original_layers(part) or []:
            down = out.pop(f"{layer.stem}.{_DOWN}", None)
            up = out.pop(f"{layer.stem}.{_UP}", None)
            alpha_key = f"{layer.stem}.{_ALPHA}"
            if down is None or up is None:
                for tensor in (down, up):
                    if tensor is not None:  # half a LoRA: left for the caller to name
                        out[f"{layer.stem}.{_DOWN if tensor is down else _UP}"] = tensor
                continue
            rank = down.shape[0]
            alpha = float(out.pop(alpha_key)) if alpha_key in out else float(rank)
            if layer.swap_halves:
                up = _swap(up)
            n = len(layer.members)
            starts = [sum(layer.rows[:j]) for j in range(n)]
            width = rank // n
            sparse = n > 1 and rank % n == 0 and all(
                not up[starts[j]: starts[j] + layer.rows[j], k * width:(k + 1) * width].any()
                for j in range(n) for k in range(n) if j != k)
            for j, member in enumerate(layer.members):
                rows = up[starts[j]: starts[j] + layer.rows[j]]
                if sparse:
                    member_down, member_up = down[j * width:(j + 1) * width], rows[:, j * width:(j + 1) * width]
                    member_alpha = alpha / n
                else:
                    member_down, member_up, member_alpha = down, rows, alpha
                name = name_of.get((part, member))
                if name is None:
                    if member_up.any():
                        unmapped.append(f"{layer.stem}.{_UP} (rows of {part}.{member})")
                    continue
                own = adapters.modules[name].rank
                if member_down.shape[0] > own and not member_down[own:].any() and not member_up[:, own:].any():
                    # zero padding of a smaller rank next to a larger one
                    member_alpha *= own / member_down.shape[0]
                    member_down, member_up = member_down[:own], member_up[:, :own]
                out[f"{name}.{_DOWN}"] = member_down.contiguous()
                out[f"{name}.{_UP}"] = member_up.contiguous()
                out[f"{name}.{_ALPHA}"] = torch.tensor(member_alpha)
    return out, unmapped
