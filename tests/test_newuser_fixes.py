"""Defects a new user meets on the CLI's first runs (the README's recipes, then typos)."""

import io

import pytest

from modules.cli.console import ConsoleCallbacks
from modules.config.errors import ConfigError
from modules.config.loading import build_config
from modules.config.presets import find_preset
from modules.trainer.callbacks import Progress


def test_the_last_step_of_the_last_epoch_reads_epoch_n_of_n():
    # the trainer counts the epoch done before it reports the step that finished it
    stream = io.StringIO()
    ConsoleCallbacks(stream).on_progress(Progress(step=4, total_steps=4, epoch=1, epochs=1, loss=0.5, lr=1e-4,
                                                  it_per_s=1.0, eta_s=0.0))
    assert "step 4/4 epoch 1/1 " in stream.getvalue(), stream.getvalue()


@pytest.mark.parametrize("override, line", [
    ("schedule.epoch=3", "schedule.epoch: unknown key; did you mean 'epochs'?"),
    ("concepts[0].repets=2", "concepts[0].repets: unknown key; did you mean 'repeats'?"),
    ("model.parts.unet.learning_rat=1", "model.parts.unet.learning_rat: unknown key; did you mean 'learning_rate'?"),
    ("adapter.rnk=4", "adapter.rnk: unknown key; did you mean 'rank'?"),
    ("schedul.epochs=1", "schedul: unknown key; did you mean 'schedule'?"),
])
def test_a_typo_d_config_key_names_the_key_it_meant(override, line):
    with pytest.raises(ConfigError) as raised:
        build_config([{"concepts": [{"path": "x"}]}], overrides=(override,))
    assert line in raised.value.problems


def test_a_key_of_another_member_of_a_tagged_section_is_not_suggested_as_itself():
    # `dora` is a LoRA option: LoHa has none, so the message must not read "did you mean 'dora'?"
    with pytest.raises(ConfigError) as raised:
        build_config([{"adapter": {"type": "loha", "dora": True}}])
    assert raised.value.problems == ["adapter.dora: unknown key"]


def test_a_preset_name_with_a_typo_names_the_preset_it_meant():
    with pytest.raises(ConfigError, match=r"preset 'SD15 LoRA' not found; did you mean 'SD1.5 LoRA'\?"):
        find_preset("SD15 LoRA")


def test_every_option_of_every_subcommand_says_what_it_does_in_its_help():
    import argparse

    import launch

    parser = launch.build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    silent = [f"{name} {action.dest}" for name, command in sub.choices.items() for action in command._actions
              if not action.help and not isinstance(action, argparse._HelpAction)]
    assert silent == []


def test_make_tiny_model_with_a_typo_d_family_names_the_family_it_meant(capsys):
    import launch

    assert launch.main(["make-tiny-model", "--family", "sdx", "--out", "unused"]) == 2
    assert "--family: unknown family 'sdx'; did you mean 'sdxl'?" in capsys.readouterr().err


def test_an_init_from_of_another_family_with_another_rank_says_whose_it_is(tmp_path):
    import torch
    from safetensors.torch import save_file

    from modules.adapters.formats.adopt import adopt_file_layout
    from modules.adapters.formats.files import AdapterFileError
    from modules.config.adapter_configs import AdapterConfig

    path = tmp_path / "flux-lora.safetensors"
    save_file({"lora_transformer_single_blocks_0_attn_to_q.lora_down.weight": torch.zeros(4, 8),
               "lora_transformer_single_blocks_0_attn_to_q.lora_up.weight": torch.zeros(8, 4)}, str(path),
              metadata={"difftrainer.family": "flux"})
    with pytest.raises(AdapterFileError, match=r"settings \(its header says it is an adapter of model.family 'flux'; "
                                               r"this run trains 'sd15'\): adapter.rank is 32"):
        adopt_file_layout(AdapterConfig(rank=32, init_from=str(path)), path, "kohya", "sd15")


