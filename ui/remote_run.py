"""Remote runs, a mixin of the main window (ui/app.py): the ssh target, the child's command line,
and a remote run found again after the window that started it is gone.

A remote run lives on the box (modules/remote: a supervisor there keeps it training when the
connection drops); the window's child, `launch.py remote`, only relays it. When that child is gone
without the run's end (the window was killed, the laptop slept, the connection stayed down past the
retries), the run's workspace still holds remote-session.json, and `launch.py remote --attach`
picks the run up where the relay left it. A relay that is still alive is followed like a local run
(ui/attached_run.py; it forwards the run's command inbox to the box).
"""

from __future__ import annotations

import json
from pathlib import Path

from modules.config.presets import user_dir
from modules.util.atomic import write_text
from ui.attached_run import ENDING_EVENTS, live_pid
from ui.run_client import PROCESS_FILE, ROOT, RunClient, local_train_argv
from ui.run_history import history, read_config, read_events, run_dirs

SESSION_FILE = "remote-session.json"  # modules/remote/run.py's SESSION_FILE (not imported: it reads the config)


def _started_remote(run_dir: Path) -> bool:
    try:
        return json.loads((run_dir / PROCESS_FILE).read_text(encoding="utf-8")).get("remote") is True
    except (OSError, ValueError, AttributeError):
        return False


def detached_remote_run(runs: Path) -> Path | None:
    """The newest run folder of a remote run this GUI started whose relay is gone before the run's
    end, while its workspace still records the session; None when there is none. Only a
    workspace's newest run folder counts: a later run there (a reattach, a new run) supersedes it."""
    seen = set()
    for run_dir in reversed(run_dirs(runs)):
        workspace = (read_config(run_dir) or {}).get("workspace_dir")
        if not workspace or workspace in seen:
            continue
        seen.add(workspace)
        if not _started_remote(run_dir) or live_pid(run_dir) is not None:
            continue
        if any(e.get("event") in ENDING_EVENTS for e in read_events(run_dir)):
            continue
        if (ROOT / Path(workspace).expanduser() / SESSION_FILE).is_file():
            return run_dir
    return None


class RemoteRun:
    def remote_target(self):
        """The ssh target of the Remote section (General tab), or None to train on this machine.
        Raises RemoteError for a host or port that cannot be used."""
        remote = self.settings.get("remote") or {}
        if not remote.get("host"):
            return None
        from modules.remote.ssh import SshTarget

        port = remote.get("port") or None
        if port is not None:
            if not str(port).isdigit():
                from modules.remote.ssh import RemoteError

                raise RemoteError(f"port: {port!r} is not a port number")
            port = int(port)
        return SshTarget(remote["host"], port=port, remote_dir=remote.get("remote_dir") or "difftrainer-remote",
                         identity_file=remote.get("identity_file") or None,
                         known_hosts=remote.get("known_hosts") or None, python=remote.get("python") or "python3")

    def remote_problem(self) -> str | None:
        try:
            self.remote_target()
        except Exception as error:  # RemoteError, or modules/remote missing
            return f"remote: {error}"
        return None

    def run_argv(self, config_file: Path) -> list[str]:
        """The child's command line: local `launch.py train`, or `launch.py remote` over ssh
        (modules/remote), which speaks the same protocol with local paths in its events."""
        target = self.remote_target()
        if target is None:
            return local_train_argv(config_file)
        from modules.remote.run import remote_run_argv

        return remote_run_argv(target, config_file)

    def reattach_remote(self) -> bool:
        """Pick up a remote run whose relay is gone (see the module doc) with `launch.py remote
        --attach` in a new run folder: the curve and samples so far from the old folder, then live;
        Stop and the commands go to the new relay as for a run started here."""
        old_dir = detached_remote_run(user_dir() / "runs")
        if old_dir is None:
            return False
        from modules.remote.run import remote_run_argv

        from ui.run_control import new_run_dir

        run_dir = new_run_dir()
        config_file = run_dir / "config.json"
        write_text(config_file, (old_dir / "config.json").read_text(encoding="utf-8"))
        self.run_events, self.total_steps, self._stop_requested = [], 0, False
        self.run_config = read_config(run_dir)
        run_tab = self.tabs["Run"]
        run_tab.clear()
        run_tab.load_history(history(old_dir))
        run_tab.append_log(f"[reattaching to the remote run of {old_dir}: its relay ended before the run did; "
                           f"launch.py remote --attach, run folder {run_dir}]")
        self.client = RunClient(remote_run_argv(None, config_file, attach=True), cwd=ROOT, run_dir=run_dir, remote=True)
        self.client.start()
        self._following("reattaching to the remote run")
        return True
