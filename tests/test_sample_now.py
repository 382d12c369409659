"""Sampling from outside the loop: `{"command": "sample", "prompt": {...}}` samples that prompt at
the next step (the GUI prompt editor's "Sample now"), and a prompt with `enabled: false` stays in
the config but is not sampled. Through the CLI, as the GUI and remote runs drive it."""

from __future__ import annotations

import json

from conftest import ROOT, train_config
from forked_launch import launch_run

from modules.trainer.commands import TrainCommands
from modules.trainer.event_protocol import apply_command, parse_command


def test_a_sample_command_may_carry_a_prompt_of_its_own():
    command = parse_command('{"command": "sample", "prompt": {"prompt": "a cat", "steps": 2}}')
    assert command.name == "sample" and command.prompt["prompt"] == "a cat" and command.prompt["steps"] == 2
    assert command.prompt["seed"] == 42  # the prompt's defaults filled in: what the trainer samples
    commands = TrainCommands()
    apply_command(command, commands)
    assert commands.take() == set() and commands.take_prompts() == [command.prompt]
    apply_command(parse_command('{"command": "sample"}'), commands)
    assert commands.take() == {"sample"} and commands.take_prompts() == []


def test_a_run_samples_a_prompt_sent_on_stdin_and_skips_disabled_prompts(tiny_model, shape_images, tmp_path):
    config = train_config(tiny_model, shape_images, tmp_path, {
        "schedule": {"max_steps": 2, "sample_every": "1 steps"},
        "sampling": {"prompts": [{"prompt": "off", "enabled": False, "steps": 2, "width": 64, "height": 64},
                                 {"prompt": "on", "steps": 2, "width": 64, "height": 64}]}})
    config_file = tmp_path / "config.json"
    config_file.write_text(config.model_dump_json())
    now = {"command": "sample", "prompt": {"prompt": "now", "steps": 2, "width": 64, "height": 64}}
    run = launch_run(["train", "--protocol", "jsonl", "--config", str(config_file)],
                     cwd=ROOT, input=json.dumps(now) + "\n", capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    events = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    samples = [event["path"] for event in events if event["event"] == "sample"]
    names = sorted(path.rsplit("/", 1)[1] for path in samples)
    # step 1: the enabled prompt (index 1 in the list) and the prompt sent; step 2: the enabled one
    assert names == ["step0000001-1.png", "step0000001-now0.png", "step0000002-1.png"], names
    assert all((tmp_path / "ws" / "samples" / name).is_file() for name in names)


def test_a_sample_now_too_big_for_the_machine_is_a_warning_and_training_goes_on(tiny_model, shape_images, tmp_path,
                                                                                  monkeypatch):
    """Issue 26: a "Sample now" the machine cannot allocate ended the run with a traceback."""
    from pathlib import Path

    from modules.cli.train_command import run_training
    from modules.model.base import ModelFamily
    from modules.trainer.callbacks import TrainCallbacks

    def no_memory(self, prompt, device):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:121] DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 51539607552 bytes")

    monkeypatch.setattr(ModelFamily, "sample", no_memory)

    class Warnings(TrainCallbacks):
        def __init__(self):
            self.warnings = []

        def on_warning(self, message):
            self.warnings.append(message)

    config = train_config(tiny_model, shape_images, tmp_path, {"schedule": {"max_steps": 2}})
    commands, callbacks = TrainCommands(), Warnings()
    command = parse_command('{"command": "sample", "prompt": {"prompt": "huge", "width": 4096, "height": 4096}}')
    apply_command(command, commands)
    assert run_training(config, callbacks, commands) == Path(config.output.path)
    (warning,) = [w for w in callbacks.warnings if w.startswith("sample now")]
    assert warning.startswith("sample now (4096x4096, 20 steps) ran out of memory and was skipped; training goes on")
