"""The main window: preset bar, family and method selectors, the tabs, and the run bar.

Training runs only as a child process (`launch.py train --protocol jsonl`, ui/run_client.py).
Its reader thread queues events; `_poll`, scheduled with `after` on the Tk main thread, is the
only code that turns them into widget updates, so no widget is ever touched from another thread.
"""

from __future__ import annotations

import json
import queue
import re
import subprocess
import sys
import threading
import time
import tkinter as tk
import traceback
from pathlib import Path
from tkinter import messagebox

import customtkinter as ctk

from modules.config.errors import ConfigError
from modules.config.loading import build_config, config_overlay
from modules.config.presets import (
    user_dir,
)
from modules.model.registry import family_names, get_family_class
from modules.saving.atomic import write_text
from ui.components import ERROR_COLOR, ErrorDialog
from ui.preset_bar import PresetBar
from ui.run_client import ROOT, RunClient, local_train_argv
from ui.run_history import history, run_dirs, sample_info
from ui.tensorboard import TensorBoard
from ui.state import ConfigState, default_data
from ui.tabs.adapter import AdapterTab
from ui.tabs.backup import BackupTab
from ui.tabs.concepts import ConceptsTab
from ui.tabs.embeddings import EmbeddingsTab
from ui.tabs.general import GeneralTab
from ui.tabs.model import ModelTab
from ui.tabs.offload import OffloadTab
from ui.tabs.run import RunTab
from ui.tabs.sampling import SamplingTab
from ui.tabs.training import TrainingTab

TABS = [("General", GeneralTab), ("Model", ModelTab), ("Concepts", ConceptsTab), ("Training", TrainingTab),
        ("Adapter", AdapterTab), ("Embeddings", EmbeddingsTab), ("Offload", OffloadTab), ("Sampling", SamplingTab),
        ("Backup", BackupTab), ("Run", RunTab)]

# training method -> (adapter.type, adapter.dora)
METHOD_NAMES = {"lora": "LoRA", "loha": "LoHa", "lokr": "LoKr", "oft": "OFT"}  # display names only


def training_methods() -> dict[str, tuple[str, bool]]:
    """Menu entry -> (adapter.type, adapter.dora): each registered algorithm, and DoRA after LoRA."""
    from modules.config.adapter_configs import adapter_config_classes

    methods = {}
    for kind in adapter_config_classes():
        methods[METHOD_NAMES.get(kind, kind)] = (kind, False)
        if kind == "lora":
            methods["DoRA"] = ("lora", True)
    return methods


METHODS = training_methods()


REFUSED_STATUS = "Training cannot start"


def error_line(lines: list[str]) -> str | None:
    """The line that says what went wrong in a log's tail (`ValueError: ...`), the last one."""
    for line in reversed(lines):
        if re.match(r"^[\w.]*(Error|Exception|Interrupt)\b.*:", line.strip()) or line.startswith("error:"):
            return line.strip()
    return None


def gui_dir() -> Path:
    return user_dir() / "gui"


