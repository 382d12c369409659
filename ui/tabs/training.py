"""Training: optimizer and its own parameters, learning rate schedule, length and batches, data
(resolution, buckets, augmentations), per-part train toggles and learning rates, EMA, loss."""

from __future__ import annotations

import typing

import customtkinter as ctk

from modules.config.train_config import (
    DataConfig,
    EmaConfig,
    LossConfig,
    LrSchedulerConfig,
    ModelPartConfig,
    OptimizerConfig,
    ScheduleConfig,
)
from ui.components import section
from ui.tabs import PartSections, Tab

PART_FIELDS = ["train", "learning_rate"]
CADENCES = {"sample_every", "backup_every", "save_every", "validate_every"}  # on the Sampling and Backup tabs


def optimizer_classes() -> dict[str, type]:
    """The optimizer union's members by their `type` tag (the schema's discriminator)."""
    members = typing.get_args(typing.get_args(OptimizerConfig)[0]) or (typing.get_args(OptimizerConfig)[0],)
    return {m.model_fields["type"].default: m for m in members}


class TrainingTab(Tab):
    def __init__(self, parent, app):
        super().__init__(parent, app)
        section(self, "Optimizer")
        self.optimizers = optimizer_classes()
        self.optimizer_type = self.field(self, "optimizer.type", "Optimizer", "choice", widget="option",
                                         values=list(self.optimizers),
                                         tooltip="The optimizer; each has its own parameters below.")
        self.cfg.set_hooks["optimizer.type"] = self._optimizer_chosen
        self.optimizer_frame = ctk.CTkFrame(self, fg_color="transparent")
        self.optimizer_frame.pack(fill="x")
        self._optimizer_shown = None
        self._optimizer_fields()
        self.cfg.reload_listeners.append(self._optimizer_fields)
        section(self, "Learning rate schedule")
        self.form(self, LrSchedulerConfig, "lr_scheduler")
        section(self, "Length and batches")
        self.form(self, ScheduleConfig, "schedule", exclude=CADENCES)
        section(self, "Data")
        self.form(self, DataConfig, "data")
        section(self, "Model parts: what trains")
        PartSections(self, lambda group, name, prefix: self.form(group, ModelPartConfig, prefix, PART_FIELDS))
        section(self, "EMA (an averaged copy of the trained weights)")
        self.form(self, EmaConfig, "ema")
        section(self, "Loss")
        self.form(self, LossConfig, "loss")

    def _optimizer_chosen(self, kind) -> bool:
        """Another optimizer: its own parameters at their defaults (the old ones do not fit it)."""
        current = self.cfg.data.get("optimizer")
        if kind not in self.optimizers or (isinstance(current, dict) and current.get("type") == kind):
            return False
        self.cfg.data["optimizer"] = self.optimizers[kind]().model_dump(mode="json")
        self.cfg.refresh()  # rebuilds the parameter fields (reload listener), then validates
        return True

    def _optimizer_fields(self) -> None:
        kind = self.cfg.get("optimizer.type")
        if kind == self._optimizer_shown or kind not in self.optimizers:
            return
        self._optimizer_shown = kind
        for child in self.optimizer_frame.winfo_children():
            child.destroy()  # only this frame's fields, and so only their bindings
        self.form(self.optimizer_frame, self.optimizers[kind], "optimizer", exclude={"type"})
