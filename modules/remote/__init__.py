"""Training on another machine over ssh (the system's ssh client; see run.py for the layout).

For the GUI and scripts:
  SshTarget(host, port=None, remote_dir="difftrainer-remote", identity_file=None, known_hosts=None, python="python3")
  remote_run_argv(target, config_path, *, attach=False, resume=False, workspace=None, overrides=(), retries=3)
      -> argv of a child process that speaks the run protocol (jsonl) exactly like a local
         `launch.py train --protocol jsonl`, with event paths local and the files already here.
  RemoteRun.start(target, config, resume=False) / RemoteRun.from_session(workspace) -> RemoteRun
      .events() yields event dicts (raises ConnectionLost on a drop; call it again to reconnect),
      .send_command(name), .stop(), .detach(), .sync_results(), .returncode
"""

from modules.remote.run import ConnectionLost, RemoteRun, remote_run_argv
from modules.remote.ssh import RemoteError, SshTarget

__all__ = ["ConnectionLost", "RemoteError", "RemoteRun", "SshTarget", "remote_run_argv"]
