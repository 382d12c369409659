"""What each family file checks the same way: a base precision x {LoRA, DoRA} initializes, takes
an optimizer step (the trainer's first-step guard: every adapter tensor learned), and the
denoiser's Linear layers really are stored in that precision; blocks run in order; offloading
trains the same adapter; and the helpers the diffusers-load tests share."""

from __future__ import annotations

import math

import pytest
from conftest import train_config

MODES = ["bfloat16", "float8", "nf4"]


def initializes_and_steps(model, images, workspace, family: str, part: str, mode: str, dora: bool,
                          overlay: dict | None = None) -> None:
    from modules.quantization.capabilities import detect_capabilities
    from modules.trainer.generic_trainer import GenericTrainer

    if mode == "nf4" and not detect_capabilities("cpu").bitsandbytes:
        pytest.skip("nf4 needs a working bitsandbytes on this machine")
    config = train_config(model, images, workspace, {
        "model": {"family": family, "parts": {part: {"weight_dtype": mode}}},
        "adapter": {"dora": dora, "layer_preset": "attn-mlp"},
        "schedule": {"max_steps": 1, "batch_size": 1},
    }, overlay or {})
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


def offloaded_training_matches(model, images, workspace, family: str, part: str, device,
                               overlay: dict | None = None, also: tuple[str, ...] = ()):
    """Half of the denoiser's blocks parked on the CPU, and the blocks' saved inputs too (the
    transformers get them as keywords), while training on `device` gives the same adapter as
    keeping them all resident. `also`: other parts parked the same way (Wan 2.2's other expert).
    Returns the offloaded run's trainer."""
    from unittest import mock

    import torch
    import torch.utils.checkpoint as checkpoint_module

    from modules.trainer.generic_trainer import GenericTrainer

    kept = []  # the devices of the tensors each checkpoint keeps for its recomputation
    original = checkpoint_module.checkpoint

    def recording(function, *args, **kwargs):
        # (the preflight plan's own pass checkpoints meta tensors, which training never holds: not counted)
        kept.extend(t.device.type for t in [*args, *kwargs.values()]
                    if isinstance(t, torch.Tensor) and t.numel() and not t.is_meta)
        return original(function, *args, **kwargs)

    def run(fraction, where):
        settings = {"gradient_checkpointing": True, "offload_fraction": fraction, "activation_offloading": fraction > 0}
        config = train_config(model, images, where, {
            "model": {"family": family, "parts": dict.fromkeys((part, *also), settings)},
            "schedule": {"epochs": 2, "batch_size": 1}, "train_device": str(device)}, overlay or {})
        trainer = GenericTrainer(config)
        trainer.start()
        trainer.train()
        return trainer

    plain = run(0.0, workspace / "plain")
    with mock.patch.object(checkpoint_module, "checkpoint", recording):
        offloaded = run(0.5, workspace / "half")
    assert all(offloaded.conductors[p].parked for p in (part, *also))
    assert kept and set(kept) == {"cpu"}, sorted(set(kept))
    ours, theirs = offloaded.adapters.state_dict(), plain.adapters.state_dict()
    for key in theirs:
        torch.testing.assert_close(ours[key].cpu(), theirs[key].cpu(), atol=1e-5, rtol=0)
    return offloaded


def resumed_training_matches(model, images, workspace, family: str, overlay: dict | None = None) -> None:
    """A run stopped after its first step (which writes a backup) and resumed gives the adapter of
    an uninterrupted run."""
    import torch

    from modules.trainer.callbacks import TrainCallbacks
    from modules.trainer.commands import TrainCommands
    from modules.trainer.generic_trainer import GenericTrainer

    class StopAfterFirstStep(TrainCallbacks):
        def __init__(self, commands):
            self.commands = commands

        def on_progress(self, progress):
            if progress.step == 1:
                self.commands.stop()

    def config(where):
        return train_config(model, images, where, {"model": {"family": family},
                                                   "schedule": {"epochs": 2, "batch_size": 1}}, overlay or {})

    straight = GenericTrainer(config(workspace / "straight"))
    straight.start()
    straight.train()
    interrupted = config(workspace / "resumed")
    commands = TrainCommands()
    first = GenericTrainer(interrupted, StopAfterFirstStep(commands), commands)
    first.start()
    first.train()
    halfway = {k: v.clone() for k, v in first.adapters.state_dict().items()}
    assert first.step == 1
    resumed = GenericTrainer(interrupted.model_copy(update={"backup": interrupted.backup.model_copy(update={"resume": True})}))
    resumed.start()
    resumed.train()
    assert resumed.step == straight.step >= 2
    expected, actual = straight.adapters.state_dict(), resumed.adapters.state_dict()
    assert any(not torch.allclose(halfway[k], expected[k]) for k in expected)  # the comparison is not vacuous
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], atol=1e-6, rtol=0)


def perturbed_adapters(family, parts, **options):
    """An adapter set on `parts` whose every tensor moved off its start (a fresh LoRA's up is zero,
    so it would compute nothing a loader could get wrong)."""
    import torch

    from modules.adapters.adapter_set import build_adapter_set
    from modules.config.train_config import AdapterConfig

    adapters = build_adapter_set(family, AdapterConfig(**{"rank": 4, "alpha": 2, **options}), parts,
                                 torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in adapters.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return adapters


def prediction_with(family, transformer, latent_channels: int):
    """The family's denoiser prediction on fixed latents and prompt, with `transformer` in place of
    its own (e.g. a diffusers pipeline's, with a file loaded)."""
    import torch

    latents = torch.randn(1, latent_channels, 8, 8, generator=torch.Generator().manual_seed(1))
    original = family.parts["transformer"]
    family.parts["transformer"] = transformer
    try:
        with torch.no_grad():
            text = family.encode_text(family.tokenize(["a red circle on a blue background"]))
            return family.denoise(latents, torch.tensor([0.5]), text)
    finally:
        family.parts["transformer"] = original


def loads_beside_a_skeleton_denoiser(family):
    """The family's load() with its denoiser a skeleton part (as `launch.py cache` loads it) runs
    unchanged: the denoiser is its architecture on meta with its config, no weight of it is read,
    and every other part holds the tensors of the full load. Returns the skeleton-loaded family."""
    import torch

    from modules.loading import streamed_load

    skeleton = type(family)(family.config, family.weight_modes)
    skeleton.model_configs_dir = family.model_configs_dir
    skeleton.skeleton_parts = frozenset({family.denoiser_part})
    read, stream = [], streamed_load.load_streamed

    def spied(model, folder, **kwargs):
        read.append(kwargs["part"])
        return stream(model, folder, **kwargs)

    streamed_load.load_streamed = spied
    try:
        skeleton.load()
    finally:
        streamed_load.load_streamed = stream
    assert sorted(read) == sorted(set(family.parts) - {family.denoiser_part})
    denoiser, full = skeleton.parts[family.denoiser_part], family.parts[family.denoiser_part]
    assert dict(denoiser.config) == dict(full.config)
    assert all(p.is_meta for p in denoiser.parameters())
    assert {n: p.shape for n, p in denoiser.named_parameters()} == {n: p.shape for n, p in full.named_parameters()}
    for part in read:
        ours, theirs = skeleton.parts[part].state_dict(), family.parts[part].state_dict()
        assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours), part
    return skeleton
