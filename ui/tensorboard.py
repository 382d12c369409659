"""TensorBoard for the run's workspace: `tensorboard --logdir <workspace>/tensorboard` as a child
process on a free local port, opened in the browser. One at a time; a new log folder replaces
it, and it ends with the window."""

from __future__ import annotations

import socket
import subprocess
import sys
import webbrowser
from pathlib import Path


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class TensorBoard:
    def __init__(self):
        self.process: subprocess.Popen | None = None
        self.logdir: Path | None = None
        self.url: str | None = None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self, logdir: Path) -> str:
        """Serve `logdir` (a running server for the same folder is reused); returns its URL."""
        logdir = Path(logdir).resolve()
        if self.running and self.logdir == logdir:
            return self.url
        self.stop()
        port = free_port()
        self.process = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir),
                                         "--host", "127.0.0.1", "--port", str(port)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        start_new_session=True)
        self.logdir, self.url = logdir, f"http://127.0.0.1:{port}/"
        return self.url

    def open(self, logdir: Path) -> str:
        url = self.start(logdir)
        webbrowser.open(url)
        return url

    def stop(self) -> None:
        if self.running:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.process = None
