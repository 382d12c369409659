"""The cross-product check each family file runs: a base precision x {LoRA, DoRA} initializes,
takes an optimizer step (the trainer's first-step guard: every adapter tensor learned), and
the denoiser's Linear layers really are stored in that precision."""

from __future__ import annotations

import math

import pytest
from conftest import train_config

MODES = ["bfloat16", "float8", "nf4"]


def initializes_and_steps(model, images, workspace, family: str, part: str, mode: str, dora: bool) -> None:
    from modules.quantization.capabilities import detect_capabilities
    from modules.trainer.generic_trainer import GenericTrainer

    if mode == "nf4" and not detect_capabilities("cpu").bitsandbytes:
        pytest.skip("nf4 needs a working bitsandbytes on this machine")
    config = train_config(model, images, workspace, {
        "model": {"family": family, "parts": {part: {"weight_dtype": mode}}},
        "adapter": {"dora": dora, "layer_preset": "attn-mlp"},
        "schedule": {"max_steps": 1, "batch_size": 1},
    })
    trainer = GenericTrainer(config)
    trainer.start()
    trainer.train()
    assert trainer.step == 1 and math.isfinite(trainer.last_loss)
    if mode != "bfloat16":
        assert trainer.family.quantization_reports[part].quantized
    if dora:
        assert any(name.endswith("dora_scale") for name, _ in trainer.adapters.named_parameters())


def blocks_run_in_listed_order(family, part: str, run) -> None:
    """checkpoint_blocks(part) is the order the part runs its blocks (what the offloader prefetches by)."""
    import torch

    blocks = family.checkpoint_blocks(part)
    ran, handles = [], [b.register_forward_pre_hook(lambda module, args: ran.append(module)) for b in blocks]
    try:
        with torch.no_grad():
            run()
    finally:
        for handle in handles:
            handle.remove()
    assert [id(b) for b in ran] == [id(b) for b in blocks]
    assert len(blocks) == len({id(b) for b in blocks}) > 1


def offloaded_training_matches(model, images, workspace, family: str, part: str, device) -> None:
    """Half of the denoiser's blocks parked on the CPU while training on `device` gives the same
    adapter as keeping them all resident."""
    import torch

    from modules.trainer.generic_trainer import GenericTrainer

    def run(fraction, where):
        config = train_config(model, images, where, {
            "model": {"family": family, "parts": {part: {"gradient_checkpointing": True, "offload_fraction": fraction}}},
            "schedule": {"epochs": 2, "batch_size": 1}, "train_device": str(device)})
        trainer = GenericTrainer(config)
        trainer.start()
        trainer.train()
        return trainer

    plain, offloaded = run(0.0, workspace / "plain"), run(0.5, workspace / "half")
    assert offloaded.conductors[part].parked
    ours, theirs = offloaded.adapters.state_dict(), plain.adapters.state_dict()
    for key in theirs:
        torch.testing.assert_close(ours[key].cpu(), theirs[key].cpu(), atol=1e-5, rtol=0)
