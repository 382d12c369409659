"""A short training run of every adapter type on the tiny model: the loss stays finite, every
adapter (and DoRA's magnitude) learns, the base weights do not move, the first-step guard passes,
and the saved file, in each key layout, continues training through `adapter.init_from`."""

from __future__ import annotations

import pytest
import torch
from conftest import train_config

from modules.trainer.generic_trainer import GenericTrainer

RUNS = {
    "lora": ({"type": "lora", "dropout": 0.1, "rank_dropout": 0.1, "module_dropout": 0.1}, "diffusers"),
    "dora": ({"type": "lora", "dora": True, "dora_axis": "output"}, "diffusers"),
    "dora-input": ({"type": "lora", "dora": True, "dora_axis": "input"}, "comfy"),
    "loha": ({"type": "loha", "dropout": 0.1, "rank_dropout": 0.1, "module_dropout": 0.1}, "kohya"),
    "lokr": ({"type": "lokr", "rank": 2, "factor": 4}, "comfy"),
    "lokr-wd": ({"type": "lokr", "rank": 2, "dora": True, "decompose_both": True}, "kohya"),
    "oft": ({"type": "oft", "block_size": 8, "rank_dropout": 0.1, "module_dropout": 0.1}, "comfy"),
}


def frozen_state(trainer):
    return {f"{part}.{k}": v.detach().clone() for part in ("unet", "text_encoder")
            for k, v in trainer.family.parts[part].state_dict().items()}


@pytest.mark.parametrize("kind", RUNS)
def test_each_type_trains_its_adapters_only_and_continues_from_its_file(tmp_path, quick_tiny_model, shape_images, kind):
    adapter, fmt = RUNS[kind]
    config = train_config(quick_tiny_model, shape_images, tmp_path / "a", {
        "model": {"parts": {"text_encoder": {"train": True}}},
        "adapter": {**adapter, "layer_preset": "all"},
        "schedule": {"epochs": 2, "max_steps": 3},
        "output": {"format": fmt},
    })
    trainer = GenericTrainer(config)
    trainer.start()
    base_before = frozen_state(trainer)
    adapters_before = {k: v.clone() for k, v in trainer.adapters.state_dict().items()}
    trainer.train()  # the first-step guard runs inside and must pass
    path = trainer.end()
    assert trainer.step == 3 and torch.isfinite(torch.tensor(trainer.last_loss))
    after = trainer.adapters.state_dict()
    unchanged = [a.name for a in trainer.adapters
                 if all(torch.equal(after[f"{a.name}.{k}"], adapters_before[f"{a.name}.{k}"]) for k, _ in a.named_parameters())]
    assert not unchanged, unchanged
    if adapter.get("dora"):
        magnitudes = [k for k in after if k.endswith(".dora_scale")]
        assert magnitudes and all(not torch.equal(after[k], adapters_before[k]) for k in magnitudes)
    base_after = frozen_state(trainer)
    assert all(torch.equal(base_after[k], base_before[k]) for k in base_before)

    resumed = GenericTrainer(train_config(quick_tiny_model, shape_images, tmp_path / "b", {
        "model": {"parts": {"text_encoder": {"train": True}}},
        "adapter": {**adapter, "layer_preset": "all", "init_from": str(path)},
        "schedule": {"max_steps": 1},
    }))
    resumed.start()
    loaded = resumed.adapters.state_dict()
    assert loaded.keys() == after.keys()
    assert all(torch.allclose(loaded[k], after[k], rtol=1e-5, atol=1e-7) for k in after)
    resumed.train()
    assert resumed.step == 1


def test_a_format_that_cannot_hold_the_adapter_fails_before_training(tmp_path, quick_tiny_model, shape_images):
    from modules.adapters.formats.files import AdapterFileError

    config = train_config(quick_tiny_model, shape_images, tmp_path, {"adapter": {"type": "oft"},
                                                                "output": {"format": "diffusers"}})
    trainer = GenericTrainer(config)
    with pytest.raises(AdapterFileError, match=r"output\.format: 'diffusers' cannot hold these adapters: peft's OFT"):
        trainer.start()
    assert trainer.step == 0


