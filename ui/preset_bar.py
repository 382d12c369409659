"""The preset bar: built-in and user presets (load, save as, reset) and config import/export.

A mixin of the main window (ui/app.py): it uses the window's `cfg` (ConfigState), `set_status`,
`show_error` and `_refuse`.
"""

from __future__ import annotations

import tkinter as tk
from pathlib import Path
from tkinter import filedialog

import customtkinter as ctk

from modules.config.errors import ConfigError
from modules.config.loading import build_config, read_json_file
from modules.config.presets import list_presets, load_preset_overlay, save_preset
from modules.util.atomic import write_text
from ui.state import default_data


class PresetBar:
    def _preset_bar(self) -> None:
        bar = ctk.CTkFrame(self)
        bar.pack(fill="x", padx=8, pady=(8, 4))
        ctk.CTkLabel(bar, text="Preset").pack(side="left", padx=(8, 4))
        self.preset_var = tk.StringVar(self)
        self.preset_menu = ctk.CTkOptionMenu(bar, variable=self.preset_var, values=["-"], width=160)
        self.preset_menu.pack(side="left", padx=4, pady=6)
        self.load_button = ctk.CTkButton(bar, text="Load", width=70, command=self.load_selected_preset)
        self.load_button.pack(side="left", padx=4)
        self.save_as_button = ctk.CTkButton(bar, text="Save as…", width=80, command=self.save_preset_as)
        self.save_as_button.pack(side="left", padx=4)
        self.reset_button = ctk.CTkButton(bar, text="Reset", width=70, command=self.reset_defaults)
        self.reset_button.pack(side="left", padx=4)
        # one menu for import and export, so the bar fits 900 px at 150% scale
        self.file_menu = ctk.CTkOptionMenu(bar, values=["Import…", "Export…"], width=110,
                                           command=self._file_chosen)
        self.file_menu.set("Config file")
        self.file_menu.pack(side="left", padx=(12, 4))
        self.refresh_presets()

    def _file_chosen(self, choice: str) -> None:
        self.file_menu.set("Config file")
        (self.import_config if choice.startswith("Import") else self.export_config)()

    # --- presets and files -----------------------------------------------------------------------

    def refresh_presets(self) -> None:
        names = []
        for preset in list_presets():
            if preset.name not in names:
                names.append(preset.name)
        self.preset_menu.configure(values=names or ["-"])
        if self.preset_var.get() not in names and names:
            self.preset_var.set(names[0])

    def load_preset(self, name: str) -> None:
        """Defaults, then the preset: exactly what `launch.py train --preset NAME` starts from, except
        that the base model and the concepts stay as they are unless the preset sets them (a
        preset is a recipe; the model and the images are the user's)."""
        try:
            overlay = load_preset_overlay(name)
            data = build_config([overlay]).model_dump(mode="json")
        except ConfigError as error:
            self.show_error(f"Cannot load preset {name!r}", str(error))
            return
        kept = []
        if not (overlay.get("model") or {}).get("base") and self.cfg.get("model.base"):
            data["model"]["base"] = self.cfg.get("model.base")
            kept.append("base model")
        if "concepts" not in overlay and self.cfg.get("concepts"):
            data["concepts"] = self.cfg.get("concepts")
            kept.append("concepts")
        self.cfg.load(data)
        self.set_status(f"Loaded preset {name!r}" + (f" (kept your {' and '.join(kept)})." if kept else "."))

    def load_selected_preset(self) -> None:
        self.load_preset(self.preset_var.get())

    def save_preset_as(self, name: str | None = None) -> Path | None:
        if self.cfg.config is None:
            self._refuse("Cannot save the preset", self.cfg.problems)
            return None
        if name is None:
            name = ctk.CTkInputDialog(text="Name of the new preset:", title="Save preset").get_input()
            if not name:
                return None
        try:
            path = save_preset(self.cfg.config, name.strip())
        except ConfigError as error:
            self.show_error("Cannot save the preset", str(error))
            return None
        self.refresh_presets()
        self.preset_var.set(name.strip())
        self.set_status(f"Saved preset {name.strip()!r} to {path}.")
        return path

    def reset_defaults(self) -> None:
        self.cfg.load(default_data(self.cfg.get("model.family") or "sd15"))
        self.set_status("Reset to the defaults.")

    def import_config(self, path: str | None = None) -> None:
        path = path or filedialog.askopenfilename(parent=self, filetypes=[("config", "*.json"), ("all files", "*")])
        if not path:
            return
        try:
            data = build_config([read_json_file(path)]).model_dump(mode="json")
        except ConfigError as error:
            self.show_error("Cannot import the config", str(error))
            return
        self.cfg.load(data)
        self.set_status(f"Imported {path}.")

    def export_config(self, path: str | None = None) -> None:
        if self.cfg.config is None:
            self._refuse("Cannot export the config", self.cfg.problems)
            return
        path = path or filedialog.asksaveasfilename(parent=self, defaultextension=".json",
                                                    filetypes=[("config", "*.json")])
        if not path:
            return
        write_text(Path(path), self.cfg.config_json() + "\n")
        self.set_status(f"Exported the config to {path}.")
