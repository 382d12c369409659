"""A real-width SDXL UNet (bf16, and nf4 with its quantization timed) and a real-width FLUX.1 slice
(2 double and 4 single blocks), random weights built on the GPU from resources/model_configs (nothing downloaded), bf16, 1024 px, batch 1:
a LoRA-like step (base frozen, gradients flow back through every block to the input) with the
project's gradient checkpointing, without and with the LayerOffloadConductor at offload 0.5.

Figures per model and offload: steps/s, peak allocated and reserved GPU memory, pinned host memory
(torch's host allocator) over parked bytes, the parked share of the block bytes, bytes brought to
the GPU per step (counted at the conductor's block moves), and the offload
overhead (step time with offload / without). The dry run: the same code at tiny widths on the CPU.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent.parent.parent
TINY_SDXL = dict(block_out_channels=[32, 64, 64], attention_head_dim=[2, 4, 4], transformer_layers_per_block=[1, 1, 1],
                 cross_attention_dim=32, addition_time_embed_dim=8, projection_class_embeddings_input_dim=6 * 8 + 16)
TINY_FLUX = dict(num_attention_heads=2, attention_head_dim=16, axes_dims_rope=[4, 6, 6], joint_attention_dim=32,
                 pooled_projection_dim=16)


def released_config(family: str, part: str) -> dict:
    """The released model's config of `part` (resources/model_configs), without diffusers' own keys."""
    config = json.loads((REPO / "resources" / "model_configs" / family / part / "config.json").read_text())
    return {k: v for k, v in config.items() if not k.startswith("_")}


def build_sdxl(device, dtype, dry: bool):
    from diffusers import UNet2DConditionModel

    from modules.model.components.unet import unet_checkpoint_blocks

    config = {**released_config("sdxl", "unet"), **(TINY_SDXL if dry else {})}
    with torch.device(device):
        unet = UNet2DConditionModel.from_config(config).to(dtype).requires_grad_(False)
    side = 16 if dry else 128  # latents of 128 px (dry) or 1024 px
    text, pooled = config["cross_attention_dim"], config["projection_class_embeddings_input_dim"] - 6 * config[
        "addition_time_embed_dim"]
    inputs = dict(encoder_hidden_states=torch.randn(1, 77, text, device=device, dtype=dtype),
                  added_cond_kwargs={"text_embeds": torch.randn(1, pooled, device=device, dtype=dtype),
                                     "time_ids": torch.tensor([[side * 8.0, side * 8, 0, 0, side * 8, side * 8]],
                                                              device=device, dtype=dtype)})
    latents = torch.randn(1, config["in_channels"], side, side, device=device, dtype=dtype)

    def step():
        x = latents.clone().requires_grad_(True)
        out = unet(x, torch.tensor([500], device=device), **inputs).sample
        out.float().square().mean().backward()

    return unet, unet_checkpoint_blocks(unet), step


def build_flux_slice(device, dtype, dry: bool):
    from diffusers import FluxTransformer2DModel

    config = {**released_config("flux", "transformer"), "num_layers": 2, "num_single_layers": 4, **(TINY_FLUX if dry else {})}
    with torch.device(device):
        model = FluxTransformer2DModel.from_config(config).to(dtype).requires_grad_(False)
    image_tokens, text_tokens = (64, 16) if dry else (4096, 512)  # 1024 px: 128x128 latents in 2x2 patches
    inputs = dict(encoder_hidden_states=torch.randn(1, text_tokens, config["joint_attention_dim"], device=device,
                                                    dtype=dtype),
                  pooled_projections=torch.randn(1, config["pooled_projection_dim"], device=device, dtype=dtype),
                  timestep=torch.tensor([0.5], device=device, dtype=dtype),
                  guidance=torch.tensor([3.5], device=device, dtype=dtype),
                  img_ids=torch.zeros(image_tokens, 3, device=device), txt_ids=torch.zeros(text_tokens, 3, device=device))
    latents = torch.randn(1, image_tokens, config["in_channels"], device=device, dtype=dtype)

    def step():
        x = latents.clone().requires_grad_(True)
        model(hidden_states=x, **inputs).sample.float().square().mean().backward()

    return model, [*model.transformer_blocks, *model.single_transformer_blocks], step


def _bytes_brought(conductor, blocks) -> list[int] | None:
    """A counter of the bytes the conductor brings to the train device (it counts blocks, not bytes)."""
    from modules.offload.layer_tensors import block_bytes

    sizes, total = [block_bytes(block) for block in blocks], [0]
    bring = getattr(conductor, "_bring", None)
    if bring is None:  # the conductor changed: no count (the figure is left out)
        return None

    def counted(index, *args, **kwargs):
        total[0] += sizes[index]
        return bring(index, *args, **kwargs)

    conductor._bring = counted
    return total


def quantize_nf4(model, dtype) -> None:
    """The project's nf4 quantization (modules/quantization/replace.py) of the model where it sits."""
    from modules.quantization.replace import quantize_model_

    quantize_model_(model, "unet", "nf4", dtype)


