"""The remote end of `launch.py remote`: copied to the box as <remote-dir>/helper.py and run there.

Standard library only (it runs before the project and its requirements are known to be there), and
imported locally too, for the file framing both ends share. Subcommands, each printing JSON or a
stream on stdout:

  probe DIR [--need-dir PATH]   python, torch, CUDA, free disk under DIR (and whether PATH is a folder)
  manifest ROOT...              {ROOT: {"relative/path": [size, mtime_seconds]}} of the files under each ROOT
  receive ROOT                  read framed files from stdin and write them under ROOT
  send ROOT REL...              write the named files (or folders) under ROOT to stdout, framed
  start RUN -- ARGV...          start ARGV in its own session (survives the ssh connection): the
                                supervisor below; prints {"pid": ...} and returns at once
  supervise RUN -- ARGV...      (internal) run ARGV with stdin from RUN/commands.fifo, stdout appended
                                to RUN/events.jsonl, stderr to RUN/train.log; RUN/exit_code at the end
  attach RUN [--offset N]       relay RUN/events.jsonl from byte N to stdout as it grows, and stdin
                                lines (commands) into the FIFO; exit with the run's exit code

Framing (no pickle, no tar): per file one JSON header line {"path": REL, "size": N, "mtime": T},
then N raw bytes; a final {"end": true}. A receiver refuses absolute paths and "..", writes each
file under a temp name and renames it, so an interrupted transfer never leaves a half file.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

CHUNK = 1 << 20
RUNNING, NO_RUN = "running", "none"
EXIT_LOST = 70  # `attach`: the run died without an exit status
EXIT_DETACHED = 71  # `attach`: the client closed the connection's input (it detached); the run goes on
EXIT_HELPER_FAILED = 72  # the helper itself failed (its one-line reason on stderr)


# --- files ------------------------------------------------------------------------------------

def manifest(root: str) -> dict:
    files = {}
    if not os.path.isdir(root):
        return files
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith(".tmp-"))  # backups being written
        for name in names:
            if name.startswith(".") and name.endswith(".tmp") or name.endswith(".pyc"):
                continue  # temp files of writes in progress
            path = os.path.join(folder, name)
            try:
                stat = os.stat(path)
            except FileNotFoundError:
                continue  # removed while walking (rolling backups)
            files[os.path.relpath(path, root).replace(os.sep, "/")] = [stat.st_size, int(stat.st_mtime)]
    return files


def safe_relative(rel: str) -> str:
    parts = rel.replace("\\", "/").split("/")
    if rel.startswith("/") or not rel or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"refusing the path {rel!r}: not a plain relative path")
    return os.path.join(*parts)


def send_files(out, root: str, relatives: list[str]) -> None:
    """Frame the files (folders: their files, `state.pt` of a backup last) under root onto `out`."""
    pairs = []
    for rel in relatives:
        path = os.path.join(root, safe_relative(rel))
        if os.path.isdir(path):
            inner = sorted(manifest(path), key=lambda name: (name.endswith("state.pt"), name))
            pairs += [(os.path.join(path, name), f"{rel.rstrip('/')}/{name}") for name in inner]
        elif os.path.isfile(path):
            pairs.append((path, rel))
    send_pairs(out, pairs)


def send_pairs(out, pairs: list[tuple[str, str]]) -> None:
    """Frame each (local file, relative name) onto `out`, then the end mark."""
    for path, rel in pairs:
        safe_relative(rel)
        try:
            handle = open(path, "rb")  # noqa: SIM115  (closed by the with below)
        except FileNotFoundError:
            continue  # removed since (a rolled-over backup)
        with handle:
            stat = os.fstat(handle.fileno())
            out.write((json.dumps({"path": rel, "size": stat.st_size, "mtime": stat.st_mtime}) + "\n").encode())
            left = stat.st_size
            while left:
                chunk = handle.read(min(CHUNK, left))
                if not chunk:
                    raise OSError(f"{path} shrank while it was sent")
                out.write(chunk)
                left -= len(chunk)
    out.write(b'{"end": true}\n')
    out.flush()


def frame_header(line: bytes) -> dict:
    """One file's header line, checked: {"path": text, "size": whole number, "mtime": number}, or
    the end mark. ValueError (what the receiving side reports) naming what is wrong."""
    try:
        meta = json.loads(line)
    except (ValueError, RecursionError):  # JSON and UTF-8 errors are ValueErrors
        raise ValueError(f"a file header of the stream is not JSON: {line[:80]!r}") from None
    if isinstance(meta, dict) and meta.get("end") is True:
        return meta
    if not isinstance(meta, dict):
        raise ValueError(f"a file header of the stream is not a JSON object: {line[:80]!r}")
    missing = [key for key in ("path", "size", "mtime") if key not in meta]
    if missing:
        raise ValueError(f"a file header of the stream lacks {', '.join(missing)}: {line[:80]!r}")
    path, size, mtime = meta["path"], meta["size"], meta["mtime"]
    if not isinstance(path, str):
        raise ValueError(f"a file header's path is not text: {path!r}")
    if not (isinstance(size, int) and not isinstance(size, bool) and size >= 0):
        raise ValueError(f"the file header of {path!r} has size {size!r}, not a whole number >= 0")
    if not (isinstance(mtime, (int, float)) and not isinstance(mtime, bool) and abs(mtime) < 1e11):
        raise ValueError(f"the file header of {path!r} has mtime {mtime!r}, not a time in seconds")
    return meta


def receive_files(stream, root: str, on_file=None) -> list[str]:
    """Write framed files from `stream` under root (each to a temp name, then renamed); their relative paths."""
    received = []
    while True:
        header = stream.readline()
        if not header:
            raise EOFError("the file stream ended early (connection lost?)")
        meta = frame_header(header)
        if meta.get("end"):
            return received
        rel, size = meta["path"], meta["size"]
        target = os.path.join(root, safe_relative(rel))
        os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
        temp = os.path.join(os.path.dirname(target), f".{os.path.basename(target)}.{os.getpid()}.tmp")
        try:
            with open(temp, "wb") as handle:
                left = size
                while left:
                    chunk = stream.read(min(CHUNK, left))
                    if not chunk:
                        raise EOFError(f"the file stream ended inside {rel} (connection lost?)")
                    handle.write(chunk)
                    left -= len(chunk)
                handle.flush()
                os.fsync(handle.fileno())
            os.utime(temp, (meta["mtime"], meta["mtime"]))
            os.replace(temp, target)
        except BaseException:
            if os.path.exists(temp):
                os.unlink(temp)
            raise
        received.append(rel)
        if on_file:
            on_file(rel)


# --- the box ------------------------------------------------------------------------------------

def probe(directory: str, need_dir: str | None) -> dict:
    directory = os.path.abspath(os.path.expanduser(directory))
    info = {"python": sys.version.split()[0], "python_ok": sys.version_info >= (3, 10),
            "executable": sys.executable, "dir": directory}
    os.makedirs(directory, exist_ok=True)
    info["free_bytes"] = shutil.disk_usage(directory).free
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = bool(torch.cuda.is_available())
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if info["cuda"] else []
    except Exception as error:  # noqa: BLE001  (any import failure means: no usable torch)
        info["torch"], info["torch_error"], info["cuda"], info["gpus"] = None, f"{type(error).__name__}: {error}", False, []
    import importlib.util

    info["missing"] = [m for m in ("diffusers", "transformers", "safetensors", "pydantic", "PIL")
                       if importlib.util.find_spec(m) is None]
    if need_dir:
        info["need_dir_ok"] = os.path.isdir(need_dir)
    return info


def start(run: str, argv: list[str]) -> dict:
    os.makedirs(run, exist_ok=True)
    for name in ("exit_code", "events.jsonl", "train.log", "supervisor.pid", "commands.fifo"):
        if os.path.lexists(os.path.join(run, name)):
            os.unlink(os.path.join(run, name))
    os.mkfifo(os.path.join(run, "commands.fifo"), 0o600)
    open(os.path.join(run, "events.jsonl"), "wb").close()
    with open(os.path.join(run, "supervisor.log"), "ab") as log:
        process = subprocess.Popen([sys.executable, os.path.abspath(__file__), "supervise", run, "--", *argv],
                                   stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
                                   close_fds=True)
    return {"pid": process.pid}


def supervise(run: str, argv: list[str]) -> int:
    """Own session, no terminal: a dropped ssh connection (SIGHUP) does not reach it or the trainer."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    with open(os.path.join(run, "supervisor.pid"), "w") as handle:
        handle.write(str(os.getpid()))
    # opened read-write, the FIFO always has a writer: the trainer never reads EOF on its command
    # stream, however many `attach` clients come and go
    fifo = os.open(os.path.join(run, "commands.fifo"), os.O_RDWR)
    with open(os.path.join(run, "events.jsonl"), "ab") as events, open(os.path.join(run, "train.log"), "ab") as log:
        process = subprocess.Popen(argv, stdin=fifo, stdout=events, stderr=log, close_fds=True)
        def forward(signum, _frame):
            process.send_signal(signum)

        signal.signal(signal.SIGTERM, forward)
        signal.signal(signal.SIGINT, forward)
        code = process.wait()
    if code != 0:
        _report_crash(run, code)
    temp = os.path.join(run, ".exit_code.tmp")
    with open(temp, "w") as handle:
        handle.write(str(code))
    os.replace(temp, os.path.join(run, "exit_code"))
    return 0


