"""A training run on another machine over ssh: check the box, send what it needs, start the run in
a session that outlives the connection, relay its events, bring its files back, reattach later.

On the box, under the remote dir (absolute once probed):
  helper.py            modules/remote/helper.py, sent first (standard library only)
  project/             launch.py, modules/, resources/, requirements*.txt
  data/model/<name>    the base model, when it is a local folder
  data/concepts/<i>-<name>, data/parts/<part>/<name>, data/init/<name>
  workspace/           the run's workspace_dir (samples, backup, save, cache)
  output/<name>        the run's output file
  run/                 config.json, events.jsonl (append-only), commands.fifo, train.log, exit_code
Here: the config's workspace_dir gets samples/, backup/ and save/ back, output.path the result,
and <workspace_dir>/remote-session.json remembers where the run is (for --attach; no secrets).

Events are relayed with their paths rewritten to where the files are here, after the file has
arrived, so a `sample` event can be shown at once.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from modules.config.train_config import TrainConfig
from modules.remote import helper
from modules.remote.ssh import RemoteError, SshTarget
from modules.util.atomic import write_text
from modules.saving.output_target import record_output, resolve_output

PROJECT_ROOT = Path(__file__).resolve().parents[2]
PROJECT_ITEMS = ("launch.py", "requirements.txt", "modules", "resources")
SESSION_FILE = "remote-session.json"
PULLED_FOLDERS = ("samples", "backup", "save")
EXIT_CONNECTION_LOST = 3  # `launch.py remote`: the connection dropped; the run goes on, reattach
MIN_FREE_AFTER = 1 << 30  # disk that must stay free on the box after the transfer (for backups, outputs)


class ConnectionLost(RemoteError):
    pass


def _local_pairs(source: Path, remote_prefix: str) -> list[tuple[str, str, int, int]]:
    """(local path, remote relative path, size, mtime) of a file or of every file under a folder."""
    source = Path(source)
    if source.is_file():
        stat = source.stat()
        return [(str(source), remote_prefix, stat.st_size, int(stat.st_mtime))]
    return [(str(source / rel), f"{remote_prefix}/{rel}", size, mtime)
            for rel, (size, mtime) in helper.manifest(str(source)).items()]


def _start_files(config: TrainConfig, source: Path) -> list[Path]:
    """adapter.init_from and the files beside it the family starts other parts from (Wan 2.2: the
    other expert's `-low_noise` / `-high_noise` file), by their names there."""
    from modules.adapters.layer_selection import trained_parts
    from modules.config.families import get_family_class

    family = get_family_class(config.model.family)
    plan = family.init_from_files(source, trained_parts(config, family)) or []
    return [source, *dict.fromkeys(path for path, _ in plan if path != source)]


class RemoteRun:
    """One run on one box. `start` (or `attach`), then iterate `events()`; `send_command` from any thread."""

    def __init__(self, target: SshTarget, local_workspace: str | Path, local_output: str | Path,
                 remote_dir: str, offset: int = 0, log: Callable[[str], None] | None = None):
        self.target = target
        self.local_workspace = Path(local_workspace).resolve()
        self.local_output = Path(local_output).resolve()
        self.requested_output = self.local_output  # output.path as configured (local_output may be name-2)
        # what the final save writes after the output's stem (Wan 2.2's "-high_noise", "-low_noise":
        # trainer/outputs.py saved_suffixes); "" is the output itself
        self.output_suffixes: tuple[str, ...] = ("",)
        self.remote_dir = remote_dir  # absolute on the box
        self.offset = offset  # bytes of events.jsonl already relayed
        self.log = log or (lambda text: print(f"[remote] {text}", file=sys.stderr, flush=True))
        self.returncode: int | None = None
        self._process: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._pending: list[dict] = []  # command messages not yet sent (between reconnects)

    # --- paths --------------------------------------------------------------------------------

    @property
    def remote_workspace(self) -> str:
        return f"{self.remote_dir}/workspace"

    @property
    def remote_output(self) -> str:
        return f"{self.remote_dir}/output/{self.local_output.name}"

    @property
    def run_dir(self) -> str:
        return f"{self.remote_dir}/run"

    def local_path(self, remote_path: str) -> Path | None:
        if remote_path == self.remote_output:
            return self.local_output
        output_root = f"{self.remote_dir}/output/"
        if remote_path.startswith(output_root) and self._is_output_file(remote_path[len(output_root):]):
            return self.local_output.parent / remote_path[len(output_root):]  # a companion (an embedding)
        prefix = self.remote_workspace + "/"
        if remote_path.startswith(prefix):
            try:
                return self.local_workspace / helper.safe_relative(remote_path[len(prefix):])
            except ValueError:
                return None  # not a plain path under the workspace: relayed as the box's path
        return None

    # --- the session file -----------------------------------------------------------------------

    def save_session(self) -> None:
        write_text(self.local_workspace / SESSION_FILE, json.dumps({
            "target": self.target.to_json(), "remote_dir": self.remote_dir, "offset": self.offset,
            "local_output": str(self.local_output), "requested_output": str(self.requested_output),
            "output_suffixes": list(self.output_suffixes)}, indent=2))

    @classmethod
    def from_session(cls, local_workspace: str | Path, log=None) -> RemoteRun:
        path = Path(local_workspace).resolve() / SESSION_FILE
        if not path.is_file():
            raise RemoteError(f"--attach: no remote run recorded in {path.parent} (no {SESSION_FILE}; "
                              "start one with launch.py remote --host ... --config ...)")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            run = cls(SshTarget(**data["target"]), local_workspace, data["local_output"], data["remote_dir"],
                      int(data.get("offset", 0)), log)
            run.requested_output = Path(data.get("requested_output", data["local_output"]))
            run.output_suffixes = tuple(str(suffix) for suffix in data.get("output_suffixes", [""]))
            return run
        except (ValueError, KeyError, TypeError, AttributeError, RemoteError) as error:  # not JSON, not our fields
            problem = str(error) if isinstance(error, (ValueError, RemoteError)) else f"{type(error).__name__}: {error}"
            raise RemoteError(f"--attach: {path} is damaged ({problem}): it no longer says where the remote run "
                              "is (the run itself goes on). Restore the file, or delete it to start a new run") from None

    # --- start ----------------------------------------------------------------------------------

    @classmethod
    def start(cls, target: SshTarget, config: TrainConfig, resume: bool = False, log=None) -> RemoteRun:
        """Check the box, send what the run needs (skipping unchanged files), start it; then iterate events()."""
        log = log or (lambda text: print(f"[remote] {text}", file=sys.stderr, flush=True))
        send_model = Path(config.model.base).expanduser().is_dir()
        info = cls.probe_box(target, None if send_model else config.model.base)
        remote_dir = info["dir"]
        log(f"{target.label}: Python {info['python']}, torch {info['torch']}, "
            f"{'CUDA: ' + ', '.join(info['gpus']) if info['cuda'] else 'no CUDA (training on its CPU)'}, "
            f"{info['free_bytes'] / 2**30:.1f} GiB free in {remote_dir}")
        cls._check_box(target, info, config, send_model)
        # output.if_exists is settled here, for the local file the result is fetched to
        from modules.trainer.outputs import saved_suffixes

        suffixes = tuple(saved_suffixes(config))
        local_output = resolve_output(config.output_path, config.output.if_exists, Path(config.workspace_dir),
                                      resume, lambda text: log(f"warning: {text}"), suffixes)
        run = cls(target, config.workspace_dir, local_output, remote_dir, 0, log)
        run.requested_output = config.output_path.resolve()
        run.output_suffixes = suffixes
        state = target.run_json(target.helper_argv(remote_dir, "status", run.run_dir), "checking for a run in progress")
        if state["state"] == "running":
            raise RemoteError(f"{target.label}: a run is still going in {run.run_dir}; reattach with "
                              "launch.py remote --attach, or send it a stop command first")

        pairs, remote_config = run._plan(config, send_model)
        run.local_workspace.mkdir(parents=True, exist_ok=True)
        config_copy = run.local_workspace / "remote-config.json"
        write_text(config_copy, json.dumps(remote_config, indent=2))
        pairs += _local_pairs(config_copy, "run/config.json")
        run._send(pairs, info["free_bytes"])
        argv = [target.python, f"{remote_dir}/project/launch.py", "train", "--config", f"{run.run_dir}/config.json",
                "--protocol", "jsonl", *(["--resume"] if resume else [])]
        if resume:
            run._push_backups()
        started = target.run_json(target.helper_argv(remote_dir, "start", run.run_dir, "--", *argv), "starting the run")
        log(f"started on {target.label} in {remote_dir} (supervisor pid {started['pid']})")
        run.save_session()
        return run

    @staticmethod
    def probe_box(target: SshTarget, need_dir: str | None = None) -> dict:
        """Install the helper in the remote dir and report the box: python, torch, CUDA, free disk,
        the absolute remote dir (and whether `need_dir` is a folder there)."""
        rd = target.remote_dir
        target.run(["sh", "-c", 'mkdir -p "$1" && cat > "$1/.helper.py.tmp" && mv "$1/.helper.py.tmp" "$1/helper.py"',
                    "sh", rd], f"installing the helper in {rd}", stdin=Path(helper.__file__).read_bytes())
        return target.run_json(target.helper_argv(rd, "probe", rd, *(["--need-dir", need_dir] if need_dir else [])),
                               "checking the box")

    @staticmethod
    def _check_box(target: SshTarget, info: dict, config: TrainConfig, send_model: bool) -> None:
        label = target.label
        if not info["python_ok"]:
            raise RemoteError(f"{label}: {target.python} is Python {info['python']}; the trainer needs 3.10 or newer "
                              "(pass --remote-python PATH)")
        if info.get("torch") is None:
            raise RemoteError(f"{label}: torch does not import for {info['executable']} ({info.get('torch_error')}); "
                              "install requirements.txt there or pass --remote-python PATH of an environment that has it")
        if info["missing"]:
            raise RemoteError(f"{label}: {info['executable']} lacks {', '.join(info['missing'])}; "
                              "install requirements.txt there")
        if not send_model and not info.get("need_dir_ok"):
            raise RemoteError(f"model.base: {config.model.base} is neither a folder here nor on {label}")
        if config.train_device.startswith("cuda") and not info["cuda"]:
            raise RemoteError(f"train_device: {config.train_device} but {label} has no working CUDA "
                              f"(torch {info['torch']})")

    def _plan(self, config: TrainConfig, send_model: bool) -> tuple[list, dict]:
        """What to send, and the config with its paths pointing where those files go on the box."""
        rd = self.remote_dir
        pairs = []
        for item in PROJECT_ITEMS:
            pairs += _local_pairs(PROJECT_ROOT / item, f"project/{item}")
        data = json.loads(config.model_dump_json())
        if send_model:
            base = Path(config.model.base).expanduser().resolve()
            pairs += _local_pairs(base, f"data/model/{base.name}")
            data["model"]["base"] = f"{rd}/data/model/{base.name}"
        for name, part in config.model.parts.items():
            if part.path:
                source = Path(part.path).expanduser()
                if not source.exists():
                    raise RemoteError(f"model.parts.{name}.path: {part.path} does not exist here")
                pairs += _local_pairs(source.resolve(), f"data/parts/{name}/{source.name}")
                data["model"]["parts"][name]["path"] = f"{rd}/data/parts/{name}/{source.name}"
        for index, concept in enumerate(config.concepts):
            source = Path(concept.path).expanduser()
            if not source.is_dir():
                raise RemoteError(f"concepts[{index}].path: {concept.path} is not a folder here")
            pairs += _local_pairs(source.resolve(), f"data/concepts/{index}-{source.name}")
            data["concepts"][index]["path"] = f"{rd}/data/concepts/{index}-{source.name}"
        if config.adapter.init_from:
            source = Path(config.adapter.init_from).expanduser()
            if not source.is_file():
                raise RemoteError(f"adapter.init_from: {config.adapter.init_from} is not a file here")
            for start in _start_files(config, source):  # with the files beside it that start other parts
                pairs += _local_pairs(start.resolve(), f"data/init/{start.name}")
            data["adapter"]["init_from"] = f"{rd}/data/init/{source.name}"
        for index, embedding in enumerate(config.embeddings):
            if embedding.path:
                source = Path(embedding.path).expanduser()
                if not source.is_file():
                    raise RemoteError(f"embeddings[{index}].path: {embedding.path} is not a file here")
                pairs += _local_pairs(source.resolve(), f"data/embeddings/{index}-{source.name}")
                data["embeddings"][index]["path"] = f"{rd}/data/embeddings/{index}-{source.name}"
        for index, prompt in enumerate(config.sampling.prompts):  # an edit or image-to-video prompt's images
            for number, image in enumerate(prompt.control_images):
                source = Path(image).expanduser()
                if not source.is_file():
                    raise RemoteError(f"sampling.prompts[{index}].control_images[{number}]: {image} is not a file here")
                relative = f"data/prompts/{index}-{number}-{source.name}"
                pairs += _local_pairs(source.resolve(), relative)
                data["sampling"]["prompts"][index]["control_images"][number] = f"{rd}/{relative}"
        data["workspace_dir"] = self.remote_workspace
        data["cache_dir"] = None
        data["output"]["path"] = self.remote_output
        data["output"]["if_exists"] = "overwrite"  # the box's copy only carries the result here
        data["backup"]["resume"] = False  # --resume says it on the command line
        return pairs, data

    def _send(self, pairs: list, free_bytes: int) -> None:
        """Send the files the box lacks or has in another size or time (rsync's quick check)."""
        roots = sorted({rel.split("/")[0] for _, rel, _, _ in pairs})
        remote = self.target.run_json(self.target.helper_argv(self.remote_dir, "manifest", *[f"{self.remote_dir}/{r}" for r in roots]),
                                      "listing the files on the box")
        there = {f"{root}/{rel}": tuple(v) for root in roots for rel, v in remote[f"{self.remote_dir}/{root}"].items()}
        todo = [(path, rel) for path, rel, size, mtime in pairs if there.get(rel) != (size, mtime)]
        total = sum(size for _, rel, size, mtime in pairs if there.get(rel) != (size, mtime))
        if free_bytes < total + MIN_FREE_AFTER:
            raise RemoteError(f"{self.target.label}: {self.remote_dir} has {free_bytes / 2**30:.1f} GiB free; "
                              f"the transfer needs {total / 2**30:.1f} GiB plus 1 GiB to work in")
        self.log(f"sending {len(todo)} of {len(pairs)} files ({total / 2**20:.1f} MiB); the rest are unchanged")
        if todo:
            self._stream_to_box(todo)

    def _stream_to_box(self, pairs: list[tuple[str, str]]) -> None:
        argv = self.target.helper_argv(self.remote_dir, "receive", self.remote_dir)
        process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            helper.send_pairs(process.stdin, pairs)
            process.stdin.close()
        except BrokenPipeError:
            pass
        process.stdout.read()
        err = process.stderr.read()
        if process.wait() != 0:
            raise RemoteError(self.target.explain(process.returncode, err.decode(errors="replace"),
                                                  f"sending files to {self.remote_dir}"))

    def _push_backups(self) -> None:
        """For --resume: the local backups the box lacks (a run may continue on another box)."""
        folder = self.local_workspace / "backup"
        if folder.is_dir():
            pairs = _local_pairs(folder, "workspace/backup")
            self._send([p for p in pairs if "/." not in p[1]], free_bytes=1 << 62)

    # --- attach ---------------------------------------------------------------------------------

    def events(self, pull: bool = True) -> Iterator[dict]:
        """Connect, catch up on what was missed, then yield each event as it comes (paths made local)
        until the run ends (self.returncode set) or the connection drops (ConnectionLost)."""
        if pull:
            self.sync_results()
        argv = self.target.helper_argv(self.remote_dir, "attach", self.run_dir, "--offset", str(self.offset))
        # its own session: a Ctrl-C in this terminal reaches this process (which sends "stop"), not ssh
        process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   start_new_session=True)
        with self._lock:
            self._process = process
            pending, self._pending = self._pending, []
        for message in pending:
            self.send_command(message["command"], message.get("prompt"))
        stderr_lines: list[bytes] = []
        threading.Thread(target=lambda: stderr_lines.extend(process.stderr), daemon=True).start()
        try:
            for raw in process.stdout:
                if not raw.endswith(b"\n"):
                    break  # a cut line: the connection dropped mid-event; it is read again on reattach
                try:
                    event = json.loads(raw)
                except ValueError:
                    self.offset += len(raw)
                    continue
                if pull:
                    event = self._localize(event)
                yield event
                # counted once the caller has handled it: a client killed in between shows it again
                # on reattach (at least once, never lost)
                self.offset += len(raw)
                self.save_session()
            code = process.wait()
        finally:  # also when the caller stops iterating: drop this connection (the run goes on)
            with self._lock:
                self._process = None
            if process.poll() is None:
                process.terminate()
                process.wait()
        detail = b"".join(stderr_lines).decode(errors="replace").strip().splitlines()
        if code in (255, helper.EXIT_DETACHED) or code < 0:
            raise ConnectionLost(f"{self.target.label}: the connection dropped ({detail[-1] if detail else f'ssh exit {code}'}); "
                                 "the run goes on there: reattach with launch.py remote --attach")
        if code == helper.EXIT_HELPER_FAILED:
            raise RemoteError(f"{self.target.label}: following the run failed: {detail[-1] if detail else code}")
        self.returncode = code
        if pull:
            self.sync_results()

    def _localize(self, event: dict) -> dict:
        if event.get("event") in ("sample", "backup", "saved") and isinstance(event.get("path"), str):
            local = self.local_path(event["path"])
            if local is not None:
                try:
                    self._pull_paths([event["path"]])
                except RemoteError as error:
                    self.log(f"could not bring {event['path']} back yet ({error}); it comes with the next sync")
                event = {**event, "path": str(local), "remote_path": event["path"]}
        return event

    def send_command(self, name: str, prompt: dict | None = None) -> bool:
        """Send a protocol command (stop, sample, backup, save; sample with its own `prompt`) to the
        run. Not connected (between reconnects): it is kept and sent on the next connection, and this
        returns False."""
        message = {"command": name, **({"prompt": prompt} if prompt is not None else {})}
        with self._lock:
            process = self._process
            if process is None or process.stdin is None:
                self._pending.append(message)
                return False
            try:
                process.stdin.write((json.dumps(message) + "\n").encode())
                process.stdin.flush()
                return True
            except (BrokenPipeError, ValueError, OSError):  # the connection is going down: next time
                self._pending.append(message)
                return False

    def stop(self) -> bool:
        """Ask the run to stop at the next step with a backup (it goes on sending events until it ends)."""
        return self.send_command("stop")

    def detach(self) -> None:
        """Drop the connection; the run goes on on the box."""
        process = self._process
        if process is not None and process.poll() is None:
            process.terminate()

    # --- bringing files back -------------------------------------------------------------------

    def sync_results(self) -> int:
        """Bring back samples, backups, saves and the output that are missing or differ here; how many files."""
        roots = [f"{self.remote_workspace}/{name}" for name in PULLED_FOLDERS] + [f"{self.remote_dir}/output"]
        listing = self.target.run_json(self.target.helper_argv(self.remote_dir, "manifest", *roots),
                                       "listing the run's files")
        wanted = []
        for name in PULLED_FOLDERS:
            local_root = self.local_workspace / name
            here = helper.manifest(str(local_root))
            for rel, meta in listing[f"{self.remote_workspace}/{name}"].items():
                if tuple(here.get(rel, ())) != tuple(meta):
                    wanted.append(f"{self.remote_workspace}/{name}/{rel}")
        for rel, meta in listing[f"{self.remote_dir}/output"].items():
            if not self._is_output_file(rel):
                continue
            local = self.local_output.parent / rel
            stat = local.stat() if local.is_file() else None
            if stat is None or (stat.st_size, int(stat.st_mtime)) != tuple(meta):
                wanted.append(f"{self.remote_dir}/output/{rel}")
        if wanted:
            self._pull_paths(wanted)
        return len(wanted)

    def _pull_paths(self, remote_paths: list[str]) -> None:
        """Bring remote files or folders back to their local places (each file written atomically)."""
        in_workspace = [p[len(self.remote_workspace) + 1:] for p in remote_paths if p.startswith(self.remote_workspace + "/")]
        if in_workspace:
            self._pull(self.remote_workspace, in_workspace, self.local_workspace)
        output_root = f"{self.remote_dir}/output/"
        in_output = [p[len(output_root):] for p in remote_paths if p.startswith(output_root)]
        if in_output:
            self._pull(f"{self.remote_dir}/output", in_output, self.local_output.parent)
            if any(rel == self.local_output.name or rel.startswith(self.local_output.name + "/") for rel in in_output):
                record_output(self.local_workspace, self.requested_output, self.local_output)  # a --resume replaces it

    def _is_output_file(self, rel: str) -> bool:
        """A file of this run's result in the box's output folder: the output itself, each file the save
        writes for it (one per expert for Wan 2.2), the files of an output folder (a fine-tune saved as
        diffusers), or a companion saved beside it (an embedding trained alongside:
        <stem>.<placeholder>.safetensors)."""
        name = self.local_output.name
        stem = self.local_output.stem if self.local_output.suffix else name
        saved = {f"{stem}{suffix}{self.local_output.suffix}" for suffix in self.output_suffixes}  # Wan 2.2's experts
        return rel == name or rel in saved or rel.startswith(name + "/") or (
            "/" not in rel and rel.startswith(stem + ".") and rel.endswith(".safetensors"))

    def _pull(self, remote_root: str, relatives: list[str], local_root: Path) -> None:
        argv = self.target.helper_argv(self.remote_dir, "send", remote_root, *relatives)
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            helper.receive_files(process.stdout, str(local_root))
        except (EOFError, ValueError) as error:
            process.kill()
            err = process.stderr.read().decode(errors="replace")
            process.wait()
            raise RemoteError(self.target.explain(process.returncode, err, f"bringing back {relatives}: {error}")) from None
        process.stdout.read()
        err = process.stderr.read()
        if process.wait() != 0:
            raise RemoteError(self.target.explain(process.returncode, err.decode(errors="replace"),
                                                  f"bringing back {relatives}"))


