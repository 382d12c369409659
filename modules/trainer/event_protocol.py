"""The run protocol (docs/run-protocol.md): one JSON event per line out, one JSON command per line in.

Events: started, progress (step, epoch, loss, lr, it_per_s, eta_s), sample (path; control_images where
its prompt had some), backup (path),
saved (path; consumers: per tool {applied, total, dropped} for adapter files), validation (step, loss),
memory (step, measured: peaks in bytes, once after step 2), warning (message), error (message), finished. Commands: stop, sample, backup, save;
`{"command": "sample", "prompt": {...}}` samples that one prompt (SamplePromptConfig's fields) now.
The GUI and remote runs speak this to a `launch.py train --protocol jsonl` child process. The same
commands also come as files in the workspace (command_inbox.py), read with the same `read_command`.
"""

from __future__ import annotations

import json
import math
import sys
import threading
from dataclasses import dataclass
from typing import IO

from pydantic import ValidationError

from modules.config.errors import format_validation_error
from modules.config.sampling_config import SamplePromptConfig
from modules.trainer.callbacks import Progress, TrainCallbacks
from modules.trainer.commands import TrainCommands


class JsonlEvents(TrainCallbacks):
    def __init__(self, stream: IO[str] = sys.stdout):
        self.stream = stream
        self._lock = threading.Lock()

    def emit(self, event: str, **fields) -> None:
        fields = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in fields.items()}
        line = json.dumps({"event": event, **fields})
        with self._lock:
            self.stream.write(line + "\n")
            self.stream.flush()

    def on_started(self, total_steps: int) -> None:
        self.emit("started", total_steps=total_steps)

    def on_progress(self, p: Progress) -> None:
        self.emit("progress", step=p.step, total_steps=p.total_steps, epoch=p.epoch, epochs=p.epochs,
                  loss=p.loss, lr=p.lr, it_per_s=p.it_per_s, eta_s=p.eta_s)

    def on_sample(self, path: str, control_images: list[str] | None = None) -> None:
        self.emit("sample", path=path, **({} if control_images is None else {"control_images": control_images}))

    def on_backup(self, path: str) -> None:
        self.emit("backup", path=path)

    def on_save(self, path: str, consumers: dict[str, dict] | None = None) -> None:
        self.emit("saved", path=path, **({} if consumers is None else {"consumers": consumers}))

    def on_validation(self, step: int, loss: float) -> None:
        self.emit("validation", step=step, loss=loss)

    def on_memory(self, report: dict) -> None:
        self.emit("memory", **report)

    def on_warning(self, message: str) -> None:
        self.emit("warning", message=message)

    def on_finished(self) -> None:
        self.emit("finished")

    def on_error(self, message: str) -> None:
        self.emit("error", message=message)


COMMANDS = {"stop": TrainCommands.stop, "sample": TrainCommands.sample_now,
            "backup": TrainCommands.backup_now, "save": TrainCommands.save_now}


@dataclass(frozen=True)
class Command:
    name: str  # one of COMMANDS
    prompt: dict | None = None  # sample: this prompt (SamplePromptConfig fields) instead of the config's


def parse_command(line: str) -> Command | None:
    """The command a line asks for, or None for anything else: malformed JSON, a JSON value that is
    not an object, a "command" that is not one of the names (a list, a number, an unknown string),
    a "prompt" that is not a valid sample prompt. Nothing a client sends may end the reader: every
    later stop would be ignored."""
    return read_command(line)[0]


def read_command(line: str) -> tuple[Command | None, str]:
    """(the command, "") or (None, what is wrong with the line: for a sample prompt, each field that
    is out of bounds or of the wrong type, by its dotted name)."""
    try:
        message = json.loads(line)
    except (ValueError, RecursionError):  # malformed, a number too large to convert, nesting too deep
        return None, "not a JSON object"
    name = message.get("command") if isinstance(message, dict) else None
    if not (isinstance(name, str) and name in COMMANDS):
        return None, f"expected {{\"command\": one of {', '.join(COMMANDS)}}}"
    prompt = message.get("prompt")
    if prompt is None:
        return Command(name), ""
    if name != "sample":
        return None, f"only sample takes a \"prompt\", not {name}"
    try:
        return Command(name, SamplePromptConfig.model_validate(prompt).model_dump(mode="json")), ""
    except ValidationError as error:
        # the bounds of SamplePromptConfig (limits.py): a seed of 2**70 or a 65536-px side is refused
        # here, where the run goes on, not at the next step, where it would end the run
        top = "(top level)"
        fields = "; ".join("prompt" + (line[len(top):] if line.startswith(top) else "." + line)
                           for line in format_validation_error(error))
        return None, f"sample {fields}"


def command_name(line: str) -> str | None:
    command = parse_command(line)
    return command.name if command else None


def apply_command(command: Command, commands: TrainCommands) -> None:
    if command.prompt is not None:
        commands.sample_now(command.prompt)
    else:
        COMMANDS[command.name](commands)


def read_commands(stream: IO[str], commands: TrainCommands, events: JsonlEvents) -> threading.Thread:
    """Read commands from `stream` on a daemon thread until it closes."""
    if hasattr(stream, "reconfigure"):
        stream.reconfigure(errors="replace")  # a stray non-UTF-8 byte becomes a bad line, not a dead reader

    def loop() -> None:
        for line in stream:
            if not line.strip():
                continue
            command, problem = read_command(line)
            if command is not None:
                apply_command(command, commands)
            else:
                events.on_warning(f"ignored command line {line.strip()[:200]!r}: {problem} (expected "
                                  f"{{\"command\": one of {', '.join(COMMANDS)}}}, and for sample optionally "
                                  f"\"prompt\": {{\"prompt\": ..., \"seed\": ...}})")

    thread = threading.Thread(target=loop, name="command-reader", daemon=True)
    thread.start()
    return thread
