"""General: workspace, cache, devices, seed, the top-level settings no other tab shows, the UI
scale and the remote box (GUI settings, not part of the config)."""

from __future__ import annotations

import customtkinter as ctk

from modules.config.train_config import TrainConfig
from ui.components import section
from ui.tabs import Tab

UI_SCALES = ["80%", "90%", "100%", "110%", "125%", "150%"]

# top-level fields other tabs place (or that are not user settings: version)
PLACED_ELSEWHERE = {"version", "model", "method", "adapter", "optimizer", "lr_scheduler", "ema", "loss", "concepts",
                    "embeddings", "sampling", "schedule", "data", "output", "backup"}
WORKSPACE = ["workspace_dir", "cache_dir"]
DEVICES = ["train_device", "temp_device", "train_dtype", "tf32", "compile", "distributed"]


class GeneralTab(Tab):
    def __init__(self, parent, app):
        super().__init__(parent, app)
        section(self, "Workspace")
        self.form(self, TrainConfig, "", WORKSPACE)
        section(self, "Devices")
        self.form(self, TrainConfig, "", DEVICES)
        section(self, "Run")
        # every other top-level field, new ones included
        self.form(self, TrainConfig, "", exclude=PLACED_ELSEWHERE | set(WORKSPACE) | set(DEVICES))
        section(self, "Window")
        row = ctk.CTkFrame(self, fg_color="transparent")
        row.pack(fill="x", pady=1)
        ctk.CTkLabel(row, text="UI scale", width=200, anchor="w").pack(side="left", padx=(8, 4))
        self.ui_scale = ctk.CTkOptionMenu(row, values=UI_SCALES, command=app.set_ui_scale, width=120)
        self.ui_scale.set(f"{round(app.settings.get('ui_scale', 1.0) * 100)}%")
        self.ui_scale.pack(side="left", padx=4)
        self._remote_section(app)
    def _remote_section(self, app) -> None:
        """Where the run goes: empty host = this machine. Kept in the GUI's settings, never in a
        config or preset (hosts and key files are not for sharing)."""
        import tkinter as tk

        from ui.components import ERROR_COLOR

        section(self, "Remote training over ssh (empty host: train on this machine)")
        saved = app.settings.get("remote", {})
        self.remote_vars = {}
        for key, label, width in (("host", "Host (user@box)", 320), ("port", "Port (empty: ssh's)", 120),
                                  ("remote_dir", "Folder on the box", 320), ("identity_file", "Key file (empty: ssh's)", 320),
                                  ("known_hosts", "Known hosts (empty: ssh's)", 320),
                                  ("python", "Python on the box", 320)):
            row = ctk.CTkFrame(self, fg_color="transparent")
            row.pack(fill="x", pady=1)
            ctk.CTkLabel(row, text=label, width=200, anchor="w").grid(row=0, column=0, sticky="w", padx=(8, 4))
            var = tk.StringVar(self, value=str(saved.get(key) or {"remote_dir": "difftrainer-remote",
                                                                  "python": "python3"}.get(key, "")))
            ctk.CTkEntry(row, textvariable=var, width=width).grid(row=0, column=1, sticky="w", padx=4, pady=2)
            var.trace_add("write", lambda *_: self._remote_changed())
            self.remote_vars[key] = var
        self.remote_error = ctk.CTkLabel(self, text="", text_color=ERROR_COLOR, anchor="w")
        self.remote_error.pack(fill="x", padx=212)
        self._remote_changed()

    def remote_settings(self) -> dict:
        return {key: var.get().strip() for key, var in self.remote_vars.items()}

    def _remote_changed(self) -> None:
        self.app.settings["remote"] = self.remote_settings()
        problem = self.app.remote_problem()
        self.remote_error.configure(text=problem or "")

