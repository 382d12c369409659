"""`launch.py train`: run one training from presets, config files and overrides, headless.

SIGINT or SIGTERM asks the run to stop at the next step (stop_signals.py; caching and sampling
stop between their batches and steps); it then writes a backup (and the output) and exits 0.
Stopped before its first step (while loading or caching), it writes neither. A second SIGINT or
SIGTERM exits at once with code 130 (and an `error` event), within seconds even inside a long
step: atomic writes mean no file is left half-written, and the backups already written stay whole.
"""

from __future__ import annotations

import threading
from pathlib import Path

from modules.cli.stop_signals import EXIT_INTERRUPTED, install_stop_signals  # noqa: F401  (launch.py's)
from modules.config.loading import build_config, read_json_file
from modules.config.presets import load_preset_overlay
from modules.config.train_config import TrainConfig
from modules.trainer.callbacks import TrainCallbacks
from modules.trainer.commands import TrainCommands


def resolve_config(config_files: list[str], preset: str | None, overrides: list[str], resume: bool = False) -> TrainConfig:
    layers = [load_preset_overlay(preset)] if preset else []
    layers += [read_json_file(path) for path in config_files]
    overrides = list(overrides) + (["backup.resume=true"] if resume else [])
    return build_config(layers, overrides)


def run_training(config: TrainConfig, callbacks: TrainCallbacks, commands: TrainCommands | None = None) -> Path | None:
    """The saved adapter's path, or None when the run stopped before its first step (nothing saved)."""
    import torch

    from modules.trainer.generic_trainer import (
        GenericTrainer,  # heavy imports only when training
    )
    from modules.trainer.out_of_memory import out_of_memory_error

    commands = commands or TrainCommands()
    trainer = GenericTrainer(config, callbacks, commands)
    reported = threading.Event()

    def report_interrupt() -> None:  # once, from the main thread or from stop_signals' watcher
        if not reported.is_set():
            reported.set()
            callbacks.on_error(f"interrupted at step {trainer.step}: quit without a backup of this step")

    hooks = [report_interrupt, trainer.lock.release]
    commands.quit_hooks += hooks
    try:
        trainer.start()
        trainer.train()
        return trainer.end()
    except torch.OutOfMemoryError as error:  # one message naming what to change (out_of_memory.py), no traceback
        raise out_of_memory_error(error, trainer) from None
    except KeyboardInterrupt:
        # the second Ctrl-C: whatever was being written is left under its temp name (atomic writes),
        # so the output and the backups that exist are whole; no backup of this step is written
        report_interrupt()
        raise SystemExit(EXIT_INTERRUPTED) from None
    finally:
        trainer.release()  # the workspace lock, whatever ended the run
        commands.quit_hooks[:] = [hook for hook in commands.quit_hooks if hook not in hooks]
