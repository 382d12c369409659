"""The dataset tool's "Auto-caption…" and "Generate masks…" dialogs: a model folder and the run's
options, then `launch.py caption` or `launch.py mask` as a child process (ui/run_client.py, the
run protocol's JSONL events and its `stop` command), so the window never waits on a model.

The dialog shows the child's progress, stops it on request (the files written so far stay whole:
modules/autolabel writes each atomically) and, when it ends, tells the dataset tool to read the
folder's captions and masks again. Closing the dialog while it runs stops the run."""

from __future__ import annotations

import sys
import tkinter as tk
from dataclasses import dataclass
from pathlib import Path
from tkinter import filedialog
from typing import Callable

import customtkinter as ctk

from ui.components import ERROR_COLOR, centre_over
from ui.model_download import ModelDownload
from ui.run_client import ROOT, RunClient


@dataclass(frozen=True)
class Option:
    flag: str  # the command's option, e.g. "--mode"
    label: str
    default: str = ""
    choices: tuple[str, ...] = ()  # an option menu; else an entry
    hint: str = ""  # the entry's placeholder


@dataclass(frozen=True)
class LabelJob:
    command: str  # launch.py's subcommand
    title: str
    written: str  # what it writes, for the summary line ("captions")
    options: tuple[Option, ...]


CAPTION = LabelJob("caption", "Auto-caption", "captions", (
    Option("--prompt", "Prompt", hint="none for BLIP; chat models: 'Describe this image in one sentence.'"),
    Option("--mode", "Existing captions", "skip-existing", ("skip-existing", "overwrite", "append")),
    Option("--batch-size", "Batch size", "4"),
    Option("--max-new-tokens", "Max new tokens", "60"),
    Option("--device", "Device", "auto"),
))

MASKS = LabelJob("mask", "Generate masks", "masks", (
    Option("--prompt", "What to train on", hint="CLIPSeg: e.g. a person; background removal: none"),
    Option("--threshold", "Threshold", "0.4"),
    Option("--expand", "Grow by (px)", "0"),
    Option("--mode", "Existing masks", "overwrite", ("overwrite", "add", "skip-existing")),
    Option("--batch-size", "Batch size", "4"),
    Option("--device", "Device", "auto"),
))

_last_models: dict[str, str] = {}  # the model folder each job used last, for the next dialog


