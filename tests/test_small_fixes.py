"""Issue 14, item 8: `backup_every: 0` means never; a preset saved from a resumed run does not
resume; `presets save` starts from `--preset`; a caching progress bar; tqdm's ETA after a resume
counts only this process's steps; `--remote-python ~/...` is the box's home."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT, train_config
from forked_launch import launch_run

from modules.config.loading import build_config


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("given, value, unit", [(0, 0, "steps"), (250, 250, "steps"), (0.0, 0, "steps")])
def test_a_bare_number_cadence_counts_steps_and_zero_is_never(given, value, unit):
    from modules.trainer.timed_actions import TimedAction

    cadence = build_config([{"schedule": {"backup_every": given}}]).schedule.backup_every
    assert (cadence.value, cadence.unit) == (value, unit)
    if value == 0:
        assert not TimedAction(cadence).due(5, True, 1)


def test_a_preset_saved_from_a_resumed_run_does_not_resume(tmp_path, monkeypatch):
    from modules.config.presets import save_preset

    monkeypatch.setenv("DIFFTRAINER_HOME", str(tmp_path))
    config = build_config([{"backup": {"resume": True, "rolling_count": 5}, "schedule": {"epochs": 3}}])
    saved = json.loads(save_preset(config, "from-resumed").read_text())
    assert saved["backup"] == {"rolling_count": 5} and saved["schedule"] == {"epochs": 3}
    only_resume = json.loads(save_preset(build_config([{"backup": {"resume": True}}]), "only").read_text())
    assert "backup" not in only_resume


def test_presets_save_starts_from_a_preset(tmp_path):
    env = {**os.environ, "DIFFTRAINER_HOME": str(tmp_path)}
    result = launch_run(["presets", "save", "mine", "--preset", "SD1.5 LoRA", "--set", "schedule.epochs=3"],
                        capture_output=True, text=True, cwd=ROOT, env=env,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    saved = json.loads((tmp_path / "presets" / "mine.json").read_text())
    assert saved["schedule"]["epochs"] == 3  # the --set on top
    assert saved["adapter"]["rank"] == 32 and saved["train_dtype"] == "bfloat16"  # the preset's own values


def test_caching_shows_a_progress_bar_on_a_terminal(tmp_path, tiny_model, shape_images, monkeypatch):
    from modules.data.dataset import prepare_dataset
    from modules.model.sd15 import SD15Family

    config = train_config(tiny_model, shape_images, tmp_path)
    family = SD15Family(config)
    family.load()
    import modules.data.cache_build as cache_build
    from tqdm import tqdm

    closed = []

    class Recorded(tqdm):
        def close(self):
            if not self.disable:
                closed.append((self.desc, self.n, self.total))
            super().close()

    monkeypatch.setattr(cache_build, "tqdm", Recorded)
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    prepare_dataset(config, family, torch.device("cpu"), tmp_path / "cache", lambda message: None, cache_text=True)
    shown = terminal.getvalue()
    assert "encoding latents" in shown and "encoding captions" in shown
    assert closed == [("encoding latents", 4, 4), ("encoding captions", 4, 4)]  # counted to the end


def test_the_tqdm_eta_after_a_resume_counts_only_this_process_s_steps():
    from modules.cli.console import ConsoleCallbacks
    from modules.trainer.callbacks import Progress

    console = ConsoleCallbacks(Terminal())
    console.on_started(1000)
    time.sleep(0.2)  # the first step of this process, resumed at step 500
    console.on_progress(Progress(step=501, total_steps=1000, epoch=0, epochs=1, loss=0.1, lr=1e-4,
                                 it_per_s=5.0, eta_s=100.0))
    meter = console.bar.format_dict
    rate = (meter["n"] - meter["initial"]) / meter["elapsed"]
    assert rate < 10  # one step in ~0.2 s, not 501
    assert (meter["total"] - meter["n"]) / rate > 40  # hence an ETA of ~100 s, not ~0
    console.on_finished()


def test_remote_python_under_the_home_folder_expands_on_the_box(tmp_path):
    from modules.remote.ssh import SshTarget

    command = SshTarget("user@box", python="~/venv/bin/python").helper_argv("dir", "probe")[-1]
    # the remote login shell runs this string: with HOME set as on the box, ~/ is that home
    echoed = subprocess.run(["sh", "-c", "printf '%s\\n' " + command], capture_output=True, text=True,
                            env={"HOME": "/home/boxuser", "PATH": os.environ["PATH"]}, check=True).stdout.split("\n")
    assert echoed[0] == "/home/boxuser/venv/bin/python"
    assert echoed[1] == "dir/helper.py"
    literal = SshTarget("user@box", python="/opt/py 3/bin/python").helper_argv("dir")[-1]
    assert subprocess.run(["sh", "-c", "printf '%s\\n' " + literal], capture_output=True, text=True,
                          check=True).stdout.split("\n")[0] == "/opt/py 3/bin/python"


def test_on_the_cpu_a_big_model_s_step_cost_is_said_before_the_first_step(tmp_path, tiny_model, shape_images,
                                                                           monkeypatch):
    from modules.trainer import cpu_notice
    from modules.trainer.generic_trainer import GenericTrainer

    monkeypatch.setattr(cpu_notice, "NOTICE_MIN_PARAMETERS", 0)  # the tiny model stands in for a full-size one
    warnings, order = [], []

    class Calls:
        def __getattr__(self, name):
            if name == "on_warning":
                return lambda message: (warnings.append(message), order.append(message))
            if name == "on_started":
                return lambda total: order.append("started")
            return lambda *args, **kwargs: None

    config = train_config(tiny_model, shape_images, tmp_path, {"schedule": {"max_steps": 1}})
    trainer = GenericTrainer(config, Calls())
    trainer.start()
    rng = torch.get_rng_state()
    notice = cpu_notice.cpu_notice(trainer)
    assert torch.equal(rng, torch.get_rng_state())  # measuring draws nothing from the run's RNG
    assert "training runs on the CPU" in notice and "one step will take roughly" in notice
    trainer.train()
    trainer.end()
    (said,) = [w for w in warnings if "training runs on the CPU" in w]
    assert order.index(said) < order.index("started")
