"""How big the adapter a config trains will be, known before the model loads (for the preflight's
disk estimate, modules/trainer/backup_size.py).

The trained parts' weight shapes come from their checkpoint headers (no weight is read). The
layers the config's layer preset or filter selects get one real adapter each of the configured
type, rank and dtype, built once per distinct shape on an uninitialised base layer; its tensors
are what a backup and a saved file hold. Which layers: the rule training builds them by
(layer_selection.py), applied to the checkpoint's names and shapes. A single file in the
original layout names its layers otherwise than the presets expect: there every Linear-shaped
weight of the part counts (an overestimate of about a third for attention+MLP presets).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from modules.adapters.layer_selection import layer_patterns, select_layers, trained_parts, weight_kind
from modules.config.train_config import TrainConfig
from modules.util.torch_utils import dtype_of

_SCALES = (".scale_weight", ".scale_input")


@dataclass(frozen=True)
class AdapterSize:
    parameters: int  # trained parameters (what the optimizer keeps state for)
    elements: int  # elements of the saved tensors (parameters and buffers such as alpha)
    nbytes: int  # bytes of the saved tensors in adapter.dtype


def adapter_size(config: TrainConfig, family) -> AdapterSize | None:
    """The adapter this config trains, measured as described above; None where a part's weights are
    a pickled .bin file (no header to read shapes from)."""
    measured: dict[tuple[str, tuple[int, ...]], AdapterSize] = {}
    parameters = elements = nbytes = 0
    for part in trained_parts(config, family):
        shapes = _weight_shapes(family, part)
        if shapes is None:
            return None
        kinds = {name: weight_kind(name, shape) for name, shape in shapes.items()}
        selection = select_layers(family, part, kinds, config.adapter)
        chosen = selection.chosen
        if not chosen and family.from_single_file(part):
            _, with_conv = layer_patterns(family, config.adapter)
            chosen = [name for name, kind in kinds.items() if kind == "linear" or (with_conv and kind == "conv")]
        for shape in (shapes[name] for name in chosen):
            key = (part, shape)
            if key not in measured:
                measured[key] = _one_adapter(config, part, shape)
            size = measured[key]
            parameters, elements, nbytes = parameters + size.parameters, elements + size.elements, nbytes + size.nbytes
    return AdapterSize(parameters, elements, nbytes)


def _weight_shapes(family, part: str) -> dict[str, tuple[int, ...]] | None:
    """Module name -> weight shape of a part, from its checkpoint headers."""
    from modules.loading.safetensors_stream import SafetensorsStream
    from modules.loading.streamed_load import checkpoint_files

    if family.from_single_file(part):
        from modules.loading.single_file import part_keys

        stream = family.single_file_stream(part)
        streams, keys = [stream], {stream: part_keys(stream, family.single_file_part(part))}
    else:
        files = checkpoint_files(family.part_folder(part), f"model.parts.{part}")
        if any(path.suffix != ".safetensors" for path in files):
            return None
        streams = [SafetensorsStream(path) for path in files]
        keys = {stream: stream.keys() for stream in streams}
    return {key[: -len(".weight")]: stream.shape(key) for stream in streams for key in keys[stream]
            if key.endswith(".weight") and not key.endswith(_SCALES)}


def _one_adapter(config: TrainConfig, part: str, shape: tuple[int, ...]) -> AdapterSize:
    """The real adapter for one layer of this shape (the adapter classes decide their own tensors)."""
    from modules.adapters.registry import create_adapter

    with torch.device("meta"):
        base = nn.Linear(shape[1], shape[0], bias=False) if len(shape) == 2 else \
            nn.Conv2d(shape[1], shape[0], tuple(shape[2:]), bias=False)
    base = base.to(torch.bfloat16).to_empty(device="cpu")  # storage, uninitialised: only shapes matter
    try:
        adapter = create_adapter(config.adapter, part, "size-estimate", base, torch.device("cpu"),
                                 dtype_of(config.adapter.dtype))
    except ValueError:
        return AdapterSize(0, 0, 0)  # a layer this adapter cannot take: building the adapter set names it
    saved = adapter.state_dict().values()
    return AdapterSize(sum(p.numel() for p in adapter.parameters()), sum(t.numel() for t in saved),
                       sum(t.numel() * t.element_size() for t in saved))