class LabelDialog(ctk.CTkToplevel):
    def __init__(self, master, job: LabelJob, folder: Path, include_subfolders: bool = False,
                 on_done: Callable[[], None] = lambda: None):
        super().__init__(master)
        self.job, self.folder, self.include_subfolders, self.on_done = job, Path(folder), include_subfolders, on_done
        self.title(f"{job.title}: {self.folder.name}")
        centre_over(self, master, 620, 400)
        self.client: RunClient | None = None
        self.events: list[dict] = []
        self.log: list[str] = []

        form = ctk.CTkFrame(self, fg_color="transparent")
        form.pack(fill="x", padx=12, pady=(12, 4))
        form.grid_columnconfigure(1, weight=1)
        self.model_var = tk.StringVar(self, value=_last_models.get(job.command, ""))
        ctk.CTkLabel(form, text="Model", anchor="w").grid(row=0, column=0, sticky="w", padx=(0, 8), pady=3)
        ctk.CTkEntry(form, textvariable=self.model_var, placeholder_text="a folder, or a hub id: owner/name").grid(
            row=0, column=1, sticky="ew", pady=3)
        ctk.CTkButton(form, text="…", width=32, command=self._browse).grid(row=0, column=2, padx=(4, 0), pady=3)
        self.vars: dict[str, tk.StringVar] = {}
        for row, option in enumerate(job.options, start=1):
            ctk.CTkLabel(form, text=option.label, anchor="w").grid(row=row, column=0, sticky="w", padx=(0, 8), pady=3)
            var = self.vars[option.flag] = tk.StringVar(self, value=option.default)
            if option.choices:
                widget = ctk.CTkOptionMenu(form, variable=var, values=list(option.choices))
            else:
                widget = ctk.CTkEntry(form, textvariable=var, placeholder_text=option.hint or None)
            widget.grid(row=row, column=1, columnspan=3, sticky="ew", pady=3)

        self.bar = ctk.CTkProgressBar(self)
        self.bar.set(0)
        self.bar.pack(fill="x", padx=12, pady=(8, 2))
        self.status = ctk.CTkLabel(self, text="", anchor="w", justify="left", wraplength=520)
        self.status.pack(fill="x", padx=12)
        # a hub id in the model field is fetched only when asked, its size shown first (ui/model_download.py)
        self.download = ModelDownload(form, self.model_var, self._say, self.bar)
        self.download.button.grid(row=0, column=3, padx=(4, 0), pady=3)
        buttons = ctk.CTkFrame(self, fg_color="transparent")
        buttons.pack(side="bottom", fill="x", padx=12, pady=(4, 12))
        self.start_button = ctk.CTkButton(buttons, text="Start", width=100, command=self.start)
        self.start_button.pack(side="left")
        self.stop_button = ctk.CTkButton(buttons, text="Stop", width=100, command=self.stop, state="disabled")
        self.stop_button.pack(side="left", padx=6)
        ctk.CTkButton(buttons, text="Close", width=100, command=self.destroy).pack(side="right")
        self.bind("<Escape>", lambda _event: self.destroy())

    def _browse(self) -> None:
        chosen = filedialog.askdirectory(parent=self, initialdir=self.model_var.get() or None,
                                         title="A transformers model folder")
        if chosen:
            self.model_var.set(chosen)

    # --- the child process ------------------------------------------------------------------

    def argv(self) -> list[str]:
        argv = [sys.executable, "-u", str(ROOT / "launch.py"), self.job.command, "--folder", str(self.folder),
                "--model", self.model_var.get().strip(), "--protocol", "jsonl"]
        for flag, var in self.vars.items():
            if var.get().strip():
                argv += [flag, var.get().strip()]
        return argv + (["--include-subfolders"] if self.include_subfolders else [])

    @property
    def running(self) -> bool:
        return self.client is not None and self.client.returncode is None

    def start(self) -> None:
        if self.running:
            return
        if not self.model_var.get().strip():
            self._say("Choose the model folder first.", error=True)
            return
        if self.download.running:
            self._say("The model is still downloading.", error=True)
            return
        _last_models[self.job.command] = self.model_var.get().strip()
        self.events, self.log = [], []
        self.client = RunClient(self.argv())
        self.client.start()
        self.bar.set(0)
        self._say("Starting: loading the model…")
        self.start_button.configure(state="disabled")
        self.stop_button.configure(state="normal")
        self.after(100, self._poll)

    def stop(self) -> None:
        if self.running and self.client.stop():
            self.stop_button.configure(state="disabled")
            self._say("Stopping after the batch being labelled…")

    def _poll(self) -> None:
        if self.client is None:
            return
        for kind, payload in self.client.drain():
            if kind == "event":
                self._event(payload)
            elif kind == "log":
                self.log.append(str(payload))
            elif kind == "exit":
                self._ended(payload)
                return
        if self.winfo_exists():
            self.after(100, self._poll)

    def _event(self, event: dict) -> None:
        self.events.append(event)
        name = event.get("event")
        if name == "started":
            self._say(f"{event.get('total', 0)} images; loading the {event.get('model', '')} model…")
        elif name == "loaded":
            self._say(f"Model loaded on {event.get('device')} ({event.get('dtype')}).")
        elif name == "progress" and event.get("total"):
            self.bar.set(event["done"] / event["total"])
            self._say(f"{event['done']} of {event['total']}: {Path(event.get('path', '')).name}")

    def _ended(self, returncode: int | None) -> None:
        self.start_button.configure(state="normal")
        self.stop_button.configure(state="disabled")
        errors = [e.get("message", "") for e in self.events if e.get("event") == "error"]
        finished = next((e for e in self.events if e.get("event") == "finished"), None)
        warnings = [e.get("message", "") for e in self.events if e.get("event") == "warning"]
        if finished is not None:
            stopped = f", stopped after {finished['written'] + finished['skipped'] + finished['failed']} of " \
                      f"{finished['total']} images" if finished.get("stopped") else ""
            more = f"\n{len(warnings)} warnings; the first: {warnings[0]}" if warnings else ""
            self._say(f"{finished['written']} {self.job.written} written, {finished['skipped']} kept, "
                      f"{finished['failed']} failed{stopped}.{more}")
        elif errors:
            self._say(errors[-1], error=True)
        else:
            self._say(f"The {self.job.command} process ended with code {returncode}: "
                      + (self.log[-1] if self.log else "no output"), error=True)
        self.on_done()

    def _say(self, text: str, error: bool = False) -> None:
        if self.status.winfo_exists():
            self.status.configure(text=text, text_color=ERROR_COLOR if error else ("gray10", "gray90"))

    def destroy(self):
        self.download.stop()  # a download stops between files; the next one resumes
        if self.running:  # the run must not outlive the dialog that shows it: stopped, then read again
            client, on_done, master = self.client, self.on_done, self._root()
            client.stop()

            def when_ended() -> None:
                if client.returncode is None:
                    master.after(200, when_ended)
                else:
                    on_done()

            master.after(200, when_ended)
        super().destroy()
