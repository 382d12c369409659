"""Parts the training step never runs (modules/data/step_parts.py) leave the train device once the
caches are filled and come back only for samples (modules/trainer/idle_parts.py), and the plan
counts them the same way (modules/plan/run_plan.py: nothing in the step, `outside_step` while
caching and sampling).

On the fake device: the training step's measured peak drops by the idle parts' resident bytes
(the guard: it fails when the trainer keeps them), the plan's step figure stays within 10% of the
measured step, waking them for samples brings no more than the plan's `outside_step`, samples are
made before and after steps, and a part the step does run (a text encoder with a LoRA) stays."""

from __future__ import annotations

import gc

import pytest
import torch

from conftest import train_config
from modules.config.loading import build_config
from modules.data.dataset import caches_text
from modules.data.step_parts import idle_parts
from modules.offload.layer_tensors import layer_tensors, tensor_bytes
from modules.trainer.callbacks import TrainCallbacks

STEPS = {"schedule": {"epochs": 1, "batch_size": 2, "max_steps": 2},
         "sampling": {"prompts": [{"prompt": "a red circle", "steps": 2, "width": 64, "height": 64, "seed": 1}]}}


def bytes_on(module: torch.nn.Module, device: torch.device) -> int:
    unique = {id(t.get()): t.get() for t in layer_tensors(module) if t.get().device.type == device.type}
    return sum(tensor_bytes(t) for t in unique.values())


def run(config, inspect_started=None, inspect_trained=None):
    """Start and train `config` on the fake device: (the training step's peak over what the device
    held before the run, and what the two inspections returned)."""
    from modules.trainer.generic_trainer import GenericTrainer

    memory = torch.get_device_module(config.train_device)
    gc.collect()
    before = memory.memory_allocated()
    trainer = GenericTrainer(config, TrainCallbacks())
    try:
        trainer.start()
        started = inspect_started(trainer, before) if inspect_started else None
        memory.reset_peak_memory_stats()
        trainer.train()
        peak = memory.max_memory_allocated() - before
        trained = inspect_trained(trainer, before) if inspect_trained else None
        assert trainer.step == 2
    finally:
        trainer.release()
    return peak, started, trained


@pytest.mark.parametrize("family", ["wan", "flux"])
def test_idle_parts_leave_the_device_for_the_training_step(family, fake_device, tmp_path, tiny_family_model,
                                                          shape_images, monkeypatch):
    import modules.trainer.generic_trainer as generic_trainer
    from modules.plan.run_plan import plan_run

    config = train_config(tiny_family_model(family), shape_images, tmp_path, STEPS,
                          {"model": {"family": family}, "train_device": str(fake_device)})
    plan = plan_run(config, None, None)
    idle = set(plan.parts) - {"transformer"}  # the text encoders and the VAE
    assert {name for name, part in plan.parts.items() if not sum(part.device.values())} == idle
    memory = torch.get_device_module(fake_device)

    def resident(trainer, before):  # the idle parts' bytes on the device once started
        return sum(bytes_on(trainer.family.parts[name], fake_device) for name in idle)

    def samples_fit(trainer, before):
        """Woken for samples: on the device, within what the plan says caching and sampling hold."""
        with trainer.offload_paused():
            woken = memory.memory_allocated() - before
            assert all(bytes_on(trainer.family.parts[name], fake_device) for name in idle)
        assert woken <= plan.outside_step * 1.10, f"woken {woken} bytes, planned {plan.outside_step}"
        assert resident(trainer, before) == 0  # gone again
        return trainer.sample()

    with monkeypatch.context() as patch:  # the trainer as it was: every part stays where caching used it
        patch.setattr(generic_trainer, "rest_idle_parts", lambda trainer, text_cached: [])
        kept_peak, kept, _ = run(train_config(tiny_family_model(family), shape_images, tmp_path / "kept", STEPS,
                                              {"model": {"family": family}, "train_device": str(fake_device)}),
                                 resident)
    def sampled_first(trainer, before):  # a sample before the first step leaves nothing behind either
        assert trainer.sample() and resident(trainer, before) == 0
        return resident(trainer, before)

    peak, left, samples = run(config, sampled_first, samples_fit)
    assert kept > 0 and left == 0
    # the step no longer holds them: its peak is lower by their bytes (allocator rounding aside)
    assert kept_peak - peak == pytest.approx(kept, rel=0.02), f"peak {kept_peak} -> {peak}, idle bytes {kept}"
    assert plan.step_peak == pytest.approx(peak, rel=0.10), f"planned step {plan.step_peak}, measured {peak}"
    assert samples and all(path.exists() for path in samples)


def test_a_text_encoder_the_step_trains_stays_on_the_device(fake_device, tmp_path, tiny_family_model, shape_images):
    config = train_config(tiny_family_model("wan"), shape_images, tmp_path, STEPS, {
        "model": {"family": "wan", "parts": {"text_encoder": {"train": True}}}, "train_device": str(fake_device)})

    def placed(trainer, before):
        return {name: bytes_on(module, fake_device) for name, module in trainer.family.parts.items()}

    _, started, trained = run(config, placed, lambda trainer, before: trainer.sample() and placed(trainer, before))
    for where in (started, trained):
        assert where["text_encoder"] > 0 and where["transformer"] > 0 and where["vae"] == 0


def test_the_step_runs_the_text_encoders_with_embeddings_and_the_vae_with_fresh_latents(tiny_family_model):
    from modules.config.families import get_family_class

    def idle(*overlays):
        config = build_config([{"model": {"family": "wan", "base": str(tiny_family_model("wan"))}}, *overlays])
        family = get_family_class("wan")(config)
        return idle_parts(config, family, ["transformer"], caches_text(config, family))

    assert idle() == ("text_encoder", "vae")
    assert idle({"embeddings": [{"placeholder": "<tok>", "vectors": 1}]}) == ("vae",)
    assert idle({"data": {"cache_latents": False}}) == ("text_encoder",)
