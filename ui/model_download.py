"""The labelling dialogs' *Download…* button: a hub id typed as the model is fetched only when the
user asks, after the size is shown. The first press lists the model (`launch.py download-model ID
--list`: files and bytes, nothing fetched) and turns the button into "Download 1.2 GB"; the second
fetches it (`--yes`) in a child process, with progress, and sets the model field to the folder.
Pressed while downloading, it stops (between files: the next download resumes). The window never
waits on the network: both steps are child processes read with `after`."""

from __future__ import annotations

import sys
import tkinter as tk
from collections.abc import Callable

import customtkinter as ctk

from modules.autolabel.hub_download import human_size, is_hub_id
from ui.run_client import ROOT, RunClient


class ModelDownload:
    LABEL = "Download…"

    def __init__(self, master, model_var: tk.StringVar, say: Callable[..., None], bar: ctk.CTkProgressBar):
        self.master, self.model_var, self.say, self.bar = master, model_var, say, bar
        self.button = ctk.CTkButton(master, text=self.LABEL, width=96, command=self.press)
        self.client: RunClient | None = None
        self.listed: dict | None = None  # the listing event of the id in the field, once listed
        self.events: list[dict] = []
        model_var.trace_add("write", lambda *_: self._field_changed())

    @property
    def running(self) -> bool:
        return self.client is not None and self.client.returncode is None

    def _argv(self, *flags: str) -> list[str]:
        return [sys.executable, "-u", str(ROOT / "launch.py"), "download-model", self.model_var.get().strip(),
                "--protocol", "jsonl", *flags]

    def press(self) -> None:
        if self.running:
            if self.client.stop():
                self.say("Stopping after the file being downloaded…")
            return
        repo_id = self.model_var.get().strip()
        if not is_hub_id(repo_id):
            self.say("Type a Hugging Face model id (owner/name) in the model field to download it.", error=True)
            return
        if self.listed is None or self.listed.get("repo_id") != repo_id:
            self._run(self._argv("--list"), f"Asking the hub what {repo_id} holds…")
        else:
            self._run(self._argv("--yes"), f"Downloading {repo_id}…")

    def _run(self, argv: list[str], saying: str) -> None:
        self.events = []
        self.client = RunClient(argv)
        self.client.start()
        self.say(saying)
        self.button.configure(text="Stop download" if "--yes" in argv else self.LABEL)
        self.master.after(100, self._poll)

    def _poll(self) -> None:
        if self.client is None:
            return
        for kind, payload in self.client.drain():
            if kind == "event":
                self._event(payload)
            elif kind == "exit":
                self._ended()
                return
        if self.master.winfo_exists():
            self.master.after(100, self._poll)

    def _event(self, event: dict) -> None:
        self.events.append(event)
        name = event.get("event")
        if name == "listing":
            self.listed = event
        elif name == "progress" and event.get("total"):
            self.bar.set(event["done"] / event["total"])
            self.say(f"{human_size(event['done'])} of {human_size(event['total'])}: {event.get('path', '')}")

    def _ended(self) -> None:
        errors = [e.get("message", "") for e in self.events if e.get("event") == "error"]
        finished = next((e for e in self.events if e.get("event") == "finished"), None)
        if errors:
            self.listed = None
            self.button.configure(text=self.LABEL)
            self.say(errors[-1], error=True)
        elif finished is not None:
            self.button.configure(text=self.LABEL)
            if finished.get("stopped"):
                self.say(f"Stopped; the files so far are in {finished['folder']} (Download again resumes).")
            else:
                self.bar.set(1)
                self.listed = None
                self.model_var.set(finished["folder"])
                self.say(f"Downloaded to {finished['folder']}. Press Start.")
        elif self.listed is not None:
            files = len(self.listed.get("files", []))
            size = human_size(self.listed.get("total_bytes", 0))
            self.button.configure(text=f"Download {size}")
            self.say(f"{self.listed['repo_id']}: {files} files, {size}, into {self.listed['folder']}. "
                     f"Press Download {size} to fetch them.")

    def _field_changed(self) -> None:
        if not self.running and self.listed is not None and self.listed.get("repo_id") != self.model_var.get().strip():
            self.listed = None
            self.button.configure(text=self.LABEL)

    def stop(self) -> None:
        if self.running:
            self.client.stop()
