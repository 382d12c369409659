"""Run control, a mixin of the main window (ui/app.py): Start/Stop, commands, and the run's events shown.

Training runs only as a child process (`launch.py train --protocol jsonl`, ui/run_client.py).
Its reader thread queues events; `_poll`, scheduled with `after` on the Tk main thread, is the
only code that turns them into widget updates, so no widget is ever touched from another thread.
The mixin uses the window's `cfg`, `tabs`, run bar widgets, `set_status`, `show_error`, `_refuse`,
`run_argv` and `remote_target` (ui/remote_run.py).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from modules.config.presets import user_dir
from modules.util.atomic import write_text
from ui.attached_run import AttachedRun, find_live_run
from ui.run_client import ROOT, RunClient
from ui.run_history import history, read_config, run_dirs, sample_info

REFUSED_STATUS = "Training cannot start"
# the console's status lines in the run's log (modules/cli/console.py: `[loading model]`), shown in
# the status line until the first step: loading and caching take minutes on a big data set
STAGE_LINE = re.compile(r"^\[([a-z][^\[\]]*)\]$")


def error_line(lines: list[str]) -> str | None:
    """The line that says what went wrong in a log's tail (`ValueError: ...`), the last one."""
    for line in reversed(lines):
        if re.match(r"^[\w.]*(Error|Exception|Interrupt)\b.*:", line.strip()) or line.startswith("error:"):
            return line.strip()
    return None


def format_seconds(seconds) -> str:
    if seconds is None:
        return "?"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def new_run_dir() -> Path:
    """A new folder for a run's config, events and log: <user dir>/runs/<date-time>[.N]."""
    run_dir = user_dir() / "runs" / time.strftime("%Y%m%d-%H%M%S")
    suffix = 1
    while run_dir.exists():
        run_dir = run_dir.with_name(f"{run_dir.name.split('.')[0]}.{suffix}")
        suffix += 1
    run_dir.mkdir(parents=True)
    return run_dir


