"""Offload: the memory plan of the config (ui/plan_panel.py), then per part gradient
checkpointing, layer offload fraction (or auto), activation offloading, and any other per-part
field the Model and Training tabs do not show."""

from __future__ import annotations

from modules.config.train_config import ModelPartConfig
from ui.components import section
from ui.plan_panel import PlanPanel
from ui.tabs import PartSections, Tab
from ui.tabs.model import PART_FIELDS as MODEL_PART_FIELDS
from ui.tabs.training import PART_FIELDS as TRAINING_PART_FIELDS


class OffloadTab(Tab):
    def __init__(self, parent, app):
        super().__init__(parent, app)
        self.plan_panel = PlanPanel(self, app)  # where offloading and checkpointing are chosen, their effect
        self.plan_panel.pack(fill="x", padx=8, pady=(4, 8))
        section(self, "Memory, per model part")
        PartSections(self, lambda group, name, prefix: self.form(
            group, ModelPartConfig, prefix, exclude=set(MODEL_PART_FIELDS) | set(TRAINING_PART_FIELDS)))
