"""End-to-end training on the tiny model: learning, files other tools load, resume, guards."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import pytest
import torch
from conftest import fixed_loss, train_config
from safetensors import safe_open

from modules.trainer.callbacks import TrainCallbacks
from modules.trainer.generic_trainer import GenericTrainer
from modules.trainer.training_state import training_state
from modules.trainer.guards import TrainingError


class Recorder(TrainCallbacks):
    def __init__(self, stop_at: int | None = None, commands=None):
        self.events: list[tuple[str, object]] = []
        self.stop_at, self.commands = stop_at, commands

    def on_progress(self, progress):
        self.events.append(("progress", progress.step))
        if self.stop_at is not None and progress.step == self.stop_at:
            self.commands.stop()

    def on_sample(self, path):
        self.events.append(("sample", path))

    def on_backup(self, path):
        self.events.append(("backup", path))

    def on_save(self, path, consumers=None):
        self.events.append(("save", path))

    def on_warning(self, message):
        self.events.append(("warning", message))

    def of(self, kind):
        return [value for name, value in self.events if name == kind]


def run(config, callbacks=None, commands=None) -> GenericTrainer:
    trainer = GenericTrainer(config, callbacks, commands)
    trainer.start()
    trainer.train()
    trainer.end()
    return trainer


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model, one_image):
    """One short overfit run on one image, training UNet and text encoder on every layer kind."""
    work = tmp_path_factory.mktemp("trained")
    config = train_config(tiny_model, one_image, work, {
        "model": {"parts": {"text_encoder": {"train": True}}},
        "adapter": {"layer_preset": "all"},
        # 25 steps: fixed_loss falls to 0.55-0.58x of its start over seeds 42, 1, 2, 3 (the test needs < 0.8x)
        "schedule": {"epochs": 25, "batch_size": 1},
        "optimizer": {"lr": 3e-3},
        "sampling": {"prompts": [{"prompt": "a red circle", "steps": 4, "width": 64, "height": 64, "seed": 7}]},
    })
    trainer = GenericTrainer(config, Recorder())
    trainer.start()
    before = fixed_loss(trainer)
    trainer.train()
    after = fixed_loss(trainer)
    path = trainer.end()
    return trainer, path, before, after


def test_loss_falls_on_one_image_overfit(trained):
    _, _, before, after = trained
    assert after < before * 0.8, (before, after)


def test_saved_file_is_kohya_format_with_metadata(trained):
    trainer, path, _, _ = trained
    with safe_open(str(path), "pt") as file:
        keys = list(file.keys())
        metadata = file.metadata()
    stems = {k.split(".")[0] for k in keys}
    assert all(s.startswith(("lora_unet_", "lora_te_text_model_")) for s in stems)
    assert any(s.startswith("lora_te_text_model_encoder_layers_0_") for s in stems)
    for stem in stems:
        assert {f"{stem}.lora_down.weight", f"{stem}.lora_up.weight", f"{stem}.alpha"} <= set(keys)
    assert metadata["ss_network_dim"] == "4" and metadata["ss_network_alpha"] == "2.0"
    assert metadata["difftrainer.family"] == "sd15"
    assert metadata["ss_steps"] == str(trainer.step) and int(metadata["ss_steps"]) == 25
    assert metadata["ss_sd_model_name"] == "tiny-sd15"


def test_diffusers_loads_the_file_and_matches_the_hooked_model(trained, tiny_model):
    from diffusers import StableDiffusionPipeline

    trainer, path, _, _ = trained
    family = trainer.family
    pipe = StableDiffusionPipeline.from_pretrained(str(tiny_model), safety_checker=None, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    untouched = pipe.unet(torch.zeros(1, 4, 32, 32), 10, encoder_hidden_states=torch.zeros(1, 77, 32)).sample
    pipe.load_lora_weights(str(path))
    ids = family.tokenize(["a red circle on a blue background"])["input_ids"]
    latents = torch.randn(1, 4, 32, 32, generator=torch.Generator().manual_seed(0))
    timestep = torch.tensor([500])
    for module in family.parts.values():
        module.eval()
    with torch.no_grad():
        ours_text = family.encode_text({"input_ids": ids})["hidden_states"]
        theirs_text = pipe.text_encoder(ids)[0]
        ours = family.unet(latents, timestep, encoder_hidden_states=ours_text).sample
        theirs = pipe.unet(latents, timestep, encoder_hidden_states=ours_text).sample
        trainer.adapters.unhook()
        plain = family.unet(latents, timestep, encoder_hidden_states=ours_text).sample
        trainer.adapters.hook()
        lora_on_zero = pipe.unet(torch.zeros(1, 4, 32, 32), 10, encoder_hidden_states=torch.zeros(1, 77, 32)).sample
    assert (ours_text - theirs_text).abs().max() < 1e-4
    assert (ours - theirs).abs().max() < 1e-4
    assert (ours - plain).abs().max() > 1e-2  # the adapter does something worth matching
    assert (lora_on_zero - untouched).abs().max() > 0

    # whole pipeline, same seed: the image with the file loaded equals the trainer's own sample
    prompt = trainer.config.sampling.prompts[0]
    with torch.no_grad():
        ours_image = family.sample(prompt, torch.device("cpu"))
        pipe.scheduler = family.pipeline().scheduler
        theirs_image = pipe(prompt.prompt, num_inference_steps=prompt.steps, guidance_scale=prompt.cfg,
                            width=64, height=64, generator=torch.Generator().manual_seed(prompt.seed)).images[0]
        pipe.unload_lora_weights()
        plain_image = pipe(prompt.prompt, num_inference_steps=prompt.steps, guidance_scale=prompt.cfg,
                           width=64, height=64, generator=torch.Generator().manual_seed(prompt.seed)).images[0]
    as_array = lambda image: torch.tensor(list(image.getdata()), dtype=torch.float32)  # noqa: E731
    assert (as_array(ours_image) - as_array(theirs_image)).abs().max() <= 2  # 8-bit rounding
    assert (as_array(ours_image) - as_array(plain_image)).abs().max() > 2  # the LoRA changes the image


def test_resume_reaches_the_same_adapter(tmp_path, quick_tiny_model, shape_images):
    from modules.trainer.commands import TrainCommands

    overlay = {"schedule": {"epochs": 3, "batch_size": 2}, "adapter": {"dropout": 0.1}}
    straight = run(train_config(quick_tiny_model, shape_images, tmp_path / "a", overlay))

    config = train_config(quick_tiny_model, shape_images, tmp_path / "b", overlay)
    commands = TrainCommands()
    recorder = Recorder(stop_at=3, commands=commands)
    first = GenericTrainer(config, recorder, commands)
    first.start()
    first.train()
    assert first.step == 3 and len(recorder.of("backup")) == 1
    resumed = run(config.model_copy(update={"backup": config.backup.model_copy(update={"resume": True})}))
    assert resumed.step == straight.step == 6

    expected, actual = straight.adapters.state_dict(), resumed.adapters.state_dict()
    assert expected.keys() == actual.keys()
    for key in expected:
        assert torch.allclose(expected[key], actual[key], atol=1e-6, rtol=0), key
    # and the first half alone really is different (the comparison is not vacuous)
    assert any(not torch.allclose(first.adapters.state_dict()[k], expected[k]) for k in expected)


def test_resume_refuses_a_changed_adapter_shape(tmp_path, quick_tiny_model, shape_images):
    config = train_config(quick_tiny_model, shape_images, tmp_path, {"schedule": {"max_steps": 1}})
    trainer = run(config)
    trainer.backup()
    changed = train_config(quick_tiny_model, shape_images, tmp_path,
                           {"adapter": {"rank": 8}, "backup": {"resume": True}})
    with pytest.raises(TrainingError, match=r"adapter\.rank: 4 in the backup, 8 now"):
        GenericTrainer(changed).start()


def test_guard_fires_when_an_adapter_trains_a_copy(tmp_path, quick_tiny_model, shape_images):
    trainer = GenericTrainer(train_config(quick_tiny_model, shape_images, tmp_path, {"schedule": {"max_steps": 2}}))
    trainer.start()
    victim = next(iter(trainer.adapters))
    victim.unhook()
    victim._base[0] = copy.deepcopy(victim.base)  # what a wrapper that copies its layer does
    victim.hook()
    with pytest.raises(TrainingError, match=victim.name + r"(,|$)") as error:
        trainer.train()
    assert "received no gradient" in str(error.value)
    assert trainer.step == 0


def test_guard_fires_when_the_optimizer_does_not_hold_a_parameter(tmp_path, quick_tiny_model, shape_images):
    trainer = GenericTrainer(train_config(quick_tiny_model, shape_images, tmp_path, {"schedule": {"max_steps": 2}}))
    trainer.start()
    victim = next(iter(trainer.adapters))
    for group in trainer.optimizer.param_groups:
        group["params"] = [p for p in group["params"] if p is not victim.lora_up.weight]
    with pytest.raises(TrainingError, match=f"{victim.name}.lora_up.weight"):
        trainer.train()


def test_non_finite_loss_stops_naming_the_step_and_keeps_the_last_backup(tmp_path, quick_tiny_model, shape_images):
    from modules.saving.backup import newest_backup, read_backup

    config = train_config(quick_tiny_model, shape_images, tmp_path,
                          {"schedule": {"epochs": 5, "backup_every": "1 steps"}})
    trainer = GenericTrainer(config)
    trainer.start()
    real_predict = trainer.family.predict
    calls = {"n": 0}

    def predict(latents, text, generator):
        calls["n"] += 1
        out = real_predict(latents, text, generator)
        return out._replace(prediction=out.prediction * float("nan")) if calls["n"] == 3 else out

    trainer.family.predict = predict
    with pytest.raises(TrainingError, match="at step 3"):
        trainer.train()
    newest = newest_backup(trainer.workspace)
    assert newest is not None and newest.name.endswith("step0000002")
    adapter, state, _ = read_backup(newest)
    assert state["step"] == 2 and all(torch.isfinite(t).all() for t in adapter.values())


def test_commands_sample_backup_save_now(tmp_path, quick_tiny_model, shape_images):
    from modules.trainer.commands import TrainCommands

    commands = TrainCommands()
    commands.sample_now()
    commands.backup_now()
    commands.save_now()
    recorder = Recorder()
    config = train_config(quick_tiny_model, shape_images, tmp_path, {
        "schedule": {"max_steps": 1},
        "sampling": {"prompts": [{"prompt": "a square", "steps": 2, "width": 64, "height": 64}]},
    })
    run(config, recorder, commands)
    (sample,) = recorder.of("sample")
    (backup,) = recorder.of("backup")
    step_save, final_save = recorder.of("save")
    assert Path(sample).is_file() and Path(sample).parent == Path(config.workspace_dir) / "samples"
    assert (Path(backup) / "adapter.safetensors").is_file()
    assert Path(step_save).name == "lora-step0000001.safetensors" and Path(step_save).is_file()
    assert Path(final_save) == Path(config.output.path) and Path(final_save).is_file()


def test_unreadable_images_are_skipped_and_named(tmp_path, quick_tiny_model, shape_images):
    folder = tmp_path / "mixed"
    shutil.copytree(shape_images, folder)
    (folder / "garbage.png").write_bytes(b"this is not a png")
    good = sorted(folder.glob("*.png"))[0].read_bytes()
    (folder / "truncated.png").write_bytes(good[: len(good) // 2])
    recorder = Recorder()
    config = train_config(quick_tiny_model, folder, tmp_path, {"schedule": {"max_steps": 1}})
    trainer = run(config, recorder)
    warnings = " ".join(recorder.of("warning"))
    assert "garbage.png" in warnings and "truncated.png" in warnings
    assert len(trainer.dataset.entries) == 4 and trainer.step == 1


def test_a_concept_without_usable_images_is_an_error_naming_it(tmp_path, tiny_model, shape_images):
    from modules.data.concepts import DataError

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "a.png").write_bytes(b"nope")
    config = train_config(tiny_model, shape_images, tmp_path, {})
    config = config.model_copy(update={"concepts": [config.concepts[0], config.concepts[0].model_copy(update={"path": str(broken)})]})
    with pytest.raises(DataError, match=rf"concepts\[1\]\.path: no usable image in {broken}"):
        GenericTrainer(config).start()


def test_bfloat16_weights_and_autocast_train_and_log_to_tensorboard(tmp_path, quick_tiny_model, shape_images):
    config = train_config(quick_tiny_model, shape_images, tmp_path, {
        "model": {"parts": {"unet": {"weight_dtype": "bfloat16"}, "text_encoder": {"weight_dtype": "bfloat16"}}},
        "train_dtype": "bfloat16",
        "tensorboard": True,
        "schedule": {"max_steps": 2},
    })
    trainer = run(config)
    assert trainer.step == 2 and trainer.family.unet.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in trainer.adapters.parameters())
    assert list((Path(config.workspace_dir) / "tensorboard").glob("events.out.tfevents.*"))


def test_gradient_accumulation_steps_once_per_group_and_per_epoch_end(tmp_path, quick_tiny_model, shape_images):
    recorder = Recorder()
    config = train_config(quick_tiny_model, shape_images, tmp_path, {
        "schedule": {"epochs": 2, "batch_size": 1, "gradient_accumulation": 3},
    })
    trainer = run(config, recorder)
    # 4 batches an epoch in groups of 3 and 1: two optimizer steps an epoch
    assert trainer.steps_per_epoch == 2 and trainer.total_steps == 4
    assert recorder.of("progress") == [1, 2, 3, 4]
    assert trainer.optimizer.state[trainer.adapters.parameters()[0]]["step"] == 4


def test_backups_roll_keeping_the_newest(tmp_path, quick_tiny_model, shape_images):
    from modules.saving.backup import list_backups

    config = train_config(quick_tiny_model, shape_images, tmp_path, {
        "schedule": {"epochs": 2, "backup_every": "1 steps"}, "backup": {"rolling_count": 2},
    })
    trainer = run(config)
    names = [b.name for b in list_backups(trainer.workspace)]
    assert len(names) == 2 and names[-1].endswith("step0000004") and names[0].endswith("step0000003")


def test_float16_autocast_trains_with_loss_scaling_and_resumes_its_scaler(tmp_path, quick_tiny_model, shape_images):
    config = train_config(quick_tiny_model, shape_images, tmp_path,
                          {"train_dtype": "float16", "schedule": {"max_steps": 2}})
    trainer = run(config)
    assert trainer.step == 2 and trainer.scaler.is_enabled()
    assert training_state(trainer)["scaler"]["scale"] > 0


def test_a_missing_concept_folder_fails_before_the_model_loads(tmp_path, tiny_model, shape_images):
    from modules.data.concepts import DataError

    config = train_config(tiny_model, tmp_path / "no-such-folder", tmp_path)
    trainer = GenericTrainer(config)
    with pytest.raises(DataError, match=r"^concepts\[0\]\.path: .*no-such-folder is not a folder"):
        trainer.start()
    assert trainer.family is None
