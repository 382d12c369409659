"""One training step on tensors without data: what it holds on the train device beyond the
weights, and its FLOPs.

The step runs on the parts' meta architecture itself (meta tensors: shapes and dtypes, no memory,
no compute; each op's meta kernel run once per shape, meta_ops.py), with the project's own
gradient checkpointing and activation offloading (modules/offload/checkpointing.py) and the real
adapters (or, in a fine-tune, the part's weights requiring grad). Activation offloading sends a
part's block inputs to the temp device (`cpu`), where no meta tensor can go: its copy there is made
on meta by LiveBytes itself and not counted (`copy_elsewhere`, handed to the checkpointing as its
`temp_copy`), the copy back counted as any new storage, as the same path does with tensors on real
devices. `fake=True` runs the step on fake tensors instead (FakeTensorMode: tensors without data
on any device, the copies truly on the CPU); under that mode the same meta kernels compute each op's
output, so both passes count the same storages (tests/test_plan_meta_pass.py); the fake mode's
bookkeeping only makes the pass slower (the step of `Flux LoRA 24GB`, 1024 px: 15 s of CPU instead
of 3). Then the family's own `predict` runs on
latents from its own `encode_images`, an edit model's control latents (as many per sample as
controls.py plans, from the same `encode_images` at the target's size, as the data pipeline hands
them over in `control_latents`) and the conditioning its `planning_conditioning_with_controls`
describes (a VL text encoder's image tokens of the controls included), the loss is MSE, and
backward runs, while LiveBytes counts every new storage on the train device (here `meta`, so
what activation offloading sends to the temp device, `cpu`, is not counted) and the FLOPs.
Gradients of trained tensors are dropped as they arrive (the planner counts them itself: all of
them, or one block's with a fused backward).

Where the text encoders run inside the step (run_plan.text_in_step: an embedding, a trained encoder,
captions that vary; the text cache stands in for them otherwise), the pass runs the family's own
`encode_text` on the ids its `planning_tokens` describes (no tokenizer), with each trained
embedding's new vectors looked up by the method's own hook (AddedTokenRows), so gradients flow
back through the frozen encoder and its activations are kept for the backward, as in training.
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
from modules.plan.traced_meta import meta_tensors_traced

TRAIN = torch.device("meta")  # the fake pass's train device (fake tensors on it cost nothing)
TEMP = torch.device("cpu")


@dataclass(frozen=True)
class StepFigures:
    activations: int  # the most bytes the step held on the train device beyond weights and trained tensors
    flops: int  # forward + backward (+ recomputation) of the step
    text_counted: bool = False  # the text encoders ran in the pass (else planning_conditioning stood in)


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
                 fake: bool = False, text_in_step: bool = False,
                 embedding_rows: dict[str, int] | None = None) -> StepFigures:
    """trained: part -> "adapter", "weights" or "embedding" for the parts the step trains. fused_attention:
    the train device runs attention in a fused kernel (CUDA's flash / memory-efficient, the CPU's flash
    kernel), so the pass does too; else torch's math path, as on devices without one. controls: the
    control images each sample carries (an edit model's: controls.planned_controls). fake: run on
    fake tensors (the slower pass the meta one is checked against) instead of meta ones.
    text_in_step: the text encoders run in the step (no text cache); embedding_rows: text part -> the
    trained embeddings' new vectors its token table looks up."""
    from modules.util.torch_utils import make_generator

    denoiser = family.denoiser_part
    tokens = family.planning_tokens_with_controls(batch, TRAIN, controls, resolution, resolution) \
        if text_in_step else None
    runs = {denoiser, *trained, *(family.text_parts if tokens is not None else ())}
    checkpointed = [part for part in runs if checkpointing.get(part) and family.checkpoint_blocks(part)]
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else MetaOpCache()
    # on meta, LiveBytes runs each op through the cache itself (so the cache is no mode of its own here)
    live = LiveBytes(TRAIN, None if fake else mode.run)
    # (fake tensors go to the CPU themselves; meta ones leave the train device through LiveBytes)
    temp_copy = None if fake else live.copy_elsewhere
    if fake and tokens is not None:  # the mode's own tensors, as the latents are: a meta input would be
        # converted to a fake copy at each use, so a view of it (a mask's slice) counted its storage as new
        tokens = {name: mode.from_tensor(ids) for name, ids in tokens.items()}
    latents, pixel_conditioning = image_latents(family, batch, resolution, mode, planned_frames(config, family))
    if controls:  # a batch input, as the pixel conditioning is: handed to the denoiser with the text
        pixel_conditioning["control_latents"] = control_latents(family, batch, controls, resolution, mode)
    for part in runs:
        _to_train_device(family.parts[part], mode)
        if part in checkpointed:
            checkpoint_blocks_(family.checkpoint_blocks(part), TEMP if activation_offloading.get(part) else None,
                               temp_copy)
        # as the trainer: what trains in train mode (an embedding's encoder too: T5's dropout), the rest as loaded
        family.parts[part].train(part == denoiser or part in trained)
    held = []
    # (on meta, transformers' mask helpers take the branch they take for fake tensors: traced_meta.py)
    with mode if fake else meta_tensors_traced():
        if adapter_set_builder is not None and any(kind == "adapter" for kind in trained.values()):
            adapters = adapter_set_builder([p for p, kind in trained.items() if kind == "adapter"], TRAIN)
            held += list(adapters.parameters())
        for part, kind in trained.items():
            if kind == "weights":
                for parameter in family.parts[part].parameters():
                    if parameter.is_floating_point():
                        parameter.requires_grad_(True)
                        parameter.register_post_accumulate_grad_hook(_drop_grad)
        hooks = _embedding_hooks(family, (embedding_rows or {}) if tokens is not None else {}, held)
        for module in family.parts.values():
            live.known([*module.parameters(), *module.buffers()])
        live.known(held)
        live.known([latents, *pixel_conditioning.values(), *(tokens or {}).values()])
        generator = make_generator("cpu", 0)
        try:
            with live, efficient_attention() if fused_attention else contextlib.nullcontext():
                step_latents = latents.clone()
                planned = family.planning_conditioning_with_controls(batch, TRAIN, controls, resolution, resolution)
                encoded = planned if tokens is None else {  # (None in planned: every token real, no mask to select by)
                    **family.encode_text(tokens), **{k: v for k, v in planned.items() if v is None}}
                text = {**encoded, **pixel_conditioning}
                if not held and "weights" not in trained.values():  # nothing trains: still a backward to the
                    # input, as a guard would see (an embedding whose encoder is not run trains nothing here)
                    step_latents.requires_grad_(True)
                prediction = family.predict(step_latents, text, generator)
                loss = F.mse_loss(prediction.prediction.float(), prediction.target.float())
                loss.backward()
                del loss, prediction, text, encoded, planned, step_latents
        finally:
            for hook in hooks:
                hook.remove()
    return StepFigures(activations=live.peak, flops=int(live.flops), text_counted=tokens is not None)


def _embedding_hooks(family, rows: dict[str, int], held: list) -> list:
    """The embedding method's own lookup of new token vectors (float32, as it makes them) on each text
    part's token table; every planned id is a new token's (the lookup's tensors are a caption's either way)."""
    from modules.model.components.embedding_tokens import AddedTokenRows, token_embedding

    hooks = []
    for part, count in rows.items():
        table = token_embedding(family.parts[part])
        vectors = torch.zeros(count, table.embedding_dim, dtype=torch.float32, device=TRAIN, requires_grad=True)
        held.append(vectors)
        hooks.append(AddedTokenRows(table, 0, [vectors], mark_seen=False))
    return hooks


def _drop_grad(parameter: torch.Tensor) -> None:
    parameter.grad = None