def remote_run_argv(target: SshTarget, config_path: str | Path | None = None, *, attach: bool = False,
                    resume: bool = False, workspace: str | Path | None = None, overrides: list[str] = (),
                    retries: int = 3, python: str = sys.executable) -> list[str]:
    """The argv of a child process that runs (or reattaches to) a remote run and speaks the run protocol on
    its stdin/stdout exactly like `launch.py train --protocol jsonl` does locally (paths in events are local).

    Exit codes: the remote trainer's (0 done, 1 failed, ...), or 3 when the connection dropped and did not
    come back within `retries` reconnects: the run goes on; the same argv with attach=True reattaches.
    """
    argv = [python, str(PROJECT_ROOT / "launch.py"), "remote", "--protocol", "jsonl", "--retries", str(retries)]
    if attach:
        argv.append("--attach")
    else:
        argv += ["--host", target.host, "--remote-dir", target.remote_dir, "--remote-python", target.python]
        if target.port:
            argv += ["--port", str(target.port)]
        if target.identity_file:
            argv += ["--identity", str(target.identity_file)]
        if target.known_hosts:
            argv += ["--known-hosts", str(target.known_hosts)]
    if config_path is not None:
        argv += ["--config", str(config_path)]
    if workspace is not None:
        argv += ["--workspace", str(workspace)]
    for override in overrides:
        argv += ["--set", override]
    if resume:
        argv.append("--resume")
    return argv
