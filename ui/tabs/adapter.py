"""Adapter: type, size, DoRA, LoKr and OFT options, which layers, dropout, dtype, start file."""

from __future__ import annotations

from ui.components import section
from ui.tabs import Tab


class AdapterTab(Tab):
    def __init__(self, parent, app):
        super().__init__(parent, app)
        section(self, "Adapter")
        self.field(self, "adapter.type", "Type", "choice", widget="option", values=["lora", "loha", "lokr", "oft"])
        self.field(self, "adapter.rank", "Rank", "int")
        self.field(self, "adapter.alpha", "Alpha", "float")
        self.field(self, "adapter.dora", "DoRA / weight decomposition", "bool", widget="switch")
        self.field(self, "adapter.dora_axis", "DoRA norm axis", "choice", widget="option", values=["auto", "output", "input"])
        section(self, "LoKr and OFT")
        self.field(self, "adapter.lokr_factor", "LoKr factor (-1: square)", "int")
        self.field(self, "adapter.lokr_decompose_both", "LoKr: decompose both factors", "bool", widget="switch")
        self.field(self, "adapter.lokr_full_matrix", "LoKr: full large factor", "bool", widget="switch")
        self.field(self, "adapter.oft_block_size", "OFT block size", "int")
        self.field(self, "adapter.oft_constraint", "OFT constraint (0: none)", "float")
        section(self, "Layers")
        self.presets = self.field(self, "adapter.layer_preset", "Layer preset", "choice", widget="option",
                                  values=self._layer_presets())
        self.field(self, "adapter.layer_filter", "Layer filter (regexes)", "lines",
                   widget="lines")
        section(self, "Regularisation and storage")
        self.field(self, "adapter.dropout", "Dropout", "float")
        self.field(self, "adapter.rank_dropout", "Rank dropout", "float")
        self.field(self, "adapter.module_dropout", "Module dropout", "float")
        self.field(self, "adapter.dtype", "Adapter dtype", "choice", widget="option", values=["float32", "bfloat16", "float16"])
        self.field(self, "adapter.init_from", "Continue from file (empty: new)", "optstr", widget="path", path_mode="file",
                   filetypes=[("safetensors", "*.safetensors")])
        self.cfg.reload_listeners.append(lambda: self.presets.set_values(self._layer_presets()))

    def _layer_presets(self) -> list[str]:
        from modules.model.registry import family_names, get_family_class

        family = self.cfg.get("model.family")
        if family not in family_names():
            return [str(self.cfg.get("adapter.layer_preset"))]
        return list(get_family_class(family).layer_presets)
