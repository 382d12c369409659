"""Adapter: the algorithm and its own options (each algorithm's config declares them, so they
are rebuilt when another is chosen, as the optimizer's are), which layers, dropout, dtype, the
start file, and per-part rank/alpha for the algorithms that have them."""

from __future__ import annotations

import customtkinter as ctk

from modules.config.adapter_configs import ADAPTERS, AdapterConfigBase, AdapterPartConfig, adapter_config_classes
from ui.components import pack_in_place, section
from ui.tabs import PartSections, Tab
from ui.union_section import retyped

LAYERS = ["layer_preset", "layer_filter"]
SHARED = set(AdapterConfigBase.model_fields)  # every algorithm's: shown once, below its own options


class AdapterTab(Tab):
    def __init__(self, parent, app):
        super().__init__(parent, app)
        section(self, "Adapter")
        self.algorithms = adapter_config_classes()
        self.field(self, "adapter.type", "Algorithm", "choice", widget="option", values=list(self.algorithms),
                   tooltip="The adapter algorithm; each has its own options below.")
        self.cfg.set_hooks["adapter.type"] = self._algorithm_chosen
        self.algorithm_frame = ctk.CTkFrame(self, fg_color="transparent")
        self.algorithm_frame.pack(fill="x")
        self._shown = None
        section(self, "Layers")
        self.form(self, AdapterConfigBase, "adapter", LAYERS)
        section(self, "Regularisation and storage")
        self.form(self, AdapterConfigBase, "adapter", exclude={"type", *LAYERS})
        self.parts_frame = ctk.CTkFrame(self, fg_color="transparent")  # hidden for an algorithm without sizes
        self.parts_frame.pack(fill="x")
        section(self.parts_frame, "Per model part (empty: the values above)")
        PartSections(self, lambda group, name, _prefix: self.form(group, AdapterPartConfig, f"adapter.parts.{name}"),
                     parent=self.parts_frame)
        self._algorithm_fields()
        self.cfg.reload_listeners.append(self._algorithm_fields)

    def _algorithm_chosen(self, kind) -> bool:
        """Another algorithm: the options both declare alike kept, its own at their defaults."""
        current = self.cfg.data.get("adapter")
        if kind not in self.algorithms or (isinstance(current, dict) and current.get("type") == kind):
            return False
        self.cfg.data["adapter"] = retyped(ADAPTERS, current, kind)
        self.cfg.refresh()  # rebuilds the option fields (reload listener), then validates
        return True

    def _algorithm_fields(self) -> None:
        kind = self.cfg.get("adapter.type")
        if kind == self._shown or kind not in self.algorithms:
            return
        self._shown = kind
        for child in self.algorithm_frame.winfo_children():
            child.destroy()  # only this frame's fields, and so only their bindings
        config = self.algorithms[kind]
        self.form(self.algorithm_frame, config, "adapter", exclude=SHARED | {"parts"})
        if "parts" in config.model_fields and not self.parts_frame.winfo_manager():
            pack_in_place(self.parts_frame, {"fill": "x"})
        elif "parts" not in config.model_fields and self.parts_frame.winfo_manager():
            self.parts_frame.pack_forget()
