"""The adapter method: LoRA, LoHa, LoKr, OFT (with DoRA) hooked onto the trained parts' layers; the
base weights stay frozen, and the saved file is the adapter alone, in `output.format`."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from modules.adapters.adapter_set import AdapterSet, build_adapter_set
from modules.adapters.formats.files import (
    check_output_format,
    diffusers_report,
    file_state,
    format_warnings,
    load_adapter_file,
    network_metadata,
    save_adapter_file,
)
from modules.adapters.formats.init_from import load_per_part_files
from modules.adapters.formats.layers import adopt_file_layers
from modules.adapters.layer_selection import trained_parts
from modules.config.train_config import TrainConfig
from modules.methods.base import TrainingMethod
from modules.saving.consumers.check import check, check_file, target_drops


class AdapterMethod(TrainingMethod):
    name = "adapter"
    state_prefix = ""  # canonical kohya keys, as backups had them before methods existed

    adapters: AdapterSet | None = None

    def trained_parts(self) -> list[str]:
        return trained_parts(self.config, self.family)

    def setup(self) -> None:
        config, callbacks = self.config, self.trainer.callbacks
        self.adapters = build_adapter_set(self.family, config.adapter, self.trained_parts(), self.device,
                                          config.output.format)
        per_part = (self.family.init_from_files(Path(config.adapter.init_from), self.trained_parts())
                    if config.adapter.init_from else None)
        if config.adapter.init_from and per_part is None:  # the file's layers beyond the selection train too
            adopted = adopt_file_layers(config.adapter.init_from, self.adapters, self.family, config.adapter,
                                        self.trained_parts(), self.device, config.output.format)
            if adopted:
                callbacks.on_warning(adopted)
        if self.adapters.left_out:
            callbacks.on_warning(self.adapters.left_out_message())
        for _, adapters in self.file_sets():
            check_output_format(config.output.format, adapters, self.family)  # before training, not at the end
            for warning in format_warnings(config.output.format, adapters, self.family):
                callbacks.on_warning(warning)
        if per_part is not None:  # one file per part (Wan 2.2's experts: formats/init_from.py)
            callbacks.on_warning(load_per_part_files(per_part, self.adapters, self.family))
        elif config.adapter.init_from:
            load_adapter_file(config.adapter.init_from, self.adapters, self.family)

    def file_sets(self) -> list[tuple[str, AdapterSet]]:
        """(file name suffix, its adapters) per saved file (the family's `adapter_files`: one file, or
        Wan 2.2's one per expert)."""
        files = self.family.adapter_files(self.trained_parts())
        if len(files) == 1 and not files[0][0] and all(a == b for a, b in files[0][1].items()):
            return [("", self.adapters)]
        return [(suffix, self.adapters.written_as(parts, self.family)) for suffix, parts in files]

    def guarded_parameters(self) -> list[tuple[str, nn.Parameter]]:
        not_run = self.family.trained_parts_not_run()  # an expert no sample reached yet has no gradient
        return [(n, p) for n, p in self.named_parameters() if self.adapters.part_of[n.split(".", 1)[0]] not in not_run]

    def parameter_groups(self, config: TrainConfig) -> list[dict]:
        groups = []
        for part in self.trained_parts():
            params = self.adapters.parameters(part)
            if params:
                groups.append({"params": params, "lr": config.model.parts[part].learning_rate or config.optimizer.lr,
                               "name": part})
        return groups

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return list(self.adapters.named_parameters())

    @classmethod
    def planned_size(cls, config: TrainConfig, family):
        from modules.adapters.adapter_size import adapter_size

        return adapter_size(config, family)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.adapters.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor], source: str) -> None:
        self.adapters.load_state_dict(state, source=source)

    def save(self, path: Path, dtype: torch.dtype, metadata: dict[str, str]) -> list[Path]:
        family = self.family
        metadata = {
            **network_metadata(self.config.adapter),
            "ss_base_model_version": family.kohya_base_version,
            "ss_sd_model_name": Path(self.config.model.base).name,
            "ss_steps": str(self.trainer.step),
            "ss_epoch": str(self.trainer.epoch),
            "modelspec.architecture": family.modelspec_architecture,
            **metadata,
        }
        path = Path(path)
        self._saved_sets = {}
        file_sets = self.file_sets()
        # a resumed run is handed the file its first part saved (already suffixed: lora-high_noise)
        stem = next((path.stem[:-len(s)] for s, _ in file_sets if s and path.stem.endswith(s)), path.stem)
        for suffix, adapters in file_sets:
            target = path.with_name(f"{stem}{suffix}{path.suffix}")
            self._saved_sets[target] = adapters
            save_adapter_file(target, adapters, family, self.config.output.format, dtype, metadata)
        return list(self._saved_sets)

    def consumers(self, file: Path) -> dict[str, dict]:
        report = check_file(file, self.family)  # the kept key maps (ComfyUI, Forge)
        adapters = getattr(self, "_saved_sets", {}).get(Path(file), self.adapters)
        report["diffusers"] = diffusers_report(self.config.output.format, adapters, self.family)
        return report

    def first_backup_warnings(self) -> list[str]:
        """The output format's own tools (ComfyUI for comfy; ComfyUI and Forge for kohya) dropping
        modules of the files this run will save: said now, not after training."""
        fmt = self.config.output.format
        warnings = []
        for suffix, adapters in self.file_sets():
            report = check(file_state(adapters, self.family, fmt).keys(), self.family)
            shown = f" ({suffix.lstrip('-')})" if suffix else ""
            warnings += [f"output.format: {fmt!r}: the saved file{shown} will not load whole: {line}"
                         for line in target_drops(fmt, report)]
        return warnings
