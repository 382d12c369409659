"""Offload: per part gradient checkpointing, layer offload fraction (or auto), activation offloading."""

from __future__ import annotations

from ui.components import section
from ui.tabs import PartSections, Tab

FRACTIONS = ["0.0", "0.25", "0.5", "0.75", "1.0", "auto"]


class OffloadTab(Tab):
    def __init__(self, parent, app):
        super().__init__(parent, app)
        section(self, "Memory, per model part")
        PartSections(self, self._part)

    def _part(self, group, name: str, prefix: str) -> None:
        self.field(group, f"{prefix}.gradient_checkpointing", "Gradient checkpointing", "bool", widget="switch")
        self.field(group, f"{prefix}.offload_fraction", "Offload fraction (0..1 or auto)", "fraction", widget="combo",
                   values=FRACTIONS)
        self.field(group, f"{prefix}.activation_offloading", "Activation offloading", "bool", widget="switch")
