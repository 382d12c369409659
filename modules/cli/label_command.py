"""`launch.py caption` and `launch.py mask`: label a folder's images with a model, headless or as a
child process of the dataset tool.

With `--protocol jsonl` the run speaks the run protocol's style (docs/run-protocol.md): one JSON
event per line on stdout (started, progress, warning, error, finished) and one JSON command per
line on stdin, of which a labelling run takes `stop`: it ends after the batch being labelled, and
every file written so far stays whole (each is written under a temp name and renamed).
SIGINT and SIGTERM stop it the same way; a second one quits at once."""

from __future__ import annotations

import sys
import threading
from typing import IO, Callable

from modules.cli.stop_signals import install_stop_signals
from modules.trainer.commands import TrainCommands
from modules.trainer.event_protocol import JsonlEvents, read_command

STOP_DOING = "stopping after the batch being labelled; the files written so far stay"


def train_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        torch.device(device)
    except RuntimeError as error:
        from modules.errors import UserError

        raise UserError(f"{device!r} is not a torch device ({error})", field="--device") from None
    return device


def compute_dtype(dtype: str, device: str) -> str:
    import torch

    if dtype != "auto":
        return dtype
    if torch.device(device).type != "cuda":
        return "float32"
    return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"


class LabelEvents:
    """What a labelling run reports: JSONL events on stdout, or lines on stderr for a person."""

    def __init__(self, jsonl: bool, stream: IO[str] = sys.stdout):
        self.jsonl = JsonlEvents(stream) if jsonl else None

    def emit(self, event: str, text: str = "", **fields) -> None:
        if self.jsonl is not None:
            self.jsonl.emit(event, **fields)
        elif text:
            print(text, file=sys.stderr, flush=True)

    def started(self, total: int, model: str) -> None:
        self.emit("started", f"[{total} images, {model}]", total=total, model=model)

    def progress(self, report, path) -> None:
        self.emit("progress", f"[{report.done}/{report.total}] {path}", done=report.done, total=report.total,
                  path=str(path), written=len(report.written))

    def warning(self, message: str) -> None:
        self.emit("warning", f"warning: {message}", message=message)

    def error(self, message: str) -> None:
        self.emit("error", f"error: {message}", message=message)

    def finished(self, report) -> None:
        self.emit("finished", "", written=len(report.written), skipped=len(report.skipped),
                  failed=len(report.failed), stopped=report.stopped, total=report.total)


def read_stop_commands(stream: IO[str], commands: TrainCommands, events: LabelEvents) -> threading.Thread:
    """Read commands from `stream` on a daemon thread: `stop` stops the run, anything else is a warning."""
    if hasattr(stream, "reconfigure"):
        stream.reconfigure(errors="replace")

    def loop() -> None:
        for line in stream:
            if not line.strip():
                continue
            command, problem = read_command(line)
            if command is not None and command.name == "stop":
                commands.stop()
            else:
                events.warning(f"ignored command line {line.strip()[:200]!r}: "
                               f"{problem or 'a labelling run takes only stop'} (expected {{\"command\": \"stop\"}})")

    thread = threading.Thread(target=loop, name="command-reader", daemon=True)
    thread.start()
    return thread


class LoadedOnFirstUse:
    """A labelling model loaded when its first batch comes (on `--device`, in `--dtype`): a run that is
    stopped before, or finds nothing to do (skip-existing), never waits for torch and the weights."""

    def __init__(self, load: Callable[[str, str], object], args, events: LabelEvents):
        self._load, self._args, self._events, self._model = load, args, events, None

    def __getattr__(self, name: str):
        if self._model is None:
            device = train_device(self._args.device)
            dtype = compute_dtype(self._args.dtype, device)
            self._model = self._load(device, dtype)
            self._events.emit("loaded", f"[model loaded on {device} in {dtype}]", device=device, dtype=dtype)
        return getattr(self._model, name)


def run_labelling(args, label: Callable[[LabelEvents, TrainCommands], object], what: str) -> int:
    """Run `label(events, commands)` (it returns a LabelReport) with events, stop commands and signals."""
    from modules.errors import environment_error

    events = LabelEvents(args.protocol == "jsonl")
    commands = TrainCommands()
    if events.jsonl is not None:
        read_stop_commands(sys.stdin, commands, events)
    install_stop_signals(commands, doing=STOP_DOING)
    try:
        report = label(events, commands)
    except Exception as error:  # noqa: BLE001  (a user error becomes an error event; a bug is re-raised)
        user_error = environment_error(error)
        if user_error is None or events.jsonl is None:
            raise
        events.error(str(user_error))
        return 1
    events.finished(report)
    if events.jsonl is None:
        print(report.summary(what))
    return 0


def caption_command(args) -> int:
    from pathlib import Path

    from modules.autolabel.caption_folder import caption_images, check_batch_size, check_mode
    from modules.autolabel.captioners import kind_for
    from modules.autolabel.hub_download import local_model
    from modules.autolabel.images import folder_images
    from modules.autolabel.prompt_template import check_template

    def label(events: LabelEvents, commands: TrainCommands):
        args.model = local_model(args.model)  # a downloaded hub id: its folder (download-model)
        images = folder_images(existing_folder(args.folder), args.include_subfolders)
        check_mode(args.mode), check_batch_size(args.batch_size)
        kind = kind_for(args.model)
        template = check_template(kind.default_prompt if args.prompt is None else args.prompt)
        captioner = LoadedOnFirstUse(lambda device, dtype: kind.load(Path(args.model), device, dtype), args, events)
        events.started(len(images), kind.name)
        return caption_images(images, captioner, template, args.mode, args.batch_size, args.max_new_tokens,
                              events.progress, events.warning, lambda: commands.stop_requested)

    return run_labelling(args, label, "captions")


def existing_folder(folder: str):
    from pathlib import Path

    from modules.errors import UserError

    path = Path(folder).expanduser()
    if not path.is_dir():
        raise UserError(f"{path} is not a folder", field="--folder")
    return path


def mask_command(args) -> int:
    from pathlib import Path

    from modules.autolabel.hub_download import local_model
    from modules.autolabel.images import folder_images
    from modules.autolabel.mask_folder import check_threshold, mask_images
    from modules.autolabel.maskers import masker_kind_for

    def label(events: LabelEvents, commands: TrainCommands):
        args.model = local_model(args.model)  # a downloaded hub id: its folder (download-model)
        images = folder_images(existing_folder(args.folder), args.include_subfolders)
        check_threshold(args.threshold)
        kind = masker_kind_for(args.model)  # (before torch loads)
        masker = LoadedOnFirstUse(lambda device, dtype: kind.load(Path(args.model).expanduser(), device, dtype), args,
                                  events)
        events.started(len(images), kind.name)
        return mask_images(images, masker, args.prompt or "", args.threshold, args.mode, args.expand, args.batch_size,
                           events.progress, events.warning, lambda: commands.stop_requested, kind.takes_prompt)

    return run_labelling(args, label, "masks")
