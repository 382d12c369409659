"""Offload: per part gradient checkpointing, layer offload fraction (or auto), activation
offloading, and any other per-part field the Model and Training tabs do not show."""

from __future__ import annotations

from modules.config.train_config import ModelPartConfig
from ui.components import section
from ui.tabs import PartSections, Tab
from ui.tabs.model import PART_FIELDS as MODEL_PART_FIELDS
from ui.tabs.training import PART_FIELDS as TRAINING_PART_FIELDS


class OffloadTab(Tab):
    def __init__(self, parent, app):
        super().__init__(parent, app)
        section(self, "Memory, per model part")
        PartSections(self, lambda group, name, prefix: self.form(
            group, ModelPartConfig, prefix, exclude=set(MODEL_PART_FIELDS) | set(TRAINING_PART_FIELDS)))