def _report_crash(run: str, code: int) -> None:
    """A trainer that died without an `error` event (a crash, a kill): add one, with its log's tail."""
    with open(os.path.join(run, "events.jsonl"), "rb") as handle:
        lines = handle.read().splitlines()
    try:
        last = json.loads(lines[-1]).get("event") if lines else None
    except ValueError:
        last = None
    if last == "error":
        return
    with open(os.path.join(run, "train.log"), "rb") as handle:
        handle.seek(max(0, os.fstat(handle.fileno()).st_size - 2000))
        tail = handle.read().decode(errors="replace").strip().splitlines()[-5:]
    message = f"the trainer exited with code {code}" + (": " + " | ".join(tail) if tail else "")
    with open(os.path.join(run, "events.jsonl"), "ab") as handle:
        handle.write((json.dumps({"event": "error", "message": message}) + "\n").encode())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def status(run: str) -> str | int:
    """The exit code, RUNNING, NO_RUN (never started here), or None when the run is gone without an exit code."""
    try:
        with open(os.path.join(run, "exit_code")) as handle:
            return int(handle.read().strip())
    except FileNotFoundError:
        pass
    if not os.path.exists(os.path.join(run, "events.jsonl")):
        return NO_RUN
    try:
        with open(os.path.join(run, "supervisor.pid")) as handle:
            pid = int(handle.read().strip())
    except (FileNotFoundError, ValueError):
        return RUNNING  # starting up
    return RUNNING if _alive(pid) else None


