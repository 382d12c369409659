"""Adapter: type, size, DoRA, LoKr and OFT options (shown for their type only), which layers,
dropout, dtype, start file, and per-part rank/alpha."""

from __future__ import annotations

from modules.config.train_config import AdapterConfig, AdapterPartConfig
from ui.components import section
from ui.tabs import PartSections, Tab

GROUPS = [("Adapter", ["type", "rank", "alpha", "dora", "dora_axis"]),
          ("LoKr and OFT", ["lokr_factor", "lokr_decompose_both", "lokr_full_matrix", "oft_block_size",
                                   "oft_constraint"]),
          ("Layers", ["layer_preset", "layer_filter"])]


class AdapterTab(Tab):
    def __init__(self, parent, app):
        super().__init__(parent, app)
        placed = {"parts"}
        for title, names in GROUPS:
            section(self, title)
            self.form(self, AdapterConfig, "adapter", names)
            placed |= set(names)
        section(self, "Regularisation and storage")
        self.form(self, AdapterConfig, "adapter", exclude=placed)
        section(self, "Per model part (empty: the values above)")
        PartSections(self, lambda group, name, _prefix: self.form(group, AdapterPartConfig, f"adapter.parts.{name}"))
