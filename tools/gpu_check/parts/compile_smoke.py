"""torch.compile smoke test: the project's regional compile (modules/trainer/regional_compile.py)
of the first 6 of a tiny SD1.5 UNet's blocks (resnets and transformers), a forward and backward
that must match eager to 1e-3. On CUDA with torch's default backend (inductor, Triton kernels).
The dry run compiles 3 of the blocks with the eager backend: dynamo captures the same graphs, and nothing is generated (inductor's C++ build, or
even aot_eager's autograd tracing, takes a minute on a small CPU)."""

from __future__ import annotations

import copy
import time

import torch


def run(context) -> dict:
    from diffusers import UNet2DConditionModel

    from modules.model.components.unet import unet_checkpoint_blocks
    from modules.trainer import regional_compile

    device = context.device
    torch.manual_seed(0)
    unet = UNet2DConditionModel(sample_size=16, block_out_channels=(32, 64), layers_per_block=1,
                                down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32,
                                attention_head_dim=4).to(device)
    compiled = copy.deepcopy(unet)
    backend = regional_compile.BACKEND
    if context.dry:
        regional_compile.BACKEND = "eager"
    started = time.perf_counter()
    try:
        blocks = unet_checkpoint_blocks(compiled)
        blocks = regional_compile.compile_regions_(compiled, blocks[:3] if context.dry else blocks[:6])
        used = regional_compile.BACKEND
    finally:
        regional_compile.BACKEND = backend
    x = torch.randn(1, 4, 16, 16, device=device)
    text = torch.randn(1, 8, 32, device=device)
    outputs = []
    for model in (unet, compiled):
        latents = x.clone().requires_grad_(True)
        out = model(latents, torch.tensor([10], device=device), encoder_hidden_states=text).sample
        out.square().mean().backward()
        outputs.append((out.detach(), latents.grad))
    seconds = time.perf_counter() - started
    error = max(float((a - b).abs().max()) for a, b in zip(outputs[0], outputs[1]))
    figures = {"backend": used, "blocks_compiled": len(blocks), "first_call_s": round(seconds, 2),
               "max_abs_difference": error}
    if error > 1e-3:
        return {"status": "failed", "reason": f"compiled and eager differ by {error:.3g}", "figures": figures}
    return {"status": "passed", "figures": figures}