def test_per_part_rank_and_alpha(tmp_path, quick_tiny_model, shape_images):
    config = train_config(quick_tiny_model, shape_images, tmp_path, {
        "model": {"parts": {"text_encoder": {"train": True}}},
        "adapter": {"rank": 4, "alpha": 2, "parts": {"text_encoder": {"rank": 2, "alpha": 8}}},
        "schedule": {"max_steps": 1},
    })
    trainer = GenericTrainer(config)
    trainer.start()
    sizes = {(trainer.adapters.part_of[a.name], a.rank, float(a.alpha)) for a in trainer.adapters}
    assert sizes == {("unet", 4, 2.0), ("text_encoder", 2, 8.0)}


def test_an_unknown_part_override_is_named(tmp_path, quick_tiny_model, shape_images):
    from modules.adapters.adapter_set import AdapterSetError

    config = train_config(quick_tiny_model, shape_images, tmp_path, {"adapter": {"parts": {"vae": {"rank": 2}}}})
    with pytest.raises(AdapterSetError, match=r"^adapter\.parts\.vae: no part of Stable Diffusion 1\.5 carries adapters"):
        GenericTrainer(config).start()


def test_continuing_from_a_file_adopts_its_rank_and_dora_axis(tmp_path, quick_tiny_model, shape_images):
    """The run given only adapter.init_from (and its layers) takes the file's rank and output-axis
    DoRA instead of refusing it, says so, and starts from the file's tensors."""
    from modules.config.train_config import AdapterConfig
    from modules.trainer.callbacks import TrainCallbacks

    made = {"type": "lora", "rank": 2, "dora": True, "dora_axis": "output", "layer_preset": "attn"}
    first = GenericTrainer(train_config(quick_tiny_model, shape_images, tmp_path / "a", {
        "adapter": made, "schedule": {"epochs": 1, "max_steps": 1}}))
    first.start()
    first.train()
    path = first.end()
    saved = {k: v.clone() for k, v in first.adapters.state_dict().items()}

    class Warnings(TrainCallbacks):
        said: list[str] = []

        def on_warning(self, message):
            self.said.append(message)

    callbacks = Warnings()
    config = train_config(quick_tiny_model, shape_images, tmp_path / "b", {"schedule": {"epochs": 1, "max_steps": 1}})
    config.adapter = AdapterConfig(type="lora", layer_preset="attn", init_from=str(path))  # no rank, no DoRA given
    resumed = GenericTrainer(config, callbacks)
    resumed.start()
    assert resumed.config.adapter.rank == 2 and resumed.config.adapter.dora_axis == "output"
    assert [w for w in callbacks.said if "adopted the file's layout" in w and "adapter.rank: 2" in w], callbacks.said
    loaded = resumed.adapters.state_dict()
    assert loaded.keys() == saved.keys()
    assert all(torch.allclose(loaded[k], saved[k].to(loaded[k].dtype), atol=1e-3) for k in saved)


def test_a_run_that_adopted_its_start_files_layout_resumes(tmp_path, quick_tiny_model, shape_images):
    """The backup holds the adopted rank; resuming the same config (rank still unset) compares
    after the adoption, so nothing reads as changed."""
    from modules.config.train_config import AdapterConfig
    from modules.trainer.generic_trainer import GenericTrainer

    first = GenericTrainer(train_config(quick_tiny_model, shape_images, tmp_path / "a", {
        "adapter": {"type": "lora", "rank": 2, "layer_preset": "attn"}, "schedule": {"epochs": 1, "max_steps": 1}}))
    first.start()
    first.train()
    path = first.end()

    def config(resume: bool):
        made = train_config(quick_tiny_model, shape_images, tmp_path / "b", {
            "schedule": {"epochs": 2, "batch_size": 4, "backup_every": "1 epochs"}, "backup": {"resume": resume}})
        made.adapter = AdapterConfig(type="lora", layer_preset="attn", init_from=str(path))
        return made

    trainer = GenericTrainer(config(False))
    trainer.start()
    trainer.train()
    trainer.end()
    resumed = GenericTrainer(config(True))
    try:
        resumed.start()  # adopted after the backup check it would read "adapter.rank: 2 in the backup, 16 now"
    finally:
        resumed.release()
    assert resumed.config.adapter.rank == 2
