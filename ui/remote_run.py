"""Remote runs, a mixin of the main window (ui/app.py): the ssh target and the child's command line."""

from __future__ import annotations

from pathlib import Path

from ui.run_client import local_train_argv


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
