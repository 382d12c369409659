"""One training step on tensors without data: what it holds on the train device beyond the
weights, and its FLOPs.

The step runs on the parts' meta architecture itself (meta tensors: shapes and dtypes, no memory,
no compute; each op's meta kernel run once per shape, meta_ops.py), with the project's own
gradient checkpointing and activation offloading (modules/offload/checkpointing.py) and the real
adapters (or, in a fine-tune, the part's weights requiring grad). Where activation offloading
sends a part's block inputs to the temp device (`cpu`, where no meta tensor can go), the parts
are made fake copies instead (FakeTensorMode: tensors without data on any device). Under that
mode the same meta kernels compute each op's output, so both passes count the same storages
(tests/test_plan_meta_pass.py); the fake mode's bookkeeping only makes the pass slower (the
step of `Flux LoRA 24GB`, 1024 px: 15 s of CPU instead of 3). Then the family's own `predict` runs on
latents from its own `encode_images`, an edit model's control latents (as many per sample as
controls.py plans, from the same `encode_images` at the target's size, as the data pipeline hands
them over in `control_latents`) and the conditioning its `planning_conditioning_with_controls`
describes (a VL text encoder's image tokens of the controls included), the loss is MSE, and
backward runs, while LiveBytes counts every new storage on the train device (here `meta`, so
what activation offloading sends to the temp device, `cpu`, is not counted) and the FLOPs.
Gradients of trained tensors are dropped as they arrive (the planner counts them itself: all of
them, or one block's with a fused backward).

Text encoders run only where they train (with the text cache, a frozen encoder is not in the step);
a trained text encoder's activations are not measured here (its tokens need its tokenizer).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from modules.offload.checkpointing import checkpoint_blocks_
from modules.plan.attention import efficient_attention
from modules.plan.live_bytes import LiveBytes
from modules.plan.meta_ops import MetaOpCache

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


def image_latents(family, batch: int, resolution: int, mode: TorchDispatchMode,
                  frames: int = 1) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The latents of `batch` images (or clips of `frames` frames) at `resolution` (on meta, or
    fake under a FakeTensorMode), from the family's own encode_images, and its pixel conditioning
    of them."""
    vae_parts = family.image_parts
    for part in vae_parts:
        _to_train_device(family.parts[part], mode)
    with mode, torch.no_grad():
        frame_axis = (frames,) if frames > 1 else ()
        pixels = torch.empty(batch, 3, *frame_axis, resolution, resolution, device=TRAIN)
        return family.encode_images(pixels), family.encode_pixel_conditioning(pixels)


def control_latents(family, batch: int, controls: int, resolution: int, mode: TorchDispatchMode) -> torch.Tensor:
    """(batch, controls, C, h, w) latents of the samples' control images at the target's resolution (on
    meta, or fake under a FakeTensorMode), float32 as the data pipeline's (dataset.encode_controls)."""
    with mode, torch.no_grad():
        pixels = torch.empty(batch * controls, 3, resolution, resolution, device=TRAIN)
        return family.encode_images(pixels).float().unflatten(0, (batch, controls))


def _to_train_device(module: torch.nn.Module, mode: TorchDispatchMode) -> None:
    """Every tensor of `module` empty on the train device (fake ones under a FakeTensorMode): also
    the buffers a skeleton build leaves on the CPU (SD3's positional table, Wan's rotary tables)."""
    if getattr(module, "_plan_on_train_device", False):
        return
    with mode:
        module.to_empty(device=TRAIN)
    module._plan_on_train_device = True


def measure_step(family, config, trained: dict[str, str], batch: int, resolution: int,
                 checkpointing: dict[str, bool], activation_offloading: dict[str, bool],
                 adapter_set_builder=None, fused_attention: bool = True, controls: int = 0,
                 fake: bool | None = None) -> StepFigures:
    """trained: part -> "adapter" or "weights" for the parts the step trains. fused_attention: the
    train device runs attention in a fused kernel (CUDA's flash / memory-efficient, the CPU's flash
    kernel), so the pass does too; else torch's math path, as on devices without one. controls: the
    control images each sample carries (an edit model's: controls.planned_controls). fake: run on
    fake tensors (None: only where activation offloading sends tensors to the temp device)."""
    from modules.util.torch_utils import make_generator

    denoiser = family.denoiser_part
    checkpointed = [part for part in {denoiser, *trained} if checkpointing.get(part) and family.checkpoint_blocks(part)]
    if fake is None:
        fake = any(activation_offloading.get(part) for part in checkpointed)
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else MetaOpCache()
    latents, pixel_conditioning = image_latents(family, batch, resolution, mode, planned_frames(config, family))
    if controls:  # a batch input, as the pixel conditioning is: handed to the denoiser with the text
        pixel_conditioning["control_latents"] = control_latents(family, batch, controls, resolution, mode)
    for part in {denoiser, *trained}:
        _to_train_device(family.parts[part], mode)
        if part in checkpointed:
            checkpoint_blocks_(family.checkpoint_blocks(part), TEMP if activation_offloading.get(part) else None)
    family.parts[denoiser].train()
    # on meta, LiveBytes runs each op through the cache itself (so the cache is no mode of its own here)
    live = LiveBytes(TRAIN, None if fake else mode.run)
    held = []
    with mode if fake else contextlib.nullcontext():
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
