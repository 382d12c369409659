"""Training: optimizer and its own parameters, learning rate schedule, epochs or steps, batch,
accumulation, resolution, and per-part train toggles and learning rates."""

from __future__ import annotations

import typing

import customtkinter as ctk

from modules.config.train_config import LrSchedulerConfig, OptimizerConfig
from ui.components import section
from ui.tabs import PartSections, Tab


def optimizer_classes() -> dict[str, type]:
    members = typing.get_args(typing.get_args(OptimizerConfig)[0]) or (typing.get_args(OptimizerConfig)[0],)
    return {m.model_fields["type"].default: m for m in members}


class TrainingTab(Tab):
    def __init__(self, parent, app):
        super().__init__(parent, app)
        section(self, "Optimizer")
        self.optimizers = optimizer_classes()
        self.optimizer_type = self.field(self, "optimizer.type", "Optimizer", "choice", widget="option",
                                         values=list(self.optimizers))
        self.optimizer_type.var.trace_add("write", lambda *_: self._optimizer_changed())
        self.optimizer_frame = ctk.CTkFrame(self, fg_color="transparent")
        self.optimizer_frame.pack(fill="x")
        self._optimizer_shown = None
        self._optimizer_fields()
        section(self, "Learning rate schedule")
        schedules = list(typing.get_args(LrSchedulerConfig.model_fields["type"].annotation))
        self.field(self, "lr_scheduler.type", "Scheduler", "choice", widget="option", values=schedules)
        self.field(self, "lr_scheduler.warmup_steps", "Warmup steps", "int")
        section(self, "Length and batches")
        self.field(self, "schedule.epochs", "Epochs", "int")
        self.field(self, "schedule.max_steps", "Max steps (empty: all epochs)", "optint")
        self.field(self, "schedule.batch_size", "Batch size", "int")
        self.field(self, "schedule.gradient_accumulation", "Gradient accumulation", "int")
        self.field(self, "schedule.max_grad_norm", "Max grad norm (empty: off)", "optfloat")
        self.field(self, "data.resolution", "Resolution", "int")
        self.field(self, "data.aspect_buckets", "Aspect ratio buckets", "bool", widget="switch")
        section(self, "Model parts")
        PartSections(self, self._part)
        self.cfg.reload_listeners.append(self._optimizer_fields)

    def _part(self, group, name: str, prefix: str) -> None:
        self.field(group, f"{prefix}.train", "Train", "bool", widget="switch")
        self.field(group, f"{prefix}.learning_rate", "Learning rate (empty: optimizer's)", "optfloat")

    def _optimizer_changed(self) -> None:
        kind = self.cfg.get("optimizer.type")
        current = self.cfg.data.get("optimizer")
        if kind in self.optimizers and isinstance(current, dict) and set(current) != set(self.optimizers[kind].model_fields):
            # another optimizer: its own parameters, at their defaults
            self.cfg.data["optimizer"] = self.optimizers[kind]().model_dump(mode="json")
        self._optimizer_fields()
        self.cfg.refresh()

    def _optimizer_fields(self) -> None:
        kind = self.cfg.get("optimizer.type")
        if kind == self._optimizer_shown or kind not in self.optimizers:
            return
        self._optimizer_shown = kind
        self.cfg.unbind(lambda b: b.path.startswith("optimizer.") and b.path != "optimizer.type")
        for child in self.optimizer_frame.winfo_children():
            child.destroy()
        for name, info in self.optimizers[kind].model_fields.items():
            if name == "type":
                continue
            annotation = info.annotation
            origin = typing.get_origin(annotation)
            optional = type(None) in typing.get_args(annotation)  # e.g. Prodigy's beta3: None = automatic
            if origin is tuple:
                for index, member in enumerate(typing.get_args(annotation)):
                    kind = "optfloat" if type(None) in typing.get_args(member) else "float"
                    self.field(self.optimizer_frame, f"optimizer.{name}[{index}]", f"{name} [{index}]", kind)
            elif optional:
                self.field(self.optimizer_frame, f"optimizer.{name}", f"{name} (empty: automatic)", "optfloat")
            elif annotation is bool:
                self.field(self.optimizer_frame, f"optimizer.{name}", name, "bool", widget="switch")
            elif annotation is int:
                self.field(self.optimizer_frame, f"optimizer.{name}", name, "int")
            else:
                self.field(self.optimizer_frame, f"optimizer.{name}", "learning rate" if name == "lr" else name, "float")
