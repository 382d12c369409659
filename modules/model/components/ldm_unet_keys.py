"""diffusers UNet2DConditionModel module names -> the original (ldm) UNetModel names ComfyUI, A1111
and Forge use for SD1.x/2.x: `down_blocks.0.attentions.0.proj_in` -> `input_blocks.1.1.proj_in`.

The layout follows from the UNet's config: input_blocks[0] is conv_in; each down level has
`layers_per_block` (resnet, attention) rows and, but for the last level, a downsampler row;
the middle block is (resnet, attention, resnet); each up level has `layers_per_block + 1` rows,
its upsampler sitting in the last row after the resnet (and the attention, where there is one).
Inside an attention the names are the same in both; a resnet's are renamed (_RESNET).
"""

from __future__ import annotations

import re

# ComfyUI maps diffusers UNet attention projections only as `.processor.to_q` (old diffusers), so
# it skips these modules' adapters in a diffusers-format file: (regex on the module name, why)
COMFYUI_UNET_ATTENTION_SKIP = (r"\.to_(q|k|v|out\.0)$", "it reads UNet attention projections only as `...processor.to_q`")

_RESNET = {
    "norm1": "in_layers.0", "conv1": "in_layers.2", "time_emb_proj": "emb_layers.1",
    "norm2": "out_layers.0", "conv2": "out_layers.3", "conv_shortcut": "skip_connection",
}
_TOP = {
    "conv_in": "input_blocks.0.0", "time_embedding.linear_1": "time_embed.0",
    "time_embedding.linear_2": "time_embed.2", "conv_norm_out": "out.0", "conv_out": "out.2",
}
_BLOCK = re.compile(r"^(down_blocks|up_blocks)\.(\d+)\.(resnets|attentions|downsamplers|upsamplers)\.(\d+)(?:\.(.*))?$")
_MID = re.compile(r"^mid_block\.(resnets|attentions)\.(\d+)(?:\.(.*))?$")


def _resnet_rest(rest: str | None) -> str:
    head, _, tail = (rest or "").partition(".")
    if head not in _RESNET:
        raise KeyError(rest)
    return _RESNET[head] + (f".{tail}" if tail else "")


def _join(*pieces: str | None) -> str:
    return ".".join(p for p in pieces if p)


def ldm_unet_module_name(unet, name: str) -> str:
    """The ldm name of the diffusers UNet module `name`; KeyError for a module it has no name for."""
    for top, ldm in _TOP.items():
        if name == top or name.startswith(top + "."):
            return ldm + name[len(top):]
    layers = unet.config.layers_per_block
    per_down = list(layers) if isinstance(layers, (list, tuple)) else [layers] * len(unet.down_blocks)
    per_up = list(reversed(per_down))
    match = _MID.match(name)
    if match:
        kind, index, rest = match.group(1), int(match.group(2)), match.group(3)
        if kind == "attentions":
            return _join(f"middle_block.{2 * index + 1}", rest)
        return _join(f"middle_block.{2 * index}", _resnet_rest(rest))
    match = _BLOCK.match(name)
    if not match:
        raise KeyError(name)
    side, level, kind, index, rest = match.group(1), int(match.group(2)), match.group(3), int(match.group(4)), match.group(5)
    if side == "down_blocks":
        first = 1 + sum(n + 1 for n in per_down[:level])  # conv_in, then each level's rows + downsampler
        if kind == "downsamplers":
            if rest != "conv" and not (rest or "").startswith("conv."):
                raise KeyError(name)
            return _join(f"input_blocks.{first + per_down[level]}.0.op", rest[len("conv"):].lstrip("."))
        row = first + index
    else:
        first = sum(n + 1 for n in per_up[:level])
        if kind == "upsamplers":
            has_attention = hasattr(unet.up_blocks[level], "attentions")
            return _join(f"output_blocks.{first + per_up[level]}.{2 if has_attention else 1}", rest)
        row = first + index
    if kind == "attentions":
        return _join(f"{'input_blocks' if side == 'down_blocks' else 'output_blocks'}.{row}.1", rest)
    return _join(f"{'input_blocks' if side == 'down_blocks' else 'output_blocks'}.{row}.0", _resnet_rest(rest))