def attach(run: str, offset: int) -> int:
    out = sys.stdout.buffer

    def forward_commands() -> None:
        for line in sys.stdin.buffer:
            if not line.strip():
                continue
            try:  # non-blocking: fails at once (ENXIO) when the supervisor holds the FIFO no longer
                fd = os.open(os.path.join(run, "commands.fifo"), os.O_WRONLY | os.O_NONBLOCK)
            except OSError:
                continue
            try:
                os.write(fd, line if line.endswith(b"\n") else line + b"\n")
            except OSError:
                pass  # the trainer is not reading (its pipe is full) or is gone: the command is dropped
            finally:
                os.close(fd)
        os._exit(EXIT_DETACHED)  # the client closed its end: the connection is gone, so go too (the run goes on)

    threading.Thread(target=forward_commands, daemon=True).start()
    with open(os.path.join(run, "events.jsonl"), "rb") as events:
        events.seek(offset)
        pending = b""
        while True:
            state = status(run)  # read before the events, so none written before the exit are missed
            data = events.read()
            if data:
                pending += data
                complete, _, pending = pending.rpartition(b"\n")
                if complete:
                    out.write(complete + b"\n")
                    out.flush()
                continue
            if state is None:
                message = f"the run in {run} ended without an exit status (its supervisor is gone; was the box rebooted?)"
                out.write((json.dumps({"event": "error", "message": message}) + "\n").encode())
                out.flush()
                return EXIT_LOST
            if state == NO_RUN:
                message = f"no run was started in {run}"
                out.write((json.dumps({"event": "error", "message": message}) + "\n").encode())
                out.flush()
                return EXIT_LOST
            if state != RUNNING:
                return int(state)
            time.sleep(0.2)


def main(argv: list[str]) -> int:
    command, rest = argv[0], argv[1:]
    if command == "probe":
        need = rest[rest.index("--need-dir") + 1] if "--need-dir" in rest else None
        print(json.dumps(probe(rest[0], need)))
    elif command == "manifest":
        print(json.dumps({root: manifest(root) for root in rest}))
    elif command == "receive":
        received = receive_files(sys.stdin.buffer, rest[0])
        print(json.dumps({"received": len(received)}))
    elif command == "send":
        send_files(sys.stdout.buffer, rest[0], rest[1:])
    elif command in ("start", "supervise"):
        split = rest.index("--")
        run, program = rest[0], rest[split + 1:]
        if command == "start":
            print(json.dumps(start(run, program)))
        else:
            return supervise(run, program)
    elif command == "attach":
        offset = int(rest[rest.index("--offset") + 1]) if "--offset" in rest else 0
        return attach(rest[0], offset)
    elif command == "status":
        state = status(rest[0])
        print(json.dumps({"state": state if state in (RUNNING, NO_RUN) else "lost" if state is None else "exited",
                          "exit_code": state if isinstance(state, int) else None}))
    else:
        print(f"unknown helper command {command!r}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    try:
        status_code = main(sys.argv[1:])
        sys.stdout.flush()
    except BrokenPipeError:  # the ssh client went away; the run (in its own session) goes on
        status_code = 0
    except Exception as error:  # noqa: BLE001  (one line for the local side to show, not a traceback)
        print(f"helper {' '.join(sys.argv[1:2])}: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
        status_code = EXIT_HELPER_FAILED
    # os._exit, not sys.exit: a normal shutdown aborts while `attach`'s command thread blocks on stdin
    os._exit(status_code)
