"""`launch.py train` on several GPUs (distributed.gpus > 1, or --gpus N): the command starts
itself again under torchrun (`python -m torch.distributed.run --standalone --nproc-per-node N
launch.py train ...`, the same arguments), one process per GPU. Rank 0 reports as a single run
does (console, JSONL events, stdin commands); the other ranks read no commands and write only
their warnings and errors to stderr, named by rank, so stdout stays one event stream.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from modules.trainer.callbacks import TrainCallbacks

LAUNCH = Path(__file__).resolve().parents[2] / "launch.py"


def under_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ


def process_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def torchrun_command(gpus: int, argv: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}",
            str(LAUNCH), *argv]


def run_under_torchrun(gpus: int, argv: list[str]) -> int:
    """torchrun's exit code. Ctrl-C reaches the ranks (the terminal's process group) and torchrun,
    which stop on it; this process only waits for them."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        return subprocess.call(torchrun_command(gpus, argv))
    finally:
        signal.signal(signal.SIGINT, previous)


class OtherRankCallbacks(TrainCallbacks):
    """A rank other than 0: its warnings and errors on stderr, the rest left to rank 0."""

    def __init__(self, rank: int, stream=sys.stderr):
        self.rank, self.stream = rank, stream

    def on_warning(self, message: str) -> None:
        print(f"[rank {self.rank}] warning: {message}", file=self.stream, flush=True)

    def on_error(self, message: str) -> None:
        print(f"[rank {self.rank}] error: {message}", file=self.stream, flush=True)
