"""Window persistence, a mixin of the main window (ui/app.py): settings.json, last_config.json, closing."""

from __future__ import annotations

import json
import sys
import tkinter as tk
from pathlib import Path
from tkinter import messagebox

import customtkinter as ctk

from modules.config.presets import user_dir
from modules.util.atomic import write_text


def gui_dir() -> Path:
    return user_dir() / "gui"


class WindowPersistence:
    @staticmethod
    def _read_json(path: Path):
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None

    def set_ui_scale(self, text: str) -> None:
        """Every widget at the new scale; the window stays where it is (CTk re-sets the window's size
        without its position, which some window managers answer by moving it to the corner)."""
        scale = int(text.rstrip("%")) / 100
        position = "+" + self.geometry().split("+", 1)[1] if "+" in self.geometry() else None
        ctk.set_widget_scaling(scale)
        if position:
            self.after_idle(lambda: self.winfo_exists() and self.geometry(position))
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
            print(f"difftrainer: training left running (pid {self.client.pid}); its log: {log}", file=sys.stderr)
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
