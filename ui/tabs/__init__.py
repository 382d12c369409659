"""One file per tab. Each exposes a class built as `TabClass(parent, app)` that packs itself.

A tab decides which groups of the config it shows and in which order; the fields themselves
come from the schema (ui/form.py)."""

from __future__ import annotations

import customtkinter as ctk

from ui.components import Field
from ui.form import build_form


class Tab(ctk.CTkScrollableFrame):
    """A scrollable tab body; `field(...)` adds a bound Field and remembers it by path (a Field
    leaves `fields` when it is destroyed)."""

    def __init__(self, parent, app):
        super().__init__(parent, fg_color="transparent")
        self.pack(fill="both", expand=True)
        self.app = app
        self.cfg = app.cfg
        self.fields: dict[str, Field] = {}

    def field(self, parent, path: str, label: str, kind: str = "str", **options) -> Field:
        widget = Field(parent if parent is not None else self, self.cfg, path, label, kind,
                       registry=self.fields, **options)
        return widget.place_in()

    def form(self, parent, model, prefix: str, names: list[str] | None = None, exclude=frozenset()) -> list[str]:
        return build_form(self, parent if parent is not None else self, model, prefix, names, exclude)

    def parts(self) -> list[str]:
        return list(self.cfg.data["model"]["parts"])


class PartSections:
    """Per-model-part groups of fields, rebuilt when the family (and so the part list) changes.
    A rebuild destroys only this section's own widgets (and so only their bindings)."""

    def __init__(self, tab: Tab, build, parent=None):
        self.tab, self.build = tab, build
        self.frame = ctk.CTkFrame(parent if parent is not None else tab, fg_color="transparent")
        self.frame.pack(fill="x")
        self.names: list[str] = []
        self.rebuild()
        tab.cfg.reload_listeners.append(self.rebuild)

    def rebuild(self) -> None:
        names = self.tab.parts()
        if names == self.names:
            return
        for child in self.frame.winfo_children():
            child.destroy()
        self.names = names
        for name in names:
            group = ctk.CTkFrame(self.frame)
            group.pack(fill="x", padx=8, pady=4)
            ctk.CTkLabel(group, text=name, font=ctk.CTkFont(weight="bold"), anchor="w").pack(fill="x", padx=8, pady=(4, 0))
            self.build(group, name, f"model.parts.{name}")
