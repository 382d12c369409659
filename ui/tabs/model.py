"""Model: family and base model, per-part base weights (precision: only what `launch.py info`
says works here; quantization options; another source), and the output file."""

from __future__ import annotations

from modules.config.train_config import ModelConfig, ModelPartConfig, OutputConfig
from ui.components import section
from ui.tabs import PartSections, Tab

PART_FIELDS = ["weight_dtype", "nf4_double_quant", "quantize_skip", "path"]  # the rest: Training, Offload tabs


class ModelTab(Tab):
    def __init__(self, parent, app):
        super().__init__(parent, app)
        section(self, "Base model")
        self.form(self, ModelConfig, "model", exclude={"parts"})
        section(self, "Model parts: base weights")
        self.sections = PartSections(self, lambda group, name, prefix: self.form(group, ModelPartConfig, prefix,
                                                                                 PART_FIELDS))
        section(self, "Output")
        self.form(self, OutputConfig, "output")
