"""AdapterSet: the adapters of one run, chosen by layer filter over the trained parts.

Its state dict is the canonical one, keyed the way kohya/LyCORIS files are
(`lora_unet_down_blocks_0_..._to_q.lora_down.weight`, `....hada_w1_a`, `....lokr_w1`,
`....oft_blocks`, `....dora_scale`), so backups, saved files and loading another trainer's file
all speak the same names; formats/ converts it to and from the ComfyUI and diffusers layouts.
"""

from __future__ import annotations

from modules.errors import UserError

from typing import TYPE_CHECKING

import torch
from torch import nn

from modules.adapters.base import AdapterModule, InertAdapter
from modules.adapters.layer_selection import module_kinds, select_layers
from modules.adapters.registry import create_adapter
from modules.util.torch_utils import dtype_of

if TYPE_CHECKING:
    from modules.config.train_config import AdapterConfig
    from modules.model.base import ModelFamily


class AdapterSetError(UserError, ValueError):
    pass


class AdapterSet:
    def __init__(self) -> None:
        self.modules = nn.ModuleDict()
        self.part_of: dict[str, str] = {}  # adapter name -> model part
        self.module_name_of: dict[str, str] = {}  # adapter name -> module name inside its part
        # "part.module" -> why the filter chose it but it got no adapter (it could never learn)
        self.left_out: dict[str, str] = {}

    def add(self, part: str, adapter: AdapterModule, module_name: str | None = None) -> None:
        self.modules[adapter.name] = adapter
        self.part_of[adapter.name] = part
        self.module_name_of[adapter.name] = module_name if module_name is not None else adapter.name

    def __len__(self) -> int:
        return len(self.modules)

    def __iter__(self):
        return iter(self.modules.values())

    def left_out_message(self) -> str:
        """Which layers got no adapter and why, by block: what the run tells the user."""
        by_reason: dict[str, dict[str, int]] = {}
        for name, reason in self.left_out.items():
            block = name.rsplit(".", 2)[0] if name.count(".") > 2 else name
            blocks = by_reason.setdefault(reason, {})
            blocks[block] = blocks.get(block, 0) + 1
        return "; ".join(
            "adapter: no adapters on " + ", ".join(f"{block} ({count} layer{'s' * (count > 1)})"
                                                   for block, count in blocks.items()) + f": {reason}"
            for reason, blocks in by_reason.items())

    def hook(self) -> None:
        for adapter in self:
            adapter.hook()

    def unhook(self) -> None:
        for adapter in self:
            adapter.unhook()

    def parameters(self, part: str | None = None) -> list[nn.Parameter]:
        return [p for name, a in self.modules.items() if part in (None, self.part_of[name]) for p in a.parameters()]

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return list(self.modules.named_parameters())

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.modules.state_dict().items()}

    def written_as(self, parts: dict[str, str], family: ModelFamily) -> AdapterSet:
        """The adapters of `parts` (part -> the part they are written as) as a set of their own, for a
        saved file that holds only those: an adapter written as another part takes the name it would
        have there (Wan 2.2's low-noise expert saved under a lone Wan transformer's names). The
        adapter modules are the same objects."""
        view = AdapterSet()
        for name, adapter in self.modules.items():
            part = self.part_of[name]
            if part not in parts:
                continue
            module_name = self.module_name_of[name]
            as_part = parts[part]
            written = name if as_part == part else family.adapter_name(as_part, module_name)
            view.modules[written] = adapter
            view.part_of[written] = as_part
            view.module_name_of[written] = module_name
        return view

    def load_state_dict(self, state: dict[str, torch.Tensor], source: str = "adapter state") -> None:
        """Strict: every key must fit an adapter and every adapter tensor must be given."""
        own = self.modules.state_dict()
        missing = sorted(set(own) - set(state))
        unexpected = sorted(set(state) - set(own))
        mismatched = sorted(k for k in set(own) & set(state) if own[k].shape != state[k].shape)
        problems = []
        for label, keys in (("missing", missing), ("unexpected", unexpected), ("shape-mismatched", mismatched)):
            if keys:
                shown = [f"{k} {tuple(state[k].shape)} vs {tuple(own[k].shape)}" if label == "shape-mismatched"
                         else k for k in keys[:6]]
                problems.append(f"{label} keys: " + ", ".join(shown) + (f", ... ({len(keys)} in all)" if len(keys) > 6 else ""))
        if problems:
            raise AdapterSetError(f"{source} does not fit this run's adapters: " + "; ".join(problems))
        with torch.no_grad():
            self.modules.load_state_dict(state, strict=True)


def build_adapter_set(family: ModelFamily, adapter: AdapterConfig, trained_parts: list[str],
                      device: torch.device, output_format: str = "kohya") -> AdapterSet:
    """Create adapters on `device` for the layers of `trained_parts` the filter selects, and hook
    them (`output_format`: the file format they will be saved in, which resolves dora_axis 'auto')."""
    sized_parts = getattr(adapter, "parts", {})  # per-part rank/alpha: the low-rank algorithms only
    unknown = sorted(set(sized_parts) - {spec.name for spec in family.part_specs if spec.adapter_prefix})
    if unknown:
        known = ", ".join(spec.name for spec in family.part_specs if spec.adapter_prefix)
        raise AdapterSetError(f"adapter.parts.{unknown[0]}: no part of {family.label} carries adapters by that "
                              f"name (parts: {known})")
    adapters = AdapterSet()
    matched_filters: set[int] = set()
    dtype = dtype_of(adapter.dtype)
    for part in trained_parts:
        modules = dict(family.parts[part].named_modules())
        selection = select_layers(family, part, module_kinds(family.parts[part]), adapter)
        matched_filters |= selection.matched_filters
        for module_name in selection.unreachable:  # an adapter there would never learn
            adapters.left_out[f"{part}.{module_name}"] = (f"their output never reaches the loss ({family.label} "
                                                          "reads the layer before)")
        for module_name in selection.chosen:
            module, qualified = modules[module_name], f"{part}.{module_name}"
            name = family.adapter_name(part, module_name)
            try:
                created = create_adapter(adapter, part, name, module, device, dtype, output_format)
            except InertAdapter as why:
                adapters.left_out[qualified] = str(why)
                continue
            except ValueError as error:
                raise AdapterSetError(f"{qualified}: {error}") from None
            adapters.add(part, created, module_name)
    unmatched = [f"adapter.layer_filter[{i}]: {p!r} matches no layer of the trained parts ({', '.join(trained_parts)})"
                 for i, p in enumerate(adapter.layer_filter) if i not in matched_filters]
    if unmatched:
        raise AdapterSetError("\n".join(unmatched))
    if not adapters:
        raise AdapterSetError(
            f"adapter.layer_preset: {adapter.layer_preset!r} selects no layer of the trained parts ({', '.join(trained_parts)})"
        )
    adapters.hook()
    return adapters