def format_seconds(seconds) -> str:
    if seconds is None:
        return "?"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def fetch_machine_info() -> dict:
    """`launch.py info --json` in a child process, so probing the device never blocks the window."""
    result = subprocess.run([sys.executable, str(ROOT / "launch.py"), "info", "--json"], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        raise RuntimeError(result.stderr.strip() or f"launch.py info exited with {result.returncode}")
    return json.loads(result.stdout)


class App(PresetBar, ctk.CTk):
    def __init__(self, machine_info: dict | None = None, restore: bool = True):
        self.settings = self._read_json(gui_dir() / "settings.json") or {}
        ctk.set_appearance_mode(self.settings.get("appearance", "dark"))
        ctk.set_widget_scaling(float(self.settings.get("ui_scale", 1.0)))
        super().__init__()
        self.title("difftrainer")
        self.geometry(self.settings.get("geometry", "1180x820"))
        self.minsize(900, 600)
        self.callback_errors: list[str] = []
        self.dialogs: list[ErrorDialog] = []
        self.refused: list[str] = []
        self.client: RunClient | None = None
        self.run_events: list[dict] = []
        self.run_config: dict = {}
        self.total_steps = 0
        self._stop_requested = False
        self._closing = False
        self._info_queue: queue.Queue = queue.Queue()
        self.tensorboard = TensorBoard()

        self.cfg = ConfigState(default_data())
        self.cfg.set_hooks["model.family"] = self._family_changed
        self._preset_bar()
        self._selectors()
        # the run bar is packed before the expanding tab view, so the tabs shrink, never the run bar
        self._run_bar()
        self.tabview = ctk.CTkTabview(self, anchor="nw")
        self.tabview.pack(fill="both", expand=True, padx=8, pady=(0, 4))
        self.tabs = {}
        for name, cls in TABS:
            self.tabs[name] = cls(self.tabview.add(name), self)
        self.cfg.validate_listeners.append(self._validated)
        if restore:
            last = self._read_json(gui_dir() / "last_config.json")
            if last is not None:
                self.cfg.restore(last)
        self.cfg.validate()
        self.protocol("WM_DELETE_WINDOW", self.on_close)
        if restore:
            self._show_last_run()

        if machine_info is not None:
            self.cfg.set_machine_info(machine_info)
        else:
            threading.Thread(target=self._fetch_info, name="machine-info", daemon=True).start()
            self.after(200, self._poll_info)

    # --- the bars --------------------------------------------------------------------------------

    def _selectors(self) -> None:
        bar = ctk.CTkFrame(self, fg_color="transparent")
        bar.pack(fill="x", padx=8, pady=(0, 4))
        ctk.CTkLabel(bar, text="Model family").pack(side="left", padx=(8, 4))
        self.family_labels = {get_family_class(name).label: name for name in family_names()}
        self.family_menu = ctk.CTkOptionMenu(bar, values=list(self.family_labels), command=self._family_chosen,
                                             width=180)
        self.family_menu.pack(side="left", padx=4)
        ctk.CTkLabel(bar, text="Training method").pack(side="left", padx=(16, 4))
        self.method_menu = ctk.CTkOptionMenu(bar, values=list(METHODS), command=self._method_chosen, width=110)
        self.method_menu.pack(side="left", padx=4)

    def _run_bar(self) -> None:
        """Start/Stop, the commands, step and epoch progress; below: the status and what blocks Start."""
        self.run_bar = bar = ctk.CTkFrame(self)
        bar.pack(side="bottom", fill="x", padx=8, pady=(0, 8))
        top = ctk.CTkFrame(bar, fg_color="transparent")
        top.pack(fill="x")
        self.start_button = ctk.CTkButton(top, text="Start training", width=120, command=self.start_or_stop,
                                          fg_color="#2e7d32", hover_color="#1b5e20")
        self.start_button.pack(side="left", padx=8, pady=(8, 2))
        self.command_buttons = {}
        for command, text in (("sample", "Sample now"), ("backup", "Backup now"), ("save", "Save now")):
            button = ctk.CTkButton(top, text=text, width=90, state="disabled",
                                   command=lambda c=command: self.send_command(c))
            button.pack(side="left", padx=4, pady=(8, 2))
            self.command_buttons[command] = button
        right = ctk.CTkFrame(top, fg_color="transparent")
        right.pack(side="left", fill="x", expand=True, padx=8)
        self.progress = ctk.CTkProgressBar(right, width=60)  # steps
        self.progress.set(0)
        self.progress.pack(fill="x", pady=(8, 2))
        self.epoch_progress = ctk.CTkProgressBar(right, width=60, height=4, progress_color=("#7b8794", "#7b8794"))
        self.epoch_progress.set(0)
        self.epoch_progress.pack(fill="x", pady=(0, 2))
        line = ctk.CTkFrame(bar, fg_color="transparent")
        line.pack(fill="x", padx=8, pady=(0, 4))
        self.status_label = ctk.CTkLabel(line, text="Ready.", anchor="w")
        self.status_label.pack(side="left")
        self.tensorboard_button = ctk.CTkButton(line, text="TensorBoard", width=100, command=self.open_tensorboard)
        self.tensorboard_button.pack(side="right")
        # what blocks Start, always in view (the run bar never leaves the window)
        self.problem_label = ctk.CTkLabel(line, text="", text_color=ERROR_COLOR, anchor="w", justify="left")
        self.problem_label.pack(side="left", fill="x", expand=True, padx=(12, 0))

    # --- selectors -------------------------------------------------------------------------------

    def _family_chosen(self, label: str) -> None:
        self.cfg.set("model.family", self.family_labels[label])

    def _family_changed(self, family) -> bool:
        """model.family set (the selector or the Model tab): the new family's parts, the rest kept."""
        if family == self.cfg.get("model.family") or family not in family_names():
            return False
        overlay = config_overlay(self.cfg.config) if self.cfg.config else {}
        overlay.setdefault("model", {})["family"] = family
        overlay["model"].pop("parts", None)  # parts are the family's own
        try:
            data = build_config([overlay]).model_dump(mode="json")
        except ConfigError:
            data = default_data(family)
        self.cfg.load(data)
        return True

    def field_for(self, path: str):
        """The Field bound to `path`, on whichever tab it is."""
        for name, tab in self.tabs.items():
            found = getattr(tab, "fields", {}).get(path)
            if found is not None:
                return name, found
        return None, None

    def _method_chosen(self, method: str) -> None:
        kind, dora = METHODS[method]
        self.cfg.set("adapter.type", kind)  # the Adapter tab's hook keeps the options both algorithms have
        if "dora" in (self.cfg.data.get("adapter") or {}):
            self.cfg.set("adapter.dora", dora)
        self.cfg.refresh()

    def _validated(self) -> None:
        data = self.cfg.data
        family = data.get("model", {}).get("family")
        for label, name in self.family_labels.items():
            if name == family and self.family_menu.get() != label:
                self.family_menu.set(label)
        adapter = data.get("adapter", {})
        shown = (adapter.get("type"), bool(adapter.get("dora")) and adapter.get("type") == "lora")
        method = next((name for name, value in METHODS.items() if value == shown), None)
        if method and self.method_menu.get() != method:
            self.method_menu.set(method)
        problems = self.cfg.problems
        text = ""
        if problems:
            first = problems[0] if len(problems[0]) <= 90 else problems[0][:89] + "…"
            text = f"{len(problems)} problem{'s' if len(problems) != 1 else ''}: {first}" + (" …" if len(problems) > 1 else "")
        self.problem_label.configure(text=text)
        if not problems and self.status_label.cget("text").startswith(REFUSED_STATUS):
            self.set_status("Ready: the problems are fixed.")

    # --- machine info ------------------------------------------------------------------------------

    def _fetch_info(self) -> None:
        try:
            self._info_queue.put(("ok", fetch_machine_info()))
        except Exception as error:  # reported in the window, the GUI still works
            self._info_queue.put(("error", str(error)))

    def _poll_info(self) -> None:
        try:
            kind, payload = self._info_queue.get_nowait()
        except queue.Empty:
            self.after(200, self._poll_info)
            return
        if kind == "ok":
            self.cfg.set_machine_info(payload)
        else:
            self.tabs["Run"].append_log(f"launch.py info failed: {payload}")

    # --- the run -------------------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self.client is not None and self.client.running

    def start_or_stop(self) -> None:
        if self.running:
            self.stop()
        else:
            self.start()

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
        run_dir = user_dir() / "runs" / time.strftime("%Y%m%d-%H%M%S")
        suffix = 1
        while run_dir.exists():
            run_dir = run_dir.with_name(f"{run_dir.name.split('.')[0]}.{suffix}")
            suffix += 1
        run_dir.mkdir(parents=True)
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
        self.client = RunClient(self.run_argv(config_file), cwd=ROOT, run_dir=run_dir)
        self.client.start()
        self.tabview.set("Run")
        self.start_button.configure(text="Stop", fg_color="#b23b3b", hover_color="#8e2b2b")
        for button in self.command_buttons.values():
            button.configure(state="normal")
        self.progress.set(0)
        self.epoch_progress.set(0)
        self.set_status("Starting…")
        self.after(100, self._poll)
        return True

    def _show_last_run(self) -> None:
        """On opening the window: the newest run's curve and samples (with those it resumed)."""
        runs = run_dirs(user_dir() / "runs")
        if runs:
            self.tabs["Run"].load_history(history(runs[-1]))
            self.tabs["Run"].append_log(f"[last run: {runs[-1]}]")

    def stop(self) -> None:
        if self.running and self.client.stop():
            self._stop_requested = True
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
            elif kind == "exit":
                ended = payload
        if ended is None:
            self.after(100, self._poll)
        else:
            self._ended(ended)

    def _event(self, event: dict) -> None:
        self.run_events.append(event)
        name = event.get("event")
        run_tab = self.tabs["Run"]
        if name == "started":
            self.total_steps = event.get("total_steps") or 0
            self.set_status(f"Started: {self.total_steps} steps.")
        elif name == "progress":
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
            run_tab.add_sample(event["path"], sample_info(event["path"], self.run_config))
        elif name in ("backup", "saved"):
            self.set_status(f"{'Backup' if name == 'backup' else 'Saved'}: {event['path']}")
        elif name == "error":
            message = event.get("message", "")
            first, _, rest = message.partition("\n")
            self.show_error("Training failed", first, rest.strip())
        elif name == "finished" and not self._stop_requested:
            self.progress.set(1.0)
            self.epoch_progress.set(1.0)

    def _ended(self, returncode: int) -> None:
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

    # --- messages -------------------------------------------------------------------------------------

    def set_status(self, text: str) -> None:
        self.status_label.configure(text=text)

    def show_error(self, title: str, message: str, details: str = "") -> ErrorDialog:
        """A dialog that leads with the error line (`message`), then the details (a traceback, a log)."""
        dialog = ErrorDialog(self, title, message, details)
        self.dialogs.append(dialog)
        return dialog

    def _refuse(self, title: str, problems: list[str]) -> None:
        self.refused = list(problems)
        count = f"{len(problems)} problem{'s' if len(problems) != 1 else ''}"
        self.show_error(title, problems[0], f"{count} to fix first:\n\n" + "\n".join(f"• {p}" for p in problems))
        self.set_status(f"{title}: {len(problems)} problem{'s' if len(problems) != 1 else ''}.")

    def report_callback_exception(self, exc, value, tb) -> None:
        text = "".join(traceback.format_exception(exc, value, tb))
        self.callback_errors.append(text)
        print(text, file=sys.stderr)
        try:
            self.show_error("Internal error", "".join(traceback.format_exception_only(exc, value)).strip(), text)
        except tk.TclError:
            pass

    # --- settings, last config, closing ----------------------------------------------------------------

    @staticmethod
    def _read_json(path: Path):
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None

    def set_ui_scale(self, text: str) -> None:
        scale = int(text.rstrip("%")) / 100
        ctk.set_widget_scaling(scale)
        self.settings["ui_scale"] = scale
        self.save_settings()

    def save_settings(self) -> None:
        write_text(gui_dir() / "settings.json", json.dumps(self.settings, indent=2) + "\n")

    def save_last_config(self) -> Path:
        """The config as it stands, valid or not (invalid values come back marked)."""
        path = gui_dir() / "last_config.json"
        write_text(path, json.dumps(self.cfg.data, indent=2) + "\n")
        return path

    def ask_close(self) -> str | None:
        """'stop', 'leave' or None (cancel) for a close during a run."""
        answer = messagebox.askyesnocancel(
            "Training is running",
            "Stop training before closing?\n\nYes: stop it now (a backup is written), then close.\n"
            "No: leave it running in the background and close the window.\nCancel: keep the window open.",
            parent=self)
        return None if answer is None else ("stop" if answer else "leave")

    def on_close(self) -> None:
        if self.running:
            choice = self.ask_close()
            if choice is None:
                return
            if choice == "stop":
                self._closing = True
                self.stop()
                return  # _ended closes the window once the run has written its backup
            self.client.detach()
            log = self.client.log_path
            print(f"difftrainer: training left running (pid {self.client.process.pid}); its log: {log}", file=sys.stderr)
        self._destroy()

    def _destroy(self) -> None:
        self.tensorboard.stop()
        self.save_last_config()
        try:
            self.settings["geometry"] = self.geometry()
            self.save_settings()
        except tk.TclError:
            pass
        self.destroy()


def main() -> int:
    app = App()
    app.mainloop()
    return 0
