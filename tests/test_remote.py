"""Remote runs against a real sshd on 127.0.0.1, started here with a throwaway host key and user key.

The "box" is this machine: the remote dir is a temp folder, the remote python is this venv's. If
sshd is not installed or does not start, the tests skip saying why (CI installs openssh-server).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import ROOT, train_config

SSHD = shutil.which("sshd") or ("/usr/sbin/sshd" if os.path.exists("/usr/sbin/sshd") else None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    """(SshTarget factory, known_hosts path) for an sshd on 127.0.0.1 that lets the current user in by key."""
    if SSHD is None:
        pytest.skip("sshd is not installed (apt-get install openssh-server)")
    if shutil.which("ssh") is None or shutil.which("ssh-keygen") is None:
        pytest.skip("the ssh client is not installed (apt-get install openssh-client)")
    from modules.remote.ssh import SshTarget

    folder = tmp_path_factory.mktemp("sshd")
    os.chmod(folder, 0o700)
    for name in ("host_key", "user_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(folder / name)], check=True)
    shutil.copy(folder / "user_key.pub", folder / "authorized_keys")
    port = _free_port()
    (folder / "sshd_config").write_text("\n".join([
        f"Port {port}", "ListenAddress 127.0.0.1", f"HostKey {folder / 'host_key'}",
        f"AuthorizedKeysFile {folder / 'authorized_keys'}", f"PidFile {folder / 'sshd.pid'}",
        "PasswordAuthentication no", "KbdInteractiveAuthentication no", "PubkeyAuthentication yes",
        "UsePAM no", "StrictModes no", "PermitRootLogin prohibit-password",
        "SetEnv OMP_NUM_THREADS=1",  # the trainer on the "box" shares this machine's two cores
    ]) + "\n")
    if os.geteuid() == 0:
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation folder when run as root
    log = open(folder / "sshd.log", "wb")  # noqa: SIM115  (open while sshd runs)
    process = subprocess.Popen([SSHD, "-D", "-e", "-f", str(folder / "sshd_config")], stdout=log, stderr=log)
    host_key = (folder / "host_key.pub").read_text().split()
    (folder / "known_hosts").write_text(f"[127.0.0.1]:{port} {host_key[0]} {host_key[1]}\n")
    user = os.environ.get("USER") or __import__("pwd").getpwuid(os.getuid()).pw_name

    def target(remote_dir, known_hosts=folder / "known_hosts", python=sys.executable):
        return SshTarget(f"{user}@127.0.0.1", port, str(remote_dir), str(folder / "user_key"), str(known_hosts), python)

    deadline = time.monotonic() + 10
    while True:
        probe = subprocess.run(target(folder).argv(["true"]), capture_output=True, text=True, check=False)
        if probe.returncode == 0:
            break
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            log.close()
            pytest.skip(f"sshd did not start or let us in: {(folder / 'sshd.log').read_text()[-500:]} {probe.stderr[-300:]}")
        time.sleep(0.2)
    yield target
    process.terminate()
    process.wait(timeout=10)
    log.close()


def test_unknown_host_key_is_refused_naming_the_host(sshd, tmp_path):
    from modules.remote.run import RemoteRun
    from modules.remote.ssh import RemoteError

    empty = tmp_path / "known_hosts"
    empty.write_text("")
    with pytest.raises(RemoteError, match=r"127\.0\.0\.1:\d+: the host key is unknown or has changed"):
        RemoteRun.probe_box(sshd(tmp_path / "box", known_hosts=empty))
    assert not (tmp_path / "box").exists()  # nothing ran there


def test_box_without_torch_is_refused(sshd, tmp_path, tiny_model, shape_images):
    from modules.remote.run import RemoteRun
    from modules.remote.ssh import RemoteError

    bare = shutil.which("python3", path="/usr/bin:/bin")
    if bare is None or subprocess.run([bare, "-c", "import torch"], capture_output=True, check=False).returncode == 0:
        pytest.skip("no system python without torch to stand for a bare box")
    config = train_config(tiny_model, shape_images, tmp_path)
    with pytest.raises(RemoteError, match=r"torch does not import for .*install requirements.txt there"):
        RemoteRun.start(sshd(tmp_path / "box", python=bare), config, log=lambda _: None)


def _ssh_attach_clients(parent: int) -> list[int]:
    """Pids of the `ssh ... helper.py attach` children of `parent` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == parent and cmdline[0].endswith(b"ssh") and any(b" attach " in part for part in cmdline):
            found.append(int(entry.name))
    return found


