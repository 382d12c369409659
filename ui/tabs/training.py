"""Training: the method (what trains) and the optimizer, each with its own options; learning rate
schedule, length and batches, data (resolution, buckets, augmentations), per-part train toggles and
learning rates, EMA, loss."""

from __future__ import annotations

from modules.config.train_config import (
    DataConfig,
    EmaConfig,
    LossConfig,
    LrSchedulerConfig,
    METHODS,
    OPTIMIZERS,
    ModelPartConfig,
    ScheduleConfig,
)
from ui.components import section
from ui.tabs import PartSections, Tab
from ui.union_section import UnionSection

PART_FIELDS = ["train", "learning_rate"]
CADENCES = {"sample_every", "backup_every", "save_every", "validate_every"}  # on the Sampling and Backup tabs


class TrainingTab(Tab):
    def __init__(self, parent, app):
        super().__init__(parent, app)
        section(self, "Method: what trains")
        self.method = UnionSection(self, METHODS, "Method",
                                   "adapter: a LoRA/LoHa/LoKr/OFT on the trained parts (Adapter tab); "
                                   "fine_tune: the trained parts' own weights; embedding: only the embeddings "
                                   "(Embeddings tab); each has its options below.")
        section(self, "Optimizer")
        self.optimizer = UnionSection(self, OPTIMIZERS, "Optimizer",
                                      "The optimizer; each has its own parameters below.")
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
