"""The UNet2DConditionModel denoiser (SD1.x, SDXL): its blocks in the order it runs them and its
original (ldm) single-file layout. diffusers is imported inside the functions."""

from __future__ import annotations

import torch


def unet_checkpoint_blocks(unet: torch.nn.Module) -> list[torch.nn.Module]:
    """The units diffusers checkpoints: each resnet and transformer block, in the order the UNet
    runs them."""
    blocks = []
    for stage in [*unet.down_blocks, unet.mid_block, *unet.up_blocks]:
        resnets, attentions = list(stage.resnets), list(getattr(stage, "attentions", None) or [])
        if stage is unet.mid_block:  # resnet, then (attention, resnet) pairs
            blocks.append(resnets[0])
            for attention, resnet in zip(attentions, resnets[1:]):
                blocks += [attention, resnet]
            continue
        for index, resnet in enumerate(resnets):
            blocks.append(resnet)
            if index < len(attentions):
                blocks.append(attentions[index])
    return blocks


def ldm_unet_single_file(prefix: str = "model.diffusion_model."):
    """A UNet2DConditionModel stored under `prefix` in an original-layout (ldm / sgm) checkpoint."""
    from diffusers.loaders import single_file_utils as convert

    from modules.loading.single_file import SingleFilePart

    return SingleFilePart((prefix,), lambda sd, model: convert.convert_ldm_unet_checkpoint(sd, dict(model.config)))
