"""`launch.py` children for the tests, forked from a server that imported the trainer once
(tests/forked_launch_server.py): a child starts in a tenth of a second instead of paying ~7 s of
CPU for its imports, which was a third of the suite's time.

`launch_popen(args, ...)` and `launch_run(args, ...)` take the arguments after `launch.py`
(`python_popen(argv, ...)` what follows `python`: a script or `-c CODE`, and its arguments) and the
keywords of subprocess.Popen and subprocess.run the tests use; they give an object with Popen's
methods (pid, stdin/stdout/stderr, poll, wait, communicate, send_signal, terminate, kill) and a
CompletedProcess. The child is `python launch.py ARGS` in every way a test sees but one: its imports
happened before its environment was set, so a test about what an import reads (PYTHONPATH, a stub
package, start-up time) spawns a real child. DIFFTRAINER_REAL_CHILDREN=1 makes every child a real
one (the same tests, to compare). One server per test process, started at first use.
"""

from __future__ import annotations

import atexit
import io
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REAL = os.environ.get("DIFFTRAINER_REAL_CHILDREN") == "1"
_server: dict = {}
_lock = threading.Lock()


def _die_with_parent() -> None:
    import ctypes
    import signal

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _socket_path() -> str:
    with _lock:
        if not _server:
            folder = tempfile.mkdtemp(prefix="forked-launch-")
            path = os.path.join(folder, "server.sock")
            log = open(os.path.join(folder, "server.log"), "w+")  # what the libraries say while it imports
            process = subprocess.Popen([sys.executable, str(Path(__file__).with_name("forked_launch_server.py")), path],
                                       stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, text=True,
                                       cwd=ROOT, preexec_fn=_die_with_parent)
            if process.stdout.readline().strip() != "ready":
                process.kill()
                log.seek(0)
                raise RuntimeError(f"tests/forked_launch_server.py did not start:\n{log.read()[-3000:]}")
            atexit.register(process.kill)
            _server.update(process=process, path=path)
        return _server["path"]


class _Stream:
    """One of stdin/stdout/stderr as Popen takes it: PIPE, DEVNULL, None (the test process's own),
    a file object or a descriptor. `child` is the descriptor the child gets; `mine` the parent's end."""

    def __init__(self, spec, index: int, text: bool):
        self.mine = None
        self.close_child = False
        if spec == subprocess.PIPE:
            read, write = os.pipe()
            child, mine = (read, write) if index == 0 else (write, read)
            self.child, self.close_child = child, True
            if index == 0:  # as Popen makes a text stdin: each write goes through at once
                raw = open(mine, "wb")
                self.mine = io.TextIOWrapper(raw, encoding="utf-8", write_through=True) if text else raw
            else:
                self.mine = open(mine, "r", encoding="utf-8") if text else open(mine, "rb")
        elif spec == subprocess.DEVNULL:
            self.child, self.close_child = os.open(os.devnull, os.O_RDWR), True
        elif spec is None:
            self.child = index
        elif isinstance(spec, int):
            self.child = spec
        else:
            self.child = spec.fileno()


