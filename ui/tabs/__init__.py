"""One file per tab. Each exposes a class built as `TabClass(parent, app)` that packs itself."""

from __future__ import annotations

import customtkinter as ctk

from ui.components import Field


class Tab(ctk.CTkScrollableFrame):
    """A scrollable tab body; `field(...)` adds a bound Field and remembers it by path."""

    def __init__(self, parent, app):
        super().__init__(parent, fg_color="transparent")
        self.pack(fill="both", expand=True)
        self.app = app
        self.cfg = app.cfg
        self.fields: dict[str, Field] = {}

    def field(self, parent, path: str, label: str, kind: str = "str", **options) -> Field:
        widget = Field(parent if parent is not None else self, self.cfg, path, label, kind, **options)
        widget.pack(fill="x", pady=1)
        self.fields[path] = widget
        return widget

    def parts(self) -> list[str]:
        return list(self.cfg.data["model"]["parts"])


class PartSections:
    """Per-model-part groups of fields, rebuilt when the family (and so the part list) changes."""

    def __init__(self, tab: Tab, build):
        self.tab, self.build = tab, build
        self.frame = ctk.CTkFrame(tab, fg_color="transparent")
        self.frame.pack(fill="x")
        self.names: list[str] = []
        self.rebuild()
        tab.cfg.reload_listeners.append(self.rebuild)

    def rebuild(self) -> None:
        names = self.tab.parts()
        if names == self.names:
            return
        self.tab.cfg.unbind_prefix("model.parts.")
        for path in [p for p in self.tab.fields if p.startswith("model.parts.")]:
            del self.tab.fields[path]
        for child in self.frame.winfo_children():
            child.destroy()
        self.names = names
        for name in names:
            group = ctk.CTkFrame(self.frame)
            group.pack(fill="x", padx=8, pady=4)
            ctk.CTkLabel(group, text=name, font=ctk.CTkFont(weight="bold"), anchor="w").pack(fill="x", padx=8, pady=(4, 0))
            self.build(group, name, f"model.parts.{name}")
