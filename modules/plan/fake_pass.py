"""One training step of fake tensors: what it holds on the train device beyond the weights, and its
FLOPs.

The parts the step runs are made fake copies of their meta architecture (FakeTensorMode: shapes and
dtypes, no memory, no compute), with the project's own gradient checkpointing and activation
offloading (modules/offload/checkpointing.py) and the real adapters (or, in a fine-tune, the
part's weights requiring grad). Then the family's own `predict` runs on latents from its own
`encode_images`, an edit model's control latents (as many per sample as controls.py plans, from
the same `encode_images` at the target's size, as the data pipeline hands them over in
`control_latents`) and the conditioning its `planning_conditioning_with_controls` describes (a VL
text encoder's image tokens of the controls included), the loss is MSE, and
backward runs, while LiveBytes counts every new storage on the train device (here `meta`, so what
activation offloading sends to the temp device, `cpu`, is not counted) and the FLOPs. Gradients of trained tensors are dropped as they arrive (the planner counts them
itself: all of them, or one block's with a fused backward).

Text encoders run only where they train (with the text cache, a frozen encoder is not in the step);
a trained text encoder's activations are not measured here (its tokens need its tokenizer).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from modules.offload.checkpointing import checkpoint_blocks_
from modules.plan.attention import efficient_attention
from modules.plan.live_bytes import LiveBytes

TRAIN = torch.device("meta")  # the fake pass's train device (fake tensors on it cost nothing)
TEMP = torch.device("cpu")


@dataclass(frozen=True)
class StepFigures:
    activations: int  # the most bytes the step held on the train device beyond weights and trained tensors
    flops: int  # forward + backward (+ recomputation) of the step


def planned_frames(config, family) -> int:
    """The most frames one sample holds: the longest video concept's `video.frames` on a video
    family (its clips' windows), else 1 (still images)."""
    if family.temporal_quantum is None:
        return 1
    return max([c.video.frames for c in config.concepts if c.enabled] or [1])


def image_latents(family, batch: int, resolution: int, mode: FakeTensorMode,
                  frames: int = 1) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The latents of `batch` images (or clips of `frames` frames) at `resolution` (fake), from the
    family's own encode_images, and its pixel conditioning of them."""
    vae_parts = family.image_parts
    for part in vae_parts:
        _make_fake(family.parts[part], mode)
    with mode, torch.no_grad():
        frame_axis = (frames,) if frames > 1 else ()
        pixels = torch.empty(batch, 3, *frame_axis, resolution, resolution, device=TRAIN)
        return family.encode_images(pixels), family.encode_pixel_conditioning(pixels)


def control_latents(family, batch: int, controls: int, resolution: int, mode: FakeTensorMode) -> torch.Tensor:
    """(batch, controls, C, h, w) latents of the samples' control images at the target's resolution (fake),
    float32 as the data pipeline's (dataset.encode_controls)."""
    with mode, torch.no_grad():
        pixels = torch.empty(batch * controls, 3, resolution, resolution, device=TRAIN)
        return family.encode_images(pixels).float().unflatten(0, (batch, controls))


def _make_fake(module: torch.nn.Module, mode: FakeTensorMode) -> None:
    if getattr(module, "_plan_fake", False):
        return
    with mode:
        module.to_empty(device=TRAIN)
    module._plan_fake = True


def measure_step(family, config, trained: dict[str, str], batch: int, resolution: int,
                 checkpointing: dict[str, bool], activation_offloading: dict[str, bool],
                 adapter_set_builder=None, fused_attention: bool = True, controls: int = 0) -> StepFigures:
    """trained: part -> "adapter" or "weights" for the parts the step trains. fused_attention: the
    train device runs attention in a fused kernel (CUDA's flash / memory-efficient, the CPU's flash
    kernel), so the pass does too; else torch's math path, as on devices without one. controls: the
    control images each sample carries (an edit model's: controls.planned_controls)."""
    from modules.util.torch_utils import make_generator

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    denoiser = family.denoiser_part
    latents, pixel_conditioning = image_latents(family, batch, resolution, mode, planned_frames(config, family))
    if controls:  # a batch input, as the pixel conditioning is: handed to the denoiser with the text
        pixel_conditioning["control_latents"] = control_latents(family, batch, controls, resolution, mode)
    for part in {denoiser, *trained}:
        _make_fake(family.parts[part], mode)
        if checkpointing.get(part) and family.checkpoint_blocks(part):
            checkpoint_blocks_(family.checkpoint_blocks(part), TEMP if activation_offloading.get(part) else None)
    family.parts[denoiser].train()
    live = LiveBytes(TRAIN)
    held = []
    with mode:
        if adapter_set_builder is not None and any(kind == "adapter" for kind in trained.values()):
            adapters = adapter_set_builder([p for p, kind in trained.items() if kind == "adapter"], TRAIN)
            held += list(adapters.parameters())
        for part, kind in trained.items():
            if kind == "weights":
                for parameter in family.parts[part].parameters():
                    if parameter.is_floating_point():
                        parameter.requires_grad_(True)
                        parameter.register_post_accumulate_grad_hook(_drop_grad)
        for module in family.parts.values():
            live.known([*module.parameters(), *module.buffers()])
        live.known(held)
        live.known([latents, *pixel_conditioning.values()])
        generator = make_generator("cpu", 0)
        with live, efficient_attention() if fused_attention else contextlib.nullcontext():
            step_latents = latents.clone()
            text = {**family.planning_conditioning_with_controls(batch, TRAIN, controls, resolution, resolution),
                    **pixel_conditioning}
            if not trained:  # nothing trains: still a backward to the input, as a guard would see
                step_latents.requires_grad_(True)
            prediction = family.predict(step_latents, text, generator)
            loss = F.mse_loss(prediction.prediction.float(), prediction.target.float())
            loss.backward()
            del loss, prediction, text, step_latents
    return StepFigures(activations=live.peak, flops=int(live.flops))


def _drop_grad(parameter: torch.Tensor) -> None:
    parameter.grad = None