def _read_events(process, on_event=None) -> list[dict]:
    events = []
    for line in process.stdout:
        event = json.loads(line)  # every stdout line is an event
        events.append(event)
        if on_event:
            on_event(event)
    return events


def test_remote_run_survives_a_dropped_connection_and_brings_results_back(sshd, tmp_path, tiny_model, shape_images):
    from safetensors.torch import load_file

    box = tmp_path / "box"
    config = train_config(tiny_model, shape_images, tmp_path, {
        # 4 batches accumulated per step over 4 repeats: 12 steps as before, each long enough that the
        # run is still going after the client's two deaths on an idle machine (1 batch a step was not)
        "schedule": {"epochs": 6, "sample_every": "4 steps", "backup_every": "4 steps", "save_every": "5 steps",
                     "gradient_accumulation": 4},
        "sampling": {"prompts": [{"prompt": "a circle", "steps": 2, "width": 64, "height": 64}]},
        # an embedding trained alongside the LoRA: its file is saved beside the output and comes back too
        "embeddings": [{"placeholder": "<shape>", "init_text": "a"}],
        "concepts": [{"path": str(shape_images), "repeats": 4, "captions": {"prefix": "<shape> "}}],
    })
    config_file = tmp_path / "run.json"
    config_file.write_text(config.model_dump_json())
    target = sshd(box)
    argv = [sys.executable, str(ROOT / "launch.py"), "remote", "--host", target.host, "--port", str(target.port),
            "--identity", target.identity_file, "--known-hosts", target.known_hosts, "--remote-dir", str(box),
            "--remote-python", target.python, "--config", str(config_file), "--protocol", "jsonl", "--retries", "1"]
    first = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    killed = []

    def drop_connection(event):
        if event["event"] == "started":  # a command travels: client stdin, ssh, the FIFO, the trainer
            first.stdin.write('{"command": "backup"}\n')
            first.stdin.flush()
        reconnected = any(e["event"] == "warning" and "reconnecting (1/1)" in e["message"] for e in events)
        if event["event"] == "progress" and not killed:
            clients = _ssh_attach_clients(first.pid)
            assert len(clients) == 1, clients
            os.kill(clients[0], signal.SIGKILL)  # the connection drops (the local ssh client dies): it reconnects
            killed.append(event["step"])
        elif event["event"] == "progress" and reconnected and len(killed) == 1:
            first.kill()  # then the client itself goes (a laptop closed): the run goes on, --attach picks it up
            killed.append(event["step"])

    events = []
    for line in first.stdout:
        events.append(json.loads(line))  # every stdout line is an event
        drop_connection(events[-1])
    assert first.wait(timeout=60) == -signal.SIGKILL
    sent, total = map(int, re.search(r"sending (\d+) of (\d+) files", first.stderr.read()).groups())
    assert sent == total > 100  # a new box: everything (project, model, images, config)
    warning = next(e for e in events if e["event"] == "warning")
    assert "the connection dropped" in warning["message"] and "reconnecting (1/1)" in warning["message"]
    assert len(killed) == 2 and not any(e["event"] == "finished" for e in events)
    assert json.loads((box / "run" / "events.jsonl").read_text().splitlines()[0])["event"] == "started"
    assert not (box / "run" / "exit_code").exists()  # the run goes on without us

    second = subprocess.Popen([sys.executable, str(ROOT / "launch.py"), "remote", "--attach", "--config", str(config_file),
                               "--protocol", "jsonl"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT)
    events += _read_events(second)
    assert second.wait(timeout=120) == 0, (events[-3:], second.stderr.read())

    kinds = [e["event"] for e in events if e["event"] not in ("error", "warning")]
    assert kinds[0] == "started" and kinds[-1] == "finished"
    steps = [e["step"] for e in events if e["event"] == "progress"]
    # every step, in order; at most the one event the killed client was handling comes again
    assert sorted(set(steps)) == list(range(1, 13)) and len(steps) - len(set(steps)) <= 1, steps
    assert steps == sorted(steps), steps

    backup_steps = list(dict.fromkeys(int(re.search(r"step(\d+)", e["path"]).group(1))
                                      for e in events if e["event"] == "backup"))
    assert backup_steps[1:] == [4, 8, 12] and backup_steps[0] in (1, 2), backup_steps  # the first: the command's

    # results are here, at the config's paths, equal to the box's
    output = Path(config.output.path)
    companion = output.with_name(f"{output.stem}.shape.safetensors")
    saved = events[-3:-1]
    assert "consumers" in saved[0]  # the adapter file's check comes back with it (modules/saving/consumers)
    assert [{k: v for k, v in e.items() if k != "consumers"} for e in saved] == [
        {"event": "saved", "path": str(path), "remote_path": str(box / "output" / path.name)} for path in (output, companion)]
    assert output.read_bytes() == (box / "output" / output.name).read_bytes()
    assert load_file(str(output))  # whole and loadable
    assert companion.read_bytes() == (box / "output" / companion.name).read_bytes()
    assert load_file(str(companion))["emb_params"].shape == (1, 32)
    workspace = Path(config.workspace_dir)
    for kind in ("sample", "backup"):
        paths = [Path(e["path"]) for e in events if e["event"] == kind]
        assert paths and all(p.exists() and str(p).startswith(str(workspace)) for p in paths), kind
    assert sorted(p.name for p in (workspace / "samples").iterdir()) == \
        sorted(p.name for p in (box / "workspace" / "samples").iterdir())
    for backup in (box / "workspace" / "backup").iterdir():
        for file in backup.iterdir():
            assert (workspace / "backup" / backup.name / file.name).read_bytes() == file.read_bytes()
    assert (workspace / "save").is_dir() and list((workspace / "save").iterdir())


def test_events_drive_console_callbacks_in_text_mode():
    import io

    from modules.cli.console import ConsoleCallbacks
    from modules.remote.cli import dispatch

    stream = io.StringIO()
    console = ConsoleCallbacks(stream)
    for event in ({"event": "started", "total_steps": 2},
                  {"event": "progress", "step": 1, "total_steps": 2, "epoch": 0, "epochs": 1, "loss": 0.5,
                   "lr": 1e-4, "it_per_s": 2.0, "eta_s": None},
                  {"event": "sample", "path": "/here/s.png"}, {"event": "warning", "message": "careful"},
                  {"event": "finished"}):
        dispatch(event, console)
    text = stream.getvalue()
    assert "step 1/2 epoch 1/1 loss 0.5000" in text and "eta ?" in text
    assert "sample: /here/s.png" in text and "warning: careful" in text


def test_ctrl_c_stops_the_remote_run_with_a_backup_and_resume_continues_it(sshd, tmp_path, tiny_model, shape_images):
    box = tmp_path / "box"
    config = train_config(tiny_model, shape_images, tmp_path, {"schedule": {"epochs": 4}})  # 8 steps
    config_file = tmp_path / "run.json"
    config_file.write_text(config.model_dump_json())
    target = sshd(box)
    argv = [sys.executable, str(ROOT / "launch.py"), "remote", "--host", target.host, "--port", str(target.port),
            "--identity", target.identity_file, "--known-hosts", target.known_hosts, "--remote-dir", str(box),
            "--remote-python", target.python, "--config", str(config_file)]
    first = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             cwd=ROOT)
    lines = []
    for line in first.stderr:  # text mode: the console's lines
        lines.append(line)
        if line.startswith("step 1/8"):
            first.send_signal(signal.SIGINT)  # Ctrl-C here: the run there stops at the next step, with a backup
    out, _ = first.communicate(timeout=60)
    assert first.returncode == 0, "".join(lines)
    assert out.strip() == config.output.path
    backups = sorted((Path(config.workspace_dir) / "backup").iterdir())
    assert len(backups) == 1 and (backups[0] / "state.pt").is_file(), "".join(lines)  # brought back
    stopped_at = int(re.search(r"step(\d+)", backups[0].name).group(1))
    assert stopped_at < 8

    shutil.rmtree(box / "workspace" / "backup")  # the box lost it: --resume sends the local backups
    data_inodes = {path: path.stat().st_ino for path in (box / "data").rglob("*") if path.is_file()}
    resumed = subprocess.run([*argv, "--resume", "--protocol", "jsonl"], capture_output=True, text=True, cwd=ROOT,
                             timeout=120, check=False)
    assert resumed.returncode == 0, resumed.stderr
    # model and images were there: not sent again (a file sent is written anew, under a new inode)
    assert data_inodes == {path: path.stat().st_ino for path in (box / "data").rglob("*") if path.is_file()}
    assert len(data_inodes) > 10
    assert "sending 3 of 3 files" in resumed.stderr  # the backup the box lacks
    assert (box / "workspace" / "backup" / backups[0].name / "state.pt").read_bytes() == \
        (backups[0] / "state.pt").read_bytes()
    events = [json.loads(line) for line in resumed.stdout.splitlines()]
    steps = [e["step"] for e in events if e["event"] == "progress"]
    assert steps == list(range(stopped_at + 1, 9)), steps
    assert events[-1]["event"] == "finished" and Path(events[-2]["path"]) == Path(config.output.path)


