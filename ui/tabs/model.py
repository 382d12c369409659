"""Model: base model, per-part base weight precision (only what `launch.py info` says works here), output."""

from __future__ import annotations

from ui.components import section
from ui.tabs import PartSections, Tab


class ModelTab(Tab):
    def __init__(self, parent, app):
        super().__init__(parent, app)
        section(self, "Base model")
        self.field(self, "model.base", "Base model (folder or file)", "str", widget="path", path_mode="file_or_dir")
        self.field(self, "model.prediction_type", "Prediction type", "choice", widget="option",
                   values=["auto", "epsilon", "v_prediction"])
        section(self, "Model parts: base weight precision")
        self.dtype_fields = []
        self.sections = PartSections(self, self._part)
        section(self, "Output")
        self.field(self, "output.path", "Adapter file (empty: in the workspace)", "str", widget="path", path_mode="save",
                   filetypes=[("safetensors", "*.safetensors")])
        self.field(self, "output.if_exists", "If the file exists", "choice", widget="option",
                   values=["version", "refuse", "overwrite"])
        self.field(self, "output.format", "Key format", "choice", widget="option", values=["kohya", "comfy", "diffusers"])
        self.field(self, "output.dtype", "Saved dtype", "choice", widget="option", values=["float16", "bfloat16", "float32"])
        self.cfg.info_listeners.append(self._offer_modes)
        self.cfg.reload_listeners.append(self._offer_modes)

    def _part(self, group, name: str, prefix: str) -> None:
        self.dtype_fields = [f for f in self.dtype_fields if f.winfo_exists()]
        self.dtype_fields.append(self.field(group, f"{prefix}.weight_dtype", "Weight dtype", "choice", widget="option",
                                            values=self._modes(f"{prefix}.weight_dtype")))
        self.field(group, f"{prefix}.path", "Load from (empty: base model)", "optstr", widget="path", path_mode="dir")

    def _modes(self, path: str) -> list[str]:
        """What info reports working (auto included); before it is in, only the current value."""
        modes = self.cfg.weight_dtypes()
        return modes if modes is not None else [str(self.cfg.get(path))]

    def _offer_modes(self) -> None:
        for field in self.dtype_fields:
            if field.winfo_exists():
                field.set_values(self._modes(field.path))