def measure(build, context, steps: int, prepare=None) -> dict:
    from modules.offload.checkpointing import checkpoint_blocks_
    from modules.offload.conductor import LayerOffloadConductor
    from modules.offload.layer_tensors import block_bytes
    from tools.gpu_check.parts.measure import memory_figures, reset_memory, timed_steps

    device = context.device
    dtype = torch.float32 if context.dry else torch.bfloat16
    started = time.perf_counter()
    model, blocks, step = build(device, dtype, context.dry)
    figures = {"parameters_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
               "build_s": round(time.perf_counter() - started, 2), "blocks": len(blocks)}
    if prepare is not None:  # (timed apart: a real-width nf4 part's quantization)
        started = time.perf_counter()
        prepare(model, dtype)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        figures["prepare_s"] = round(time.perf_counter() - started, 2)
    checkpoint_blocks_(blocks)
    reset_memory(device)
    plain = timed_steps(step, steps + 1, device)[1:]  # the first warms up
    figures["plain"] = {"steps_per_s": round(1 / statistics.median(plain), 3), **memory_figures(device)}
    sizes = [block_bytes(block) for block in blocks]
    conductor = LayerOffloadConductor(blocks, 0.5, device, torch.device("cpu"), "slice")
    conductor.start()
    brought = _bytes_brought(conductor, blocks)
    reset_memory(device)
    timed_steps(step, 1, device)
    if brought:
        brought[0] = 0
    offloaded = timed_steps(step, steps, device)
    parked = sum(sizes[index] for index in conductor.parked)
    offload = {"steps_per_s": round(1 / statistics.median(offloaded), 3), **memory_figures(device),
               "blocks_parked": len(conductor.parked), "parked_gib": round(parked / 2**30, 4),
               "parked_share_of_block_bytes": round(parked / sum(sizes), 3)}
    if "pinned_owned_gib" in offload and parked:
        offload["pinned_over_parked"] = round(offload["pinned_owned_gib"] * 2**30 / parked, 3)
    if brought:
        offload["brought_gib_per_step"] = round(brought[0] / steps / 2**30, 4)
    figures["offload_0.5"] = offload
    figures["offload_overhead"] = round(statistics.median(offloaded) / statistics.median(plain), 3)
    conductor.stop()
    del model, blocks, step, conductor
    reset_memory(device)
    return figures


def run(context) -> dict:
    from tools.gpu_check.part import record_case, summary

    if not context.dry and context.device.type != "cuda":
        return {"status": "skipped", "reason": "no CUDA device"}
    from modules.quantization.capabilities import detect_capabilities, mode_support

    nf4 = mode_support(detect_capabilities(context.device))["nf4"]
    cases = []
    for name, build, prepare in (("sdxl_unet", build_sdxl, None), ("flux1_slice", build_flux_slice, None),
                                 ("sdxl_unet_nf4", build_sdxl, quantize_nf4)):
        if prepare is quantize_nf4 and not nf4.works:
            cases.append({"name": name, "status": "skipped", "reason": f"nf4: {nf4.why}"})
            continue
        record_case(context, cases, name, lambda build=build, prepare=prepare: {
            "status": "passed", "figures": measure(build, context, 2 if context.dry else 4, prepare)})
    return {**summary(cases), "cases": cases}