def test_remote_run_argv_is_a_launch_remote_command_line():
    import launch
    from modules.remote import SshTarget, remote_run_argv

    target = SshTarget("me@gpu-box", 2222, "runs/a", "~/.ssh/key", "/tmp/kh", "/opt/venv/bin/python")
    argv = remote_run_argv(target, "/cfg/my.json", overrides=["schedule.epochs=3"], retries=5)
    assert argv[1].endswith("launch.py")
    args = launch.build_parser().parse_args(argv[2:])
    assert (args.command, args.host, args.port, args.remote_dir, args.identity, args.known_hosts, args.remote_python,
            args.config, args.set, args.protocol, args.retries, args.attach) == (
        "remote", "me@gpu-box", 2222, "runs/a", "~/.ssh/key", "/tmp/kh", "/opt/venv/bin/python",
        ["/cfg/my.json"], ["schedule.epochs=3"], "jsonl", 5, False)
    again = launch.build_parser().parse_args(remote_run_argv(target, "/cfg/my.json", attach=True)[2:])
    assert again.attach and again.host is None and again.config == ["/cfg/my.json"]


@pytest.mark.parametrize("host", ["-oProxyCommand=x", "", "user@box extra"])
def test_a_host_that_is_not_one_is_refused(host):
    from modules.remote.ssh import RemoteError, SshTarget

    with pytest.raises(RemoteError, match="--host: .* is not a host"):
        SshTarget(host)


