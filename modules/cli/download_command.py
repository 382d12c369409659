"""`launch.py download-model OWNER/NAME`: fetch a captioning, tagging or masking model from the
Hugging Face hub into the user's models folder, after saying which files and how many bytes.

Nothing is downloaded without a yes: `--list` only lists; without `--yes` a terminal is asked, and
anything else is refused. With `--protocol jsonl` (the dataset tool's dialogs) the events are
`listing` (files, total_bytes, folder), `progress` (done, total bytes, path), `error` and `finished`
(folder, stopped); `{"command": "stop"}` on stdin (or SIGINT/SIGTERM) stops between files. Then
`--model OWNER/NAME` in `caption` and `mask` reads the downloaded folder."""

from __future__ import annotations

import sys
from pathlib import Path

from modules.cli.label_command import LabelEvents, read_stop_commands
from modules.cli.stop_signals import install_stop_signals
from modules.trainer.commands import TrainCommands

STOP_DOING = "stopping after the file being downloaded; the files so far stay and the next download resumes"


def download_command(args) -> int:
    from modules.autolabel.hub_download import download, human_size, listing, target_folder
    from modules.errors import UserError, environment_error

    events = LabelEvents(args.protocol == "jsonl")
    commands = TrainCommands()
    if events.jsonl is not None:
        read_stop_commands(sys.stdin, commands, events)
    install_stop_signals(commands, doing=STOP_DOING)
    try:
        found = listing(args.repo_id, args.revision)
        folder = target_folder(args.repo_id, Path(args.to).expanduser() if args.to else None)
        events.emit("listing", "\n".join([f"{args.repo_id} @ {found.revision[:12]}: {len(found.files)} files, "
                                          f"{human_size(found.total_bytes)} -> {folder}",
                                          *(f"  {human_size(size):>9}  {name}" for name, size in found.files)]),
                    repo_id=args.repo_id, revision=found.revision, folder=str(folder),
                    total_bytes=found.total_bytes, files=[{"path": n, "size": s} for n, s in found.files],
                    skipped=list(found.skipped))
        if args.list:
            return 0
        if not args.yes:
            if events.jsonl is not None or not sys.stdin.isatty():
                raise UserError(f"downloads {human_size(found.total_bytes)} only when told: pass --yes", field="--yes")
            if input(f"Download {human_size(found.total_bytes)}? [y/N] ").strip().lower() not in ("y", "yes"):
                print("nothing downloaded", file=sys.stderr)
                return 1

        def progress(done: int, total: int, name: str) -> None:
            events.emit("progress", f"[{human_size(done)} of {human_size(total)}] {name}", done=done, total=total,
                        path=name)

        whole = download(found, folder, progress, lambda: commands.stop_requested)
    except Exception as error:  # noqa: BLE001  (a user error becomes one line or an error event; a bug is re-raised)
        user_error = environment_error(error)
        if user_error is None:
            raise
        events.error(str(user_error))
        return 1
    events.emit("finished", f"{folder}: {'whole' if whole else 'stopped; run it again to resume'}"
                + (f" (use --model {args.repo_id} or --model {folder})" if whole else ""),
                folder=str(folder), stopped=not whole)
    return 0 if whole else 1
