"""Every weight mode x offload_fraction {0, 0.5} on the tiny SDXL: a few LoRA steps of the
trainer each (gradient checkpointing on, the UNet in the mode), with steps/s and peak memory.
A mode this device cannot run is skipped with the probe's reason. The dry run: float32 alone,
2 steps, on the CPU (where offloading moves nothing: train and temp device are one)."""

from __future__ import annotations

import time
from functools import partial

import torch

STEPS = 4
CASE_SECONDS = 8  # below this much of the part's budget left, a case is not started


def run_case(model, images, mode: str, fraction: float, context, clock_cls) -> dict:
    from modules.config.loading import build_config
    from modules.trainer.generic_trainer import GenericTrainer
    from tools.gpu_check.parts.measure import memory_figures, reset_memory

    device = context.device
    work = context.work / f"{mode}-{fraction}"
    config = build_config([{
        "model": {"family": "sdxl", "base": str(model),
                  "parts": {"unet": {"weight_dtype": mode, "gradient_checkpointing": True, "offload_fraction": fraction}}},
        "concepts": [{"path": str(images)}], "data": {"resolution": 64}, "adapter": {"rank": 4},
        "schedule": {"max_steps": 2 if context.dry else STEPS, "batch_size": 1}, "train_dtype": "float32" if context.dry else "bfloat16",
        "train_device": str(device), "workspace_dir": str(work / "ws"), "cache_dir": str(context.work / "cache"),
        "output": {"path": str(work / "out.safetensors")}, "tensorboard": False}])
    reset_memory(device)
    clock = clock_cls()
    trainer = GenericTrainer(config, clock)
    try:
        trainer.start()
        trainer.train()
        figures = {"steps_per_s": clock.steps_per_s(), "loss": round(trainer.last_loss, 4), **memory_figures(device)}
        conductor = trainer.conductors.get("unet")
        if conductor is not None:
            figures["blocks_parked"] = f"{len(conductor.parked)} of {len(conductor.blocks)}"
            figures["blocks_brought"] = conductor.moves
    finally:
        trainer.release()
    if trainer.last_loss != trainer.last_loss:
        return {"status": "failed", "reason": "non-finite loss", "figures": figures}
    return {"status": "passed", "figures": figures}


def run(context) -> dict:
    from modules.data.synthetic_images import write_shape_images
    from modules.model.sdxl import SDXLFamily
    from modules.quantization.capabilities import detect_capabilities, mode_support
    from tools.gpu_check.part import record_case, summary
    from tools.gpu_check.parts.measure import StepClock

    started = time.monotonic()
    model = SDXLFamily.make_tiny_model(context.work / "model")
    images = context.work / "images"
    write_shape_images(images, count=4, width=64, height=64)
    support = mode_support(detect_capabilities(context.device))
    modes = ["float32"] if context.dry else list(support)
    cases = []
    for mode in modes:
        for fraction in (0.0, 0.5):
            name = f"{mode} offload {fraction}"
            if not support[mode].works:
                cases.append({"name": name, "status": "skipped", "reason": support[mode].why})
                continue
            record_case(context, cases, name, partial(run_case, model, images, mode, fraction, context, StepClock),
                        started, CASE_SECONDS)
            if context.device.type == "cuda":
                torch.cuda.empty_cache()
    return {**summary(cases), "cases": cases}
