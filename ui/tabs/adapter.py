"""Adapter: type, size, DoRA, LoKr and OFT options (shown for their type only), which layers,
dropout, dtype, start file, and per-part rank/alpha."""

from __future__ import annotations

from modules.config.train_config import AdapterConfig, AdapterPartConfig
from ui.components import SectionHeader, section
from ui.tabs import PartSections, Tab

GROUPS = [("Adapter", ["type", "rank", "alpha", "dora", "dora_axis"]),
          ("LoKr", ["lokr_factor", "lokr_decompose_both", "lokr_full_matrix"]),
          ("OFT", ["oft_block_size", "oft_constraint"]),
          ("Layers", ["layer_preset", "layer_filter"])]


class AdapterTab(Tab):
    def __init__(self, parent, app):
        super().__init__(parent, app)
        placed = {"parts"}
        self.headers = {}
        for title, names in GROUPS:
            header = SectionHeader(self, title)  # hidden while none of its fields applies
            header.fields = [self.fields[path] for path in self.form(self, AdapterConfig, "adapter", names)]
            self.headers[title] = header
            placed |= set(names)
        self.cfg.validate_listeners.append(lambda: [header.follow() for header in self.headers.values()])
        section(self, "Regularisation and storage")
        self.form(self, AdapterConfig, "adapter", exclude=placed)
        section(self, "Per model part (empty: the values above)")
        PartSections(self, lambda group, name, _prefix: self.form(group, AdapterPartConfig, f"adapter.parts.{name}"))