def test_a_gpu_class_with_a_typo_names_the_class_it_meant():
    from modules.plan.gpu_classes import gpu_class

    with pytest.raises(ValueError, match=r"unknown GPU class 'rtx4009'; did you mean 'rtx4090'\?"):
        gpu_class("rtx4009")


def test_a_set_key_that_cannot_be_read_shows_the_form_of_one():
    with pytest.raises(ConfigError, match=r"--set concepts\[0\]path: cannot read the key \(names joined by '\.', "
                                          r"list items by \[index\]"):
        build_config([{}], overrides=("concepts[0]path=x",))


def test_an_unknown_model_part_names_the_part_it_meant():
    with pytest.raises(ConfigError) as raised:
        build_config([{"model": {"family": "sd15", "parts": {"unte": {"train": False}}}}])
    assert raised.value.problems == ["model.parts.unte: unknown part for family 'sd15'; did you mean 'unet'? "
                                     "(parts: text_encoder, unet, vae)"]


@pytest.mark.parametrize("layer, start", [
    ({"adapter": {"type": "lroa"}}, "adapter.type: unknown type 'lroa'; did you mean 'lora'? (known: "),
    ({"model": {"family": "sdlx"}}, "model.family: unknown family 'sdlx'; did you mean 'sdxl'? (known: "),
    ({"model": {"parts": {"unet": {"weight_dtype": "flaot8"}}}},
     "model.parts.unet.weight_dtype: unknown weight mode 'flaot8'; did you mean 'float8'? (known: "),
])
def test_a_typo_d_choice_names_the_choice_it_meant(layer, start):
    with pytest.raises(ConfigError) as raised:
        build_config([layer])
    assert any(line.startswith(start) for line in raised.value.problems), raised.value.problems


def test_a_typo_d_fixed_choice_names_the_choice_it_meant():
    with pytest.raises(ConfigError) as raised:
        build_config([{"lr_scheduler": {"type": "cosin"}}])
    assert raised.value.problems[0].endswith("(got 'cosin'; did you mean 'cosine'?)"), raised.value.problems


def test_the_stop_message_promises_no_backup_a_stop_during_the_load_cannot_write():
    from modules.cli.stop_signals import TRAINING_STOP

    # stopped while loading or caching, the run writes nothing ("stopped before the first step")
    assert TRAINING_STOP.endswith("a backup and the output are written if a step has run")


needs_cpu_torch = pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a CUDA device is there")


@needs_cpu_torch
def test_a_train_device_this_torch_lacks_reads_no_free_memory_and_raises_nothing():
    import torch

    from modules.trainer.fit_check import free_device_memory

    # the planned autos ask before preflight, which then names train_device (was: an AssertionError traceback)
    assert free_device_memory(torch.device("cuda")) is None


@needs_cpu_torch
def test_plan_for_a_gpu_this_machine_lacks_asks_for_vram():
    from modules.cli.plan_command import SizeError, default_budget
    from modules.config.loading import build_config

    config = build_config([{"train_device": "cuda"}])
    with pytest.raises(SizeError, match=r"train_device: 'cuda' is not available here .*give --vram SIZE"):
        default_budget(config)
    assert default_budget(config, read_vram=False)[0] is None  # --vram given: the device is not asked


@needs_cpu_torch
def test_cache_on_a_train_device_this_torch_lacks_names_it_before_the_load(tmp_path):
    from modules.cli.cache_command import build_caches
    from modules.config.loading import build_config
    from modules.errors import UserError

    config = build_config([{"train_device": "cuda", "workspace_dir": str(tmp_path / "ws"),
                            "model": {"base": str(tmp_path / "no-model")}, "concepts": [{"path": str(tmp_path)}]}])
    with pytest.raises(UserError, match=r"^train_device: 'cuda' is not available here"):
        build_caches(config)


def test_the_window_s_validation_names_the_key_a_typo_d_one_meant():
    """A config opened in the GUI with a typo'd key shows the same "did you mean" as the CLI."""
    from ui.state import ConfigState, default_data

    data = default_data()
    data["schedule"]["epoch"] = 3
    state = ConfigState(data)
    assert "did you mean 'epochs'" in state.errors["schedule.epoch"], state.problems
