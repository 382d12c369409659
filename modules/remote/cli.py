"""`launch.py remote`: train on another machine over ssh, or reattach to a run there.

  launch.py remote --host user@box [--port N] [--remote-dir DIR] [--identity KEY] [--known-hosts FILE]
                   [--remote-python PY] --config FILE [--preset NAME] [--set k=v ...] [--resume]
                   [--protocol text|jsonl] [--retries N]
  launch.py remote --attach (--config FILE | --workspace DIR) [--protocol text|jsonl] [--retries N]

With --protocol jsonl it speaks the run protocol like `launch.py train --protocol jsonl`: events on
stdout (paths are local, files already here), commands on stdin. Ctrl-C or SIGTERM sends "stop";
a second Ctrl-C detaches (the run goes on). Exit code: the remote run's, or 3 when the connection
dropped and did not come back: the run goes on, and --attach reconnects.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time

from modules.remote.run import EXIT_CONNECTION_LOST, ConnectionLost, RemoteRun
from modules.remote.ssh import RemoteError, SshTarget


def add_remote_parser(sub) -> argparse.ArgumentParser:
    remote = sub.add_parser("remote", help="train on another machine over ssh, or reattach to a run there")
    remote.add_argument("--host", help="user@box (key login; the host key must be known)")
    remote.add_argument("--port", type=int, help="ssh port (default: ssh's)")
    remote.add_argument("--remote-dir", default="difftrainer-remote", help="folder on the box (relative: under home)")
    remote.add_argument("--identity", help="private key file (a passphrase comes from ssh-agent, never from here)")
    remote.add_argument("--known-hosts", help="known_hosts file to check the host key against (default: ssh's)")
    remote.add_argument("--remote-python", default="python3", help="python on the box with the requirements installed")
    remote.add_argument("--attach", action="store_true", help="reconnect to the run recorded in the workspace")
    remote.add_argument("--workspace", help="with --attach: the local workspace of the run (else from --config)")
    remote.add_argument("--config", action="append", default=[], metavar="FILE", help="config JSON (repeatable)")
    remote.add_argument("--preset", help="a preset name, applied under the config files")
    remote.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. schedule.epochs=5")
    remote.add_argument("--resume", action="store_true", help="continue from the newest backup")
    remote.add_argument("--protocol", choices=["text", "jsonl"], default="text",
                        help="jsonl: the run protocol of `train --protocol jsonl` (events on stdout, commands on stdin)")
    remote.add_argument("--retries", type=int, default=3, help="reconnect tries in a row after a dropped connection (default 3)")
    return remote


class _Output:
    def __init__(self, protocol: str):
        self.jsonl = protocol == "jsonl"
        self._lock = threading.Lock()
        if not self.jsonl:
            from modules.cli.console import ConsoleCallbacks

            self.console = ConsoleCallbacks()

    def event(self, event: dict) -> None:
        if self.jsonl:
            with self._lock:
                sys.stdout.write(json.dumps(event) + "\n")
                sys.stdout.flush()
        else:
            dispatch(event, self.console)

    def warning(self, message: str) -> None:
        self.event({"event": "warning", "message": message})

    def error(self, message: str) -> None:
        self.event({"event": "error", "message": message})


def dispatch(event: dict, callbacks) -> None:
    """A protocol event as a TrainCallbacks call (for a console, or anything that takes callbacks)."""
    from modules.trainer.callbacks import Progress

    kind = event.get("event")
    if kind == "started":
        callbacks.on_started(event.get("total_steps", 0))
    elif kind == "progress":
        fields = {name: event.get(name) for name in Progress.__dataclass_fields__}
        fields = {k: (float("inf") if v is None and k in ("eta_s", "loss", "lr", "it_per_s") else v) for k, v in fields.items()}
        callbacks.on_progress(Progress(**fields))
    elif kind == "sample":
        controls = event.get("control_images")
        if isinstance(controls, list) and controls and all(isinstance(c, str) for c in controls):
            callbacks.on_sample(event["path"], control_images=controls)
        else:
            callbacks.on_sample(event["path"])
    elif kind == "backup":
        callbacks.on_backup(event["path"])
    elif kind == "saved":
        from modules.saving.consumers.check import is_report

        consumers = event.get("consumers")
        if is_report(consumers):
            callbacks.on_save(event["path"], consumers=consumers)
        else:
            callbacks.on_save(event["path"])
    elif kind == "validation" and hasattr(callbacks, "on_validation"):
        callbacks.on_validation(event.get("step"), event.get("loss"))
    elif kind == "memory" and hasattr(callbacks, "on_memory"):
        callbacks.on_memory({k: v for k, v in event.items() if k != "event"})
    elif kind == "warning":
        callbacks.on_warning(event.get("message", ""))
    elif kind == "error":
        callbacks.on_error(event.get("message", ""))
    elif kind == "finished":
        callbacks.on_finished()


def _workspace_from_args(args) -> str:
    if args.workspace:
        return args.workspace
    from modules.cli.train_command import resolve_config

    if not args.config and not args.preset:
        raise RemoteError("--attach needs --workspace DIR or the run's --config FILE (to find its workspace)")
    return resolve_config(args.config, args.preset, args.set).workspace_dir


def cmd_remote(args) -> int:
    from modules.config.errors import ConfigError

    out = _Output(args.protocol)

    def log(text):
        print(f"[remote] {text}", file=sys.stderr, flush=True)

    try:
        if args.attach:
            run = RemoteRun.from_session(_workspace_from_args(args), log)
        else:
            if not args.host:
                raise RemoteError("remote needs --host user@box (or --attach to reconnect to a run)")
            if not args.config and not args.preset:
                raise RemoteError("remote needs --config FILE or --preset NAME")
            from modules.cli.train_command import resolve_config

            config = resolve_config(args.config, args.preset, args.set)
            target = SshTarget(args.host, args.port, args.remote_dir, args.identity, args.known_hosts, args.remote_python)
            run = RemoteRun.start(target, config, resume=args.resume, log=log)
    except (RemoteError, ConfigError) as error:
        out.error(str(error))
        return 1
    code = relay(run, out, args.retries)
    if code == 0 and not out.jsonl:
        print(run.local_output)  # as `launch.py train` prints where the result went
    return code


def relay(run: RemoteRun, out: _Output, retries: int) -> int:
    """Relay events until the run ends; reconnect after drops; commands from stdin (jsonl) and signals."""
    interrupts = []

    def on_signal(signum, _frame):
        interrupts.append(signum)
        if len(interrupts) == 1:
            run.stop()
            out.warning(f"{signal.Signals(signum).name}: asked the run on {run.target.label} to stop at the next step "
                        "(with a backup); press Ctrl-C again to detach and leave it running")
        else:
            run.detach()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    if out.jsonl:
        from modules.trainer.event_protocol import read_command

        def read_commands():
            for line in sys.stdin:
                if not line.strip():
                    continue
                command, problem = read_command(line)  # the same reading as a local run's
                if command is not None:
                    run.send_command(command.name, command.prompt)
                else:
                    out.warning(f"ignored command line {line.strip()[:200]!r}: {problem}")

        threading.Thread(target=read_commands, daemon=True).start()
    # the local workspace's command inbox too (modules/trainer/command_inbox.py): a window reopened
    # after the one that started this relay closed sends its commands there
    from modules.trainer.command_inbox import CommandInbox

    inbox = CommandInbox(run.local_workspace, lambda command: run.send_command(command.name, command.prompt),
                         out.warning).open()
    try:
        return _relay_events(run, out, retries, interrupts)
    finally:
        inbox.close()


def _relay_events(run: RemoteRun, out: _Output, retries: int, interrupts: list) -> int:
    attempt = 0
    while True:
        try:
            for event in run.events():
                attempt = 0
                out.event(event)
            return run.returncode
        except ConnectionLost as error:
            if len(interrupts) > 1 or attempt >= retries:
                out.error(str(error))
                return EXIT_CONNECTION_LOST
            attempt += 1
            out.warning(f"{error}; reconnecting ({attempt}/{retries})")
            time.sleep(min(2 ** attempt, 30))
        except RemoteError as error:
            if attempt >= retries:
                out.error(f"{error}; the run goes on there: reattach with launch.py remote --attach")
                return EXIT_CONNECTION_LOST
            attempt += 1
            out.warning(f"{error}; retrying ({attempt}/{retries})")
            time.sleep(min(2 ** attempt, 30))
