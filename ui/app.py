"""The main window: preset bar, family and method selectors, the tabs, the run bar, and messages.

What the window does is split by idea into mixins: ui/preset_bar.py (presets, import/export),
ui/run_control.py (Start/Stop, commands, the run's events), ui/remote_run.py (training over ssh),
ui/window_persistence.py (settings, the last config, closing).
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import tkinter as tk
import traceback

import customtkinter as ctk

from modules.config.errors import ConfigError
from modules.config.loading import build_config, config_overlay
from modules.config.families import family_names, get_family_declaration
from ui.components import ERROR_COLOR, ErrorDialog
from ui.preset_bar import PresetBar
from ui.remote_run import RemoteRun
from ui.run_client import ROOT, RunClient
from ui.run_control import REFUSED_STATUS, RunControl
from ui.tensorboard import TensorBoard
from ui.state import ConfigState, default_data
from ui.lazy_tabs import LazyTabview
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
from ui.window_persistence import WindowPersistence, gui_dir

TABS = [("General", GeneralTab), ("Model", ModelTab), ("Concepts", ConceptsTab), ("Training", TrainingTab),
        ("Adapter", AdapterTab), ("Embeddings", EmbeddingsTab), ("Offload", OffloadTab), ("Sampling", SamplingTab),
        ("Backup", BackupTab), ("Run", RunTab)]

# training method -> (adapter.type, adapter.dora)
def training_methods() -> dict[str, tuple[str, bool]]:
    """Menu entry -> (adapter.type, adapter.dora): each registered algorithm under the label it
    declares, followed by its DoRA entry where it declares one. Asked when the window is built."""
    from modules.config.adapter_configs import ADAPTERS

    methods = {}
    for kind, member in ADAPTERS.members().items():
        methods[member.traits.label or kind] = (kind, False)
        if member.traits.dora_label:
            methods[member.traits.dora_label] = (kind, True)
    return methods


def family_menu_text(name: str) -> str:
    label = get_family_declaration(name).label
    return label if label == name else f"{label} ({name})"


def fetch_machine_info() -> dict:
    """`launch.py info --json` in a child process, so probing the device never blocks the window."""
    result = subprocess.run([sys.executable, str(ROOT / "launch.py"), "info", "--json"], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        raise RuntimeError(result.stderr.strip() or f"launch.py info exited with {result.returncode}")
    return json.loads(result.stdout)


class App(PresetBar, RunControl, RemoteRun, WindowPersistence, ctk.CTk):
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
        self._stage: tuple[str, float] | None = None  # before a run's first step: (stage, since)
        self._closing = False
        self._info_queue: queue.Queue = queue.Queue()
        self.tensorboard = TensorBoard()

        self.cfg = ConfigState(default_data())
        self.cfg.set_hooks["model.family"] = self._family_changed
        self._preset_bar()
        self._selectors()
        # the run bar is packed before the expanding tab view, so the tabs shrink, never the run bar
        self._run_bar()
        self.tabview = LazyTabview(self, anchor="nw")
        self.tabview.pack(fill="both", expand=True, padx=8, pady=(0, 4))
        # each tab is built when first shown or used (ui/lazy_tabs.py), so the window appears at once
        self.tabs = {name: self.tabview.add_lazy(name, lambda frame, cls=cls: cls(frame, self)) for name, cls in TABS}
        self.tabview.set(TABS[0][0])
        self.cfg.validate_listeners.append(self._validated)
        if restore:
            last = self._read_json(gui_dir() / "last_config.json")
            if last is not None:
                self.cfg.restore(last)
                self.show_loaded_preset(self.settings.get("preset"))
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
        # the family's name with the config's name for it (model.family on the Model tab): one family, one name
        self.family_labels = {family_menu_text(name): name for name in family_names()}
        self.family_menu = ctk.CTkOptionMenu(bar, values=list(self.family_labels), command=self._family_chosen,
                                             width=220)
        self.family_menu.pack(side="left", padx=4)
        # the adapter algorithm (adapter.type and dora); what trains is the Training tab's Method
        ctk.CTkLabel(bar, text="Adapter").pack(side="left", padx=(16, 4))
        self.method_menu = ctk.CTkOptionMenu(bar, values=list(training_methods()), command=self._method_chosen, width=110)
        self.method_menu.pack(side="left", padx=4)
        self.method_note = ctk.CTkLabel(bar, text="", anchor="w")
        self.method_note.pack(side="left", padx=4)

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
        # packed first, so a long status is cut, never the button; the URL has its own label, so the
        # next progress line does not overwrite it
        self.tensorboard_button = ctk.CTkButton(line, text="TensorBoard", width=100, command=self.open_tensorboard)
        self.tensorboard_button.pack(side="right")
        self.tensorboard_url = ctk.CTkLabel(line, text="", anchor="e", text_color=("#1f6aa5", "#6cb4ee"))
        self.tensorboard_url.pack(side="right", padx=(8, 8))
        self.status_label = ctk.CTkLabel(line, text="Ready.", anchor="w")
        self.status_label.pack(side="left")
        # what blocks Start, always in view (the run bar never leaves the window)
        self.problem_label = ctk.CTkLabel(line, text="", text_color=ERROR_COLOR, anchor="w", justify="left")
        self.problem_label.pack(side="left", fill="x", expand=True, padx=(12, 0))

    # --- selectors -------------------------------------------------------------------------------

    def _family_chosen(self, label: str) -> None:
        """The menu's text (or the family's label or name) -> model.family."""
        by_label = {get_family_declaration(name).label: name for name in family_names()}
        self.cfg.set("model.family", self.family_labels.get(label) or by_label.get(label) or label)

    def _family_changed(self, family) -> bool:
        """model.family set (the selector or the Model tab): the new family's parts, the rest kept."""
        if family == self.cfg.get("model.family") or family not in family_names():
            return False
        overlay = config_overlay(self.cfg.config) if self.cfg.config else {}
        overlay.setdefault("model", {})["family"] = family
        # parts are the family's own; their weights "auto": planned for this machine's memory, not
        # float32 (48 GB for FLUX.1) until the user or a preset says otherwise
        overlay["model"]["parts"] = {part: {**defaults, "weight_dtype": "auto"}
                                     for part, defaults in get_family_declaration(family).default_parts().items()}
        try:
            data = build_config([overlay]).model_dump(mode="json")
        except ConfigError:
            data = default_data(family)
        self.cfg.load(data)
        return True

    @property
    def plan_panel(self):
        """The memory plan before Start (ui/plan_panel.py), on the Offload tab (built on first use)."""
        return self.tabs["Offload"].plan_panel

    def field_for(self, path: str):
        """The Field bound to `path`, on whichever tab it is."""
        for name, tab in self.tabs.items():
            found = getattr(tab, "fields", {}).get(path)
            if found is not None:
                return name, found
        return None, None

    def _method_chosen(self, method: str) -> None:
        kind, dora = training_methods()[method]
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
        method = next((name for name, value in training_methods().items() if value == shown), None)
        if method and self.method_menu.get() != method:
            self.method_menu.set(method)
        trains = (data.get("method") or {}).get("type")
        uses_adapter = trains in (None, "adapter")
        self.method_menu.configure(state="normal" if uses_adapter else "disabled")
        self.method_note.configure(text="" if uses_adapter else f"(not used: the method is {trains})")
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


def main() -> int:
    app = App()
    if os.environ.get("DIFFTRAINER_REPORT_READY"):  # tests/test_gui_startup.py times the start-up by it
        app.after_idle(lambda: print("ready", flush=True))
    app.mainloop()
    return 0
