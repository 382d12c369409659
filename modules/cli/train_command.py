"""`launch.py train`: run one training from presets, config files and overrides, headless.

SIGINT or SIGTERM asks the run to stop at the next step; it then writes a backup (and the
output) and exits 0. Stopped before its first step (while loading), it writes neither. A second SIGINT exits at once with code 130 (and an `error` event): atomic
writes mean no file is left half-written, and the backups already written stay whole.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from modules.config.loading import build_config, read_json_file
from modules.config.presets import load_preset_overlay
from modules.config.train_config import TrainConfig
from modules.trainer.callbacks import TrainCallbacks
from modules.trainer.commands import TrainCommands

EXIT_INTERRUPTED = 130  # as a shell reports a process ended by SIGINT


def resolve_config(config_files: list[str], preset: str | None, overrides: list[str], resume: bool = False) -> TrainConfig:
    layers = [load_preset_overlay(preset)] if preset else []
    layers += [read_json_file(path) for path in config_files]
    overrides = list(overrides) + (["backup.resume=true"] if resume else [])
    return build_config(layers, overrides)


def install_stop_signals(commands: TrainCommands, log=lambda text: print(text, file=sys.stderr, flush=True)) -> None:
    def request_stop(signum, _frame):
        commands.stop()
        # arm the second Ctrl-C before saying so: a user (or test) that reacts to the message at
        # once must find it armed
        signal.signal(signal.SIGINT, signal.default_int_handler)
        log(f"[{signal.Signals(signum).name}: stopping at the next step; a backup will be written. "
            "Press Ctrl-C again to quit at once]")

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)


def run_training(config: TrainConfig, callbacks: TrainCallbacks, commands: TrainCommands | None = None) -> Path | None:
    """The saved adapter's path, or None when the run stopped before its first step (nothing saved)."""
    import torch

    from modules.trainer.generic_trainer import (
        GenericTrainer,  # heavy imports only when training
    )
    from modules.trainer.out_of_memory import out_of_memory_error

    commands = commands or TrainCommands()
    trainer = GenericTrainer(config, callbacks, commands)
    try:
        trainer.start()
        trainer.train()
        return trainer.end()
    except torch.OutOfMemoryError as error:  # one message naming what to change (out_of_memory.py), no traceback
        raise out_of_memory_error(error, trainer) from None
    except KeyboardInterrupt:
        # the second Ctrl-C: whatever was being written is left under its temp name (atomic writes),
        # so the output and the backups that exist are whole; no backup of this step is written
        callbacks.on_error(f"interrupted at step {trainer.step}: quit without a backup of this step")
        raise SystemExit(EXIT_INTERRUPTED) from None
    finally:
        trainer.release()  # the workspace lock, whatever ended the run
