"""The preset bar: built-in and user presets (load, save as, reset) and config import/export.

A mixin of the main window (ui/app.py): it uses the window's `cfg` (ConfigState), `set_status`,
`show_error` and `_refuse`.
"""

from __future__ import annotations

import tkinter as tk
from pathlib import Path
from tkinter import filedialog, messagebox

import customtkinter as ctk

from modules.config.errors import ConfigError
from modules.config.loading import build_config, read_json_file
from modules.config.presets import list_presets, load_preset_overlay, save_preset
from modules.util.atomic import write_text
from ui.components import centre_over
from ui.state import default_data

NO_PRESET = "(no preset)"  # shown until a preset is loaded or saved: the box names what is loaded, never a guess


class PresetBar:
    def _preset_bar(self) -> None:
        bar = ctk.CTkFrame(self)
        bar.pack(fill="x", padx=8, pady=(8, 4))
        ctk.CTkLabel(bar, text="Preset").pack(side="left", padx=(8, 4))
        self.preset_var = tk.StringVar(self, value=NO_PRESET)
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
        self.preset_menu.configure(values=names or [NO_PRESET])
        if self.preset_var.get() not in names:
            self.preset_var.set(NO_PRESET)

    def show_loaded_preset(self, name: str | None) -> None:
        """The preset box names the preset the config came from (kept in the settings for the next
        start), or says there is none."""
        self.settings["preset"] = name
        self.preset_var.set(name if name in self.preset_menu.cget("values") else NO_PRESET)

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
        self.show_loaded_preset(name)
        self.set_status(f"Loaded preset {name!r}" + (f" (kept your {' and '.join(kept)})." if kept else "."))

    def load_selected_preset(self) -> None:
        if self.preset_var.get() == NO_PRESET:
            self.set_status("Choose a preset in the box first, then Load.")
            return
        self.load_preset(self.preset_var.get())

    def ask_preset_name(self) -> str | None:
        """The name for "Save as…", asked in a dialog over the window (not at the screen's edge)."""
        dialog = ctk.CTkInputDialog(text="Name of the new preset:", title="Save preset")
        # its widgets are made 10 ms after it opens: centred once they give it its size
        dialog.after(30, lambda: dialog.winfo_exists() and centre_over(dialog, self))
        self.name_dialog = dialog
        return dialog.get_input()

    def save_preset_as(self, name: str | None = None) -> Path | None:
        if self.cfg.config is None:
            self._refuse("Cannot save the preset", self.cfg.problems)
            return None
        if name is None:
            name = self.ask_preset_name()
            if not name or not name.strip():
                return None
        try:
            path = save_preset(self.cfg.config, name.strip())
        except ConfigError as error:
            self.show_error("Cannot save the preset", str(error))
            return None
        self.refresh_presets()
        self.show_loaded_preset(name.strip())
        self.set_status(f"Saved preset {name.strip()!r} to {path}.")
        return path

    def reset_defaults(self) -> bool:
        """Every setting back to the family's defaults, after asking when that would clear the
        user's own base model, concepts or prompts."""
        lost = []
        if self.cfg.get("model.base"):
            lost.append("the base model")
        for key, what in ((("concepts",), "concept"), (("sampling", "prompts"), "prompt")):
            node = self.cfg.data
            for step in key:
                node = (node or {}).get(step) if isinstance(node, dict) else None
            if node:
                lost.append(f"{len(node)} {what}{'s' if len(node) != 1 else ''}")
        if lost and not self.ask_reset(lost):
            self.set_status("Reset cancelled.")
            return False
        self.cfg.load(default_data(self.cfg.get("model.family") or "sd15"))
        self.show_loaded_preset(None)
        self.set_status("Reset to the defaults.")
        return True

    def ask_reset(self, lost: list[str]) -> bool:
        what = ", ".join(lost[:-1]) + (" and " if len(lost) > 1 else "") + lost[-1]
        return messagebox.askyesno("Reset to the defaults?",
                                   f"Every setting goes back to its default; this also clears {what}.",
                                   parent=self)

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
        self.show_loaded_preset(None)
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