class RunControl:
    @property
    def running(self) -> bool:
        return self.client is not None and self.client.running

    def start_or_stop(self) -> None:
        if self.running:
            self.stop()
        else:
            self.start()

    def start(self) -> bool:
        if self.running:
            return False
        problems = self.cfg.start_problems()
        remote = self.remote_problem()
        if remote:
            problems = problems + [remote]
        if problems:
            self._refuse(REFUSED_STATUS, problems)
            return False
        self.refused = []
        run_dir = new_run_dir()
        config_file = run_dir / "config.json"
        write_text(config_file, self.cfg.config_json() + "\n")
        self.save_last_config()
        self.run_events = []
        self.run_config = json.loads(self.cfg.config_json())
        self.total_steps = 0
        self._stop_requested = False
        run_tab = self.tabs["Run"]
        run_tab.clear()
        if self.run_config["backup"]["resume"]:  # the curve and samples of the runs this one continues
            run_tab.load_history(history(run_dir))
        target = self.remote_target()
        run_tab.append_log(f"[run folder: {run_dir}]" + (f" [remote: {target.label}]" if target else ""))
        self.client = RunClient(self.run_argv(config_file), cwd=ROOT, run_dir=run_dir, remote=target is not None)
        self.client.start()
        self.progress.set(0)
        self.epoch_progress.set(0)
        self._following("starting")
        self.set_status("Starting…")
        return True

    def _following(self, stage: str) -> None:
        """The run bar of a run being followed (started here or found again): Stop and the commands
        live, the step bar waiting for the first step, the events polled."""
        self.tabview.set("Run")
        self.start_button.configure(text="Stop", fg_color="#b23b3b", hover_color="#8e2b2b")
        for button in self.command_buttons.values():
            button.configure(state="normal")
        self._stage = (stage, time.monotonic())
        self._waiting_bar(True)
        self.after(100, self._poll)

    def _waiting_bar(self, waiting: bool) -> None:
        """Before the first step the step bar moves back and forth: the run is alive, its length unknown."""
        if waiting:
            self.progress.configure(mode="indeterminate")
            self.progress.start()
        elif self.progress.cget("mode") == "indeterminate":
            self.progress.stop()
            self.progress.configure(mode="determinate")

    def _show_stage(self) -> None:
        """The stage the run is in before its first step, with the seconds it has taken so far."""
        if self._stage is None:
            return
        text, since = self._stage
        self.set_status(f"{text[:1].upper()}{text[1:]}… {time.monotonic() - since:.0f} s")

    def _show_last_run(self) -> None:
        """On opening the window: a run an earlier window left training, followed again; else the
        newest run's curve and samples (with those it resumed)."""
        if self.reattach():
            return
        runs = run_dirs(user_dir() / "runs")
        if runs:
            self.tabs["Run"].load_history(history(runs[-1]))
            self.tabs["Run"].append_log(f"[last run: {runs[-1]}]")

    def reattach(self) -> bool:
        """Follow a run an earlier window started and left training (ui/attached_run.py): its curve,
        samples and log from the start, then live; Stop and the commands reach it through its inbox."""
        found = find_live_run(user_dir() / "runs")
        if found is None:
            return self.reattach_remote()
        run_dir, pid = found
        self.run_events, self.total_steps, self._stop_requested = [], 0, False
        self.run_config = read_config(run_dir)
        run_tab = self.tabs["Run"]
        run_tab.clear()
        if (self.run_config.get("backup") or {}).get("resume"):
            run_tab.load_history(history(run_dir, include_own=False))
        run_tab.append_log(f"[reattached to the run in {run_dir} (pid {pid}), started by an earlier window: "
                           "Stop, Sample now, Backup now and Save now reach it through its command inbox]")
        self.client = AttachedRun(run_dir, pid)  # commands go through the run's inbox (ui/attached_run.py)
        self.client.start()
        self._following("following the run an earlier window started")
        return True

    def stop(self) -> None:
        if self.running and self.client.stop():
            self._stop_requested = True
            self._stage = None  # the stop's own line stays
            self.set_status("Stopping at the next step (a backup will be written)…")
            self.start_button.configure(state="disabled")

    def tensorboard_dir(self) -> Path:
        """Where the run writes TensorBoard logs: <workspace_dir>/tensorboard (relative paths are
        relative to the trainer's folder, the child's working directory)."""
        return ROOT / str(self.cfg.get("workspace_dir") or "workspace") / "tensorboard"

    def open_tensorboard(self) -> str | None:
        folder = self.tensorboard_dir()
        if not folder.is_dir():
            self.set_status(f"No TensorBoard logs yet in {folder} (they appear once a run with tensorboard on "
                            "has trained a step).")
            return None
        url = self.tensorboard.open(folder)
        self.tensorboard_url.configure(text=url)
        self.set_status(f"TensorBoard: {url} ({folder})")
        return url

    def send_command(self, command: str, prompt: dict | None = None) -> bool:
        if self.running and self.client.send(command, prompt):
            what = f"{command} {prompt['prompt']!r}" if prompt else command
            self.tabs["Run"].append_log(f"[asked for: {what}]")
            return True
        return False

    def _poll(self) -> None:
        client = self.client
        if client is None:
            return
        ended = None
        for kind, payload in client.drain():
            if kind == "event":
                self._event(payload)
            elif kind == "log":
                self.tabs["Run"].append_log(payload)
                stage = STAGE_LINE.match(payload.strip())
                if stage and self._stage is not None:
                    self._stage = (stage.group(1), time.monotonic())
            elif kind == "exit":
                ended = payload
        if ended is None:
            self._show_stage()
            self.after(100, self._poll)
        else:
            self._ended(ended)

    def _event(self, event: dict) -> None:
        self.run_events.append(event)
        name = event.get("event")
        run_tab = self.tabs["Run"]
        if name == "started":
            self.total_steps = event.get("total_steps") or 0
            if self._stage is not None:
                self._stage = (f"starting {self.total_steps} steps", time.monotonic())
        elif name == "progress":
            if self._stage is not None:  # training: the step bar and the progress line from here on
                self._stage = None
                self._waiting_bar(False)
            step, total = event.get("step", 0), event.get("total_steps") or self.total_steps or 1
            self.progress.set(min(1.0, step / total))
            epoch, epochs = event.get("epoch") or 0, event.get("epochs") or 1  # epoch: those done
            self.epoch_progress.set(min(1.0, epoch / epochs))
            loss = event.get("loss")
            parts = [f"step {step}/{total}", f"epoch {min(epoch + 1, epochs)}/{epochs}"]
            if loss is not None:
                parts.append(f"loss {loss:.4f}")
            if event.get("it_per_s"):
                parts.append(f"{event['it_per_s']:.2f} it/s")
            parts.append(f"ETA {format_seconds(event.get('eta_s'))}")
            self.set_status("   ".join(parts))
            run_tab.add_loss(step, loss)
        elif name == "sample":  # the run's own log (stderr) says what it wrote
            run_tab.add_sample(event["path"], sample_info(event["path"], self.run_config, event))
        elif name == "memory":  # measured peaks after step 2, beside the plan
            run_tab.show_memory(event)
            self.plan_panel.show_measured(event)
        elif name in ("backup", "saved"):
            self.set_status(f"{'Backup' if name == 'backup' else 'Saved'}: {event['path']}{consumer_counts(event)}")
        elif name == "error":
            message = event.get("message", "")
            first, _, rest = message.partition("\n")
            self.show_error("Training failed", first, rest.strip())
        elif name == "finished" and not self._stop_requested:
            self.progress.set(1.0)
            self.epoch_progress.set(1.0)

    def _ended(self, returncode: int) -> None:
        self._stage = None
        self._waiting_bar(False)
        names = {e.get("event") for e in self.run_events}
        errors = [e.get("message", "") for e in self.run_events if e.get("event") == "error"]
        if returncode != 0 and not errors:
            tail = self.tabs["Run"].log_text().splitlines()[-30:]
            self.show_error("Training process ended unexpectedly", error_line(tail) or f"exit code {returncode}",
                            f"exit code {returncode}\n\n" + "\n".join(tail))
        steps = [e["step"] for e in self.run_events if e.get("event") == "progress" and "step" in e]
        where = f" at step {steps[-1]}/{self.total_steps or '?'}" if steps else ""
        if errors or returncode != 0:
            first = (errors[0].splitlines() or [""])[0] if errors else ""
            self.set_status(f"Failed{where} (exit code {returncode})" + (f": {first}" if first else "."))
        elif self._stop_requested:
            backup = any(e.get("event") == "backup" for e in self.run_events)
            self.set_status(f"Stopped{where}" + ("; a backup was written." if backup else "."))
        elif "finished" in names:
            self.set_status("Finished.")
        else:
            self.set_status(f"Ended{where} without finishing (exit code {returncode}).")
        self.start_button.configure(text="Start training", state="normal", fg_color="#2e7d32", hover_color="#1b5e20")
        for button in self.command_buttons.values():
            button.configure(state="disabled")
        if self._closing:
            self._destroy()


def consumer_counts(event: dict) -> str:
    """ " (ComfyUI 42/42, Forge 40/42)": a saved event's per-tool check, beside the file; a
    missing or malformed `consumers` field shows nothing (an older run, another writer)."""
    consumers = event.get("consumers")
    if not isinstance(consumers, dict):
        return ""
    counts = [f"{name} {result.get('applied')}/{result.get('total')}" for name, result in consumers.items()
              if isinstance(result, dict)]
    return f" ({', '.join(counts)})" if counts else ""