class ForkedChild:
    """A child of the server running `python ARGV` (ARGV: a script and its arguments, or `-c CODE ...`),
    with the Popen methods the tests use."""

    def __init__(self, argv, stdin=None, stdout=None, stderr=None, text=False, cwd=None, env=None):
        self.args = [sys.executable, *argv]
        merged = stderr == subprocess.STDOUT  # stderr into the same pipe or file as stdout
        streams = [_Stream(spec, i, text) for i, spec in enumerate((stdin, stdout, None if merged else stderr))]
        if merged:
            streams[2].child = streams[1].child
        self.stdin, self.stdout, self.stderr = (s.mine for s in streams)
        self.returncode: int | None = None
        request = {"argv": [str(a) for a in argv], "cwd": str(cwd or os.getcwd()),
                   "env": dict(os.environ if env is None else env)}
        self._connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._connection.connect(_socket_path())
        socket.send_fds(self._connection, [json.dumps(request).encode()], [s.child for s in streams])
        for stream in streams:
            if stream.close_child:
                os.close(stream.child)
        self.pid = int(self._connection.recv(64).decode().split()[1])
        self._output: dict[str, list] = {}
        self._readers: list[threading.Thread] = []

    # --- waiting -----------------------------------------------------------------------------

    def poll(self) -> int | None:
        if self.returncode is None:
            self._connection.setblocking(False)
            try:
                self._exit_message()
            except BlockingIOError:
                pass
            finally:
                if self.returncode is None:
                    self._connection.setblocking(True)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._connection.settimeout(timeout)
            try:
                self._exit_message()
            except TimeoutError:
                raise subprocess.TimeoutExpired(self.args, timeout) from None
            finally:
                if self.returncode is None:
                    self._connection.settimeout(None)
        return self.returncode

    def _exit_message(self) -> None:
        message = self._connection.recv(64).decode()
        if not message:
            raise RuntimeError("tests/forked_launch_server.py went away before its child's exit")
        self.returncode = int(message.split()[1])
        self._connection.close()

    def communicate(self, input=None, timeout: float | None = None):
        if not self._readers:
            if self.stdin is not None:
                def feed():
                    try:
                        if input:
                            self.stdin.write(input)
                        self.stdin.close()
                    except (BrokenPipeError, ValueError):
                        pass
                self._readers.append(threading.Thread(target=feed, daemon=True))
            for name in ("stdout", "stderr"):
                stream = getattr(self, name)
                if stream is not None:
                    chunks = self._output.setdefault(name, [])
                    self._readers.append(threading.Thread(target=lambda s=stream, c=chunks: c.append(s.read()),
                                                          daemon=True))
            for thread in self._readers:
                thread.start()
        for thread in self._readers:
            thread.join(timeout)
            if thread.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(timeout)
        return tuple(self._output[name][0] if name in self._output else None for name in ("stdout", "stderr"))

    # --- signals -----------------------------------------------------------------------------

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        import signal

        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        import signal

        self.send_signal(signal.SIGKILL)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        for stream in (self.stdin, self.stdout, self.stderr):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass
        self.wait()


def python_popen(argv, **kwargs):
    """`subprocess.Popen([python, *argv], **kwargs)`, forked from the server (argv: a script or -c CODE,
    and the arguments)."""
    if REAL:
        return subprocess.Popen([sys.executable, *argv], **kwargs)
    return ForkedChild(argv, **kwargs)


def launch_popen(args, **kwargs):
    """`subprocess.Popen([python, launch.py, *args], **kwargs)`, forked from the server."""
    return python_popen([str(ROOT / "launch.py"), *args], **kwargs)


def launch_run(args, *, capture_output=False, text=False, cwd=None, env=None, timeout=None, input=None,
               check=False, stdout=None, stderr=None, stdin=None) -> subprocess.CompletedProcess:
    """`subprocess.run([python, launch.py, *args], ...)`, forked from the server."""
    if REAL:
        return subprocess.run([sys.executable, str(ROOT / "launch.py"), *args], capture_output=capture_output,
                              text=text, cwd=cwd, env=env, timeout=timeout, input=input, check=check,
                              **({"stdout": stdout, "stderr": stderr} if not capture_output else {}),
                              **({"stdin": stdin} if input is None else {}))
    if capture_output:
        stdout = stderr = subprocess.PIPE
    if input is not None:
        stdin = subprocess.PIPE
    child = ForkedChild([str(ROOT / "launch.py"), *args], stdin=stdin, stdout=stdout, stderr=stderr, text=text, cwd=cwd, env=env)
    try:
        out, err = child.communicate(input, timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
        raise
    result = subprocess.CompletedProcess([sys.executable, str(ROOT / "launch.py"), *args], child.returncode, out, err)
    if check:
        result.check_returncode()
    return result
