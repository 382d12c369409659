"""The box a remote run goes to, and the system `ssh` command lines that reach it.

Authentication is by key only (BatchMode: ssh never prompts, so no password can be asked for or
passed on a command line), and host keys are always checked (StrictHostKeyChecking=yes against the
user's known_hosts, or the file given): an unknown or changed host key is an error naming the host.
"""

from __future__ import annotations

from modules.errors import UserError

import json
import shlex
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path


def remote_word(arg: str) -> str:
    """One shell word for the box's login shell. Quoting keeps a `~/` prefix literal there, and the
    user meant the box's home (`--remote-python ~/venv/bin/python`), so that prefix is left to
    the remote shell as "$HOME" and only the rest is quoted."""
    if arg == "~":
        return '"$HOME"'
    if arg.startswith("~/"):
        return '"$HOME"/' + shlex.quote(arg[2:])
    return shlex.quote(arg)


class RemoteError(UserError):
    """Something about the box or the connection; the message names the host and what to do."""


@dataclass
class SshTarget:
    host: str  # "user@box" or "box" (an ~/.ssh/config alias works too)
    port: int | None = None  # None: ssh's default (or the alias's)
    remote_dir: str = "difftrainer-remote"  # relative paths are under the remote home
    identity_file: str | None = None  # a private key file (its passphrase, if any, via ssh-agent)
    known_hosts: str | None = None  # None: ssh's own (~/.ssh/known_hosts)
    python: str = "python3"  # the interpreter on the box that has the requirements installed

    def __post_init__(self) -> None:
        if not self.host or self.host.startswith("-") or any(c.isspace() for c in self.host):
            raise RemoteError(f"--host: {self.host!r} is not a host (expected user@box)")
        if self.port is not None and not 0 < int(self.port) < 65536:
            raise RemoteError(f"--port: {self.port} is not a port number")
        self.remote_dir = self.remote_dir.removeprefix("~/")  # ssh starts in the home folder

    @property
    def label(self) -> str:
        return f"{self.host}:{self.port}" if self.port else self.host

    def to_json(self) -> dict:
        return asdict(self)

    def ssh_options(self) -> list[str]:
        options = ["-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes", "-o", "ConnectTimeout=20",
                   "-o", "ServerAliveInterval=10", "-o", "ServerAliveCountMax=3", "-o", "LogLevel=ERROR"]
        if self.known_hosts:
            options += ["-o", f"UserKnownHostsFile={Path(self.known_hosts).expanduser()}"]
        if self.identity_file:
            options += ["-i", str(Path(self.identity_file).expanduser()), "-o", "IdentitiesOnly=yes"]
        if self.port:
            options += ["-p", str(self.port)]
        return options

    def argv(self, remote_args: list[str]) -> list[str]:
        """`ssh ... host 'quoted remote command'` (sshd hands the command to the login shell)."""
        return ["ssh", *self.ssh_options(), self.host, " ".join(remote_word(str(a)) for a in remote_args)]

    def helper_argv(self, remote_dir: str, *args: str) -> list[str]:
        return self.argv([self.python, f"{remote_dir}/helper.py", *args])

    def run(self, remote_args: list[str], what: str, stdin: bytes | None = None, timeout: float = 600) -> bytes:
        """Run a short command on the box; its stdout. Failures name the host and what was being done."""
        try:
            result = subprocess.run(self.argv(remote_args), input=stdin if stdin is not None else b"",
                                    capture_output=True, timeout=timeout, check=False)
        except FileNotFoundError:
            raise RemoteError("ssh is not installed here (the remote mode uses the system's ssh client)") from None
        except subprocess.TimeoutExpired:
            raise RemoteError(f"{self.label}: {what} did not finish within {timeout:.0f} s") from None
        if result.returncode != 0:
            raise RemoteError(self.explain(result.returncode, result.stderr.decode(errors="replace"), what))
        return result.stdout

    def run_json(self, remote_args: list[str], what: str, stdin: bytes | None = None):
        out = self.run(remote_args, what, stdin)
        try:
            return json.loads(out.decode().strip().splitlines()[-1])
        except (ValueError, IndexError):
            raise RemoteError(f"{self.label}: {what}: unexpected answer {out[-500:]!r}") from None

    def explain(self, code: int, stderr: str, what: str) -> str:
        text = stderr.strip()
        if "Host key verification failed" in text or "REMOTE HOST IDENTIFICATION HAS CHANGED" in text:
            where = self.known_hosts or "~/.ssh/known_hosts"
            return (f"{self.label}: the host key is unknown or has changed, so the connection was refused. "
                    f"Check the box's key fingerprint and add it to {where} (ssh-keyscan"
                    f"{' -p ' + str(self.port) if self.port else ''} {self.host.split('@')[-1]} prints it)")
        if "Permission denied" in text:
            return (f"{self.label}: login refused ({text.splitlines()[-1]}); the remote mode logs in with a key "
                    "only: pass --identity FILE or load the key into ssh-agent")
        if code == 255:
            return f"{self.label}: cannot connect ({text.splitlines()[-1] if text else 'ssh exit 255'})"
        detail = "\n  ".join(text.splitlines()[-8:]) or f"exit code {code}"
        return f"{self.label}: {what} failed:\n  {detail}"
