"""The server of tests/forked_launch.py: a process that has imported what `launch.py` imports (torch,
diffusers, transformers, the trainer: ~7 s of CPU a child pays otherwise) and forks one `launch.py`
child per request, so a test's child starts in a tenth of a second and then runs as `python launch.py ARGS`
(or `python -c CODE ARGS`) runs (its own argv, cwd, environment, stdin/stdout/stderr, exit status).

Run as `python tests/forked_launch_server.py SOCKET`; it prints "ready" once it listens. A request
is one SOCK_SEQPACKET message: JSON {"argv" (what follows `python`: a script and its arguments, or
`-c CODE ...`), "cwd", "env"} and three file descriptors (the child's
stdin, stdout, stderr). The answers on that connection: "pid N", later "exit N" (N as
Popen.returncode: minus the signal for a child killed by one). A connection closed before its child
ends kills the child (a test that gave up on it).

Forking a process that imported torch is safe only while it runs one thread (a thread pool made
after an op would be copied half-alive): the server runs no tensor op, waits with one select loop
and refuses to start with more threads than one.
"""

from __future__ import annotations

import gc
import io
import json
import os
import select
import signal
import socket
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def preload() -> None:
    """What a `launch.py train` child imports before its first step (a child imports the rest itself)."""
    sys.path.insert(0, str(ROOT))
    import launch  # noqa: F401  (its environment defaults, before the libraries read them)
    import modules.cli.console  # noqa: F401
    import modules.cli.train_command  # noqa: F401
    import modules.saving.consumers.check  # noqa: F401
    import modules.trainer.generic_trainer  # noqa: F401
    import modules.cli.demo  # noqa: F401
    import modules.cli.plan_command  # noqa: F401
    import modules.plan.run_plan  # noqa: F401
    from modules.config.families import family_names, get_family_class

    for name in family_names():
        get_family_class(name)
    import diffusers
    import transformers

    # the tiny SD1.5 the tests train: its pipeline (sampling) and its parts' classes (loading)
    for name in ("StableDiffusionPipeline", "AutoencoderKL", "UNet2DConditionModel", "DDPMScheduler"):
        getattr(diffusers, name)
    for name in ("CLIPTextModel", "CLIPTokenizer", "CLIPImageProcessor", "CLIPTextConfig"):
        getattr(transformers, name)


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def run_child(request: dict, fds: list[int]) -> None:
    """In the forked child: become `python ARGV` and exit as it would. Never returns."""
    code = 1
    try:
        for target, fd in zip((0, 1, 2), fds):
            os.dup2(fd, target)
        for fd in fds:
            os.close(fd)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        if os.environ.get("OMP_NUM_THREADS"):  # read by torch at its import, which was the server's
            import torch

            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        # the standard streams as the interpreter makes them for pipes (stderr line-buffered)
        sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)),
                                                     encoding="utf-8")
        sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)),
                                                       encoding="utf-8")
        sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.BufferedWriter(io.FileIO(2, "w", closefd=False)),
                                                       encoding="utf-8", errors="backslashreplace", line_buffering=True)
        code = _run(request["argv"])
    except BaseException:  # noqa: BLE001  (the child must exit, whatever went wrong in it)
        traceback.print_exc()
    os._exit(code)


def _run(argv: list[str]) -> int:
    """`python ARGV`: a script and its arguments, or `-c CODE` and its arguments."""
    import atexit
    import runpy
    import threading
    import types

    interrupted = False
    try:
        if argv[0] == "-c":
            sys.argv, sys.path[0] = ["-c", *argv[2:]], ""
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        else:
            sys.argv, sys.path[0] = list(argv), os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as exit_:
        code = _exit_status(exit_.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        code, interrupted = 130, True
    except BaseException:  # noqa: BLE001  (an uncaught error: its traceback and status 1, as python's)
        traceback.print_exc()
        code = 1
    threading._shutdown()  # the interpreter's own exit: non-daemon threads joined, then atexit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if interrupted:  # python dies of the SIGINT it did not handle, so its parent sees the signal
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def _exit_status(value) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1


def serve(path: str, ready) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    children: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, connection)
    by_connection: dict[socket.socket, int] = {}  # connection -> pidfd
    print("ready", file=ready, flush=True)
    ready.close()
    while True:
        ready, _, _ = select.select([listener, *children, *by_connection], [], [])
        for item in ready:
            if item is listener:
                connection, _ = listener.accept()
                message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
                if threads() != 1:
                    raise SystemExit(f"forked_launch_server: {threads()} threads, cannot fork safely")
                gc.freeze()  # the imports' objects out of the collector's sight: a child's collections do not
                # touch (and so copy) every page of them
                pid = os.fork()
                if pid == 0:
                    gc.enable()
                    listener.close()
                    connection.close()
                    run_child(json.loads(message), fds)
                for fd in fds:
                    os.close(fd)
                pidfd = os.pidfd_open(pid)
                children[pidfd] = (pid, connection)
                by_connection[connection] = pidfd
                connection.send(f"pid {pid}".encode())
            elif isinstance(item, int):  # a child ended
                pid, connection = children.pop(item)
                by_connection.pop(connection, None)
                os.close(item)
                _, status = os.waitpid(pid, 0)
                code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
                try:
                    connection.send(f"exit {code}".encode())
                except OSError:
                    pass
                connection.close()
            else:  # a client closed its connection (or sent something): its child goes
                pidfd = by_connection.pop(item)
                pid, _ = children[pidfd]
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


if __name__ == "__main__":
    # numpy's OpenBLAS starts a thread server at import; one thread fewer to copy into each child (its
    # children then do numpy's few matrix products on one thread; torch's own threads start in the child)
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    ready = os.fdopen(os.dup(1), "w")  # "ready" alone on stdout; what the imports print goes to the log
    os.dup2(2, 1)
    gc.disable()  # as Python's docs advise for a server that forks: collected garbage leaves holes in pages
    preload()
    if threads() != 1:
        raise SystemExit(f"forked_launch_server: the imports left {threads()} threads; forking is not safe")
    serve(sys.argv[1], ready)