def test_helper_session_reports_a_trainer_that_crashes(tmp_path):
    """The box side alone: a supervised program that dies without an error event gets one, with its log."""
    helper = ROOT / "modules" / "remote" / "helper.py"
    run = tmp_path / "run"
    program = "import sys; print('{\"event\": \"started\", \"total_steps\": 1}', flush=True); sys.exit('boom: out of memory')"
    started = subprocess.run([sys.executable, str(helper), "start", str(run), "--", sys.executable, "-c", program],
                             capture_output=True, text=True, check=True)
    assert json.loads(started.stdout)["pid"] > 0
    deadline = time.monotonic() + 30
    while not (run / "exit_code").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    # a client keeps the input open (closing it means: detached)
    attached = subprocess.Popen([sys.executable, str(helper), "attach", str(run)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
    out = attached.stdout.read()
    assert attached.wait(timeout=30) == 1
    attached.stdin.close()
    events = [json.loads(line) for line in out.splitlines()]
    assert events[0] == {"event": "started", "total_steps": 1}
    assert events[1] == {"event": "error", "message": "the trainer exited with code 1: boom: out of memory"}


def test_a_wan22_run_brings_back_each_experts_file_and_the_attach_remembers_them(tmp_path):
    """Wan 2.2 A14B saves one file per expert (<stem>-high_noise / -low_noise.safetensors): both
    are this run's result and come back, after a reattach too (the session file keeps the suffixes)."""
    from modules.config.loading import build_config
    from modules.remote.run import PULLED_FOLDERS, RemoteRun
    from modules.remote.ssh import SshTarget
    from modules.trainer.outputs import saved_suffixes

    config = build_config([{"model": {"family": "wan22", "parts": {"transformer": {"train": True},
                                                                   "transformer_2": {"train": True}}},
                            "workspace_dir": str(tmp_path / "ws")}])
    run = RemoteRun(None, tmp_path / "ws", tmp_path / "out" / "lora.safetensors", "/box", 0, lambda text: None)
    run.output_suffixes = tuple(saved_suffixes(config))
    assert run.output_suffixes == ("-high_noise", "-low_noise")
    run.target = SshTarget("user@box")
    (tmp_path / "ws").mkdir()
    run.save_session()
    run = RemoteRun.from_session(tmp_path / "ws", lambda text: None)
    listing = {"lora-high_noise.safetensors": [10, 1], "lora-low_noise.safetensors": [10, 1],
               "lora-other.safetensors": [3, 1], "other-low_noise.safetensors": [3, 1]}
    run.target = SimpleNamespace(helper_argv=lambda *argv: list(argv), run_json=lambda argv, what: {
        **{f"/box/workspace/{name}": {} for name in PULLED_FOLDERS}, "/box/output": listing})
    pulled = []
    run._pull = lambda root, relatives, local_root: pulled.append((root, sorted(relatives)))
    run.sync_results()
    assert pulled == [("/box/output", ["lora-high_noise.safetensors", "lora-low_noise.safetensors"])]


def test_a_remote_run_sends_the_sample_prompts_images(tmp_path, tiny_model, shape_images):
    """An edit or image-to-video prompt's control images go to the box with the concepts, and the box's
    config points at them there (its preflight and sampling read them); a missing one is named here."""
    from modules.remote.run import RemoteRun
    from modules.remote.ssh import RemoteError

    image = sorted(shape_images.glob("*.png"))[0]
    prompts = {"sampling": {"prompts": [{"prompt": "a"}, {"prompt": "b", "control_images": [str(image)]}]}}
    config = train_config(tiny_model, shape_images, tmp_path, prompts)
    run = RemoteRun(None, tmp_path / "ws", tmp_path / "out.safetensors", "/box")
    pairs, data = run._plan(config, False)
    assert data["sampling"]["prompts"][1]["control_images"] == [f"/box/data/prompts/1-0-{image.name}"]
    assert (str(image), f"data/prompts/1-0-{image.name}") in [(p, rel) for p, rel, _, _ in pairs]
    missing = train_config(tiny_model, shape_images, tmp_path, {"sampling": {"prompts": [
        {"prompt": "b", "control_images": [str(tmp_path / "gone.png")]}]}})
    with pytest.raises(RemoteError, match=r"^sampling.prompts\[0\].control_images\[0\]: .*gone.png is not a file here"):
        run._plan(missing, False)


def test_a_sync_brings_back_an_output_folder_and_companions_and_nothing_else(tmp_path):
    """The box's output folder may hold other runs' results: only this output's files come back."""
    from modules.remote.run import PULLED_FOLDERS, RemoteRun

    run = RemoteRun(None, tmp_path / "ws", tmp_path / "out" / "model", "/box", 0, lambda text: None)
    listing = {"model/unet/diffusion_pytorch_model.safetensors": [10, 1], "model/model_index.json": [2, 1],
               "model.shape.safetensors": [5, 1], "other.safetensors": [7, 1], "model-old/x.json": [1, 1],
               "model.notes.txt": [1, 1]}
    run.target = SimpleNamespace(helper_argv=lambda *argv: list(argv), run_json=lambda argv, what: {
        **{f"/box/workspace/{name}": {} for name in PULLED_FOLDERS}, "/box/output": listing})
    pulled = []

    def pull(root, relatives, local_root):
        pulled.append((root, sorted(relatives), local_root))
        for relative in relatives:
            (local_root / relative).parent.mkdir(parents=True, exist_ok=True)
            (local_root / relative).write_bytes(b"x")

    run._pull = pull
    run.requested_output = run.local_output
    assert run.sync_results() == 3
    assert pulled == [("/box/output", ["model.shape.safetensors", "model/model_index.json",
                                       "model/unet/diffusion_pytorch_model.safetensors"], tmp_path / "out")]
