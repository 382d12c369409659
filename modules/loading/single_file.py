"""Single-file checkpoints in the original (non-diffusers) layout, as people download them.

A family names, per part, the key prefixes that mark the part in such a file and a converter to
diffusers names (diffusers' own single-file converter functions, so the layouts stay theirs).
The architecture comes from a local config folder (resources/model_configs/<family>/<subfolder>/
config.json), so nothing is fetched.

The conversion runs twice, cheaply: first on meta tensors made from the file's header, which
shows which diffusers keys are plain renames of one file tensor (the converter hands the same
tensor object through) and which are computed (split q/k/v, transposes, reshapes). Renamed
tensors are then streamed one at a time by streamed_load.py, as from a diffusers folder; only
the computed ones are read and converted in memory. For SDXL that is CLIP-G's attention and the
VAE's mid attention (a few percent); for Flux most of the transformer (its fused q/k/v).

ComfyUI "scaled fp8" files: a renamed weight keeps its `.scale_weight` (under the new name), so
streamed_load applies or keeps it as for a folder; a weight that is computed is dequantized with
its scale (to bfloat16) before the conversion. A scale is never dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from modules.loading.diffusers_folder import ModelLoadError
from modules.loading.safetensors_stream import SafetensorsError, SafetensorsStream

_SCALE = ".scale_weight"
_INPUT_SCALE = ".scale_input"  # activation scales of fp8 files: not used for weight-only storage
_MARKER = "scaled_fp8"


@dataclass(frozen=True)
class SingleFilePart:
    prefixes: tuple[str, ...]  # a file key belongs to the part when it starts with one of these
    # (the part's keys from the file, the empty model) -> diffusers-named state dict
    convert: Callable[[dict[str, torch.Tensor], nn.Module], dict[str, torch.Tensor]]


def is_single_file(base: str | None) -> bool:
    return bool(base) and Path(base).is_file()


def open_single_file(path: str | Path, where: str = "model.base") -> SafetensorsStream:
    path = Path(path)
    if path.suffix != ".safetensors":
        raise ModelLoadError(f"{where}: {path.name}: only .safetensors single files are read "
                             "(pickled .ckpt files can run code when loaded)")
    try:
        return SafetensorsStream(path)
    except SafetensorsError as error:  # its message starts with the path
        raise ModelLoadError(f"{where}: {error}") from None
    except OSError as error:
        raise ModelLoadError(f"{where}: cannot read {path}: {error.strerror or error}") from None


def part_keys(stream: SafetensorsStream, spec: SingleFilePart) -> list[str]:
    """The file's weight keys of one part (scales and markers excluded)."""
    return [k for k in stream.keys() if k.startswith(spec.prefixes) and not k.endswith((_SCALE, _INPUT_SCALE))
            and k.rpartition(".")[2] != _MARKER]


def part_parameter_count(stream: SafetensorsStream, spec: SingleFilePart) -> int:
    return sum(torch.Size(stream.shape(k)).numel() for k in part_keys(stream, spec))


class ConvertedPart:
    """One part of a single file, in diffusers names: the keys()/__contains__/read() source
    streamed_load reads. Renamed tensors are read from the file when asked for."""

    def __init__(self, stream: SafetensorsStream, renamed: dict[str, str], computed: dict[str, torch.Tensor]):
        self.stream, self.renamed, self.computed = stream, renamed, computed
        self.path = stream.path
        position = {key: index for index, key in enumerate(stream.keys())}
        # file order, so the reads move forward through the file
        self._renamed_order = sorted(renamed, key=lambda k: position[renamed[k]])

    def keys(self) -> list[str]:
        return list(self.computed) + self._renamed_order

    def __contains__(self, name: str) -> bool:
        return name in self.computed or name in self.renamed

    def read(self, name: str) -> torch.Tensor:
        if name in self.computed:
            return self.computed.pop(name)
        return self.stream.read(self.renamed[name])


def _dequantized(stream: SafetensorsStream, key: str) -> torch.Tensor:
    tensor = stream.read(key)
    scale_key = key[: -len("weight")] + "scale_weight"
    if key.endswith(".weight") and scale_key in stream:
        scale = stream.read(scale_key).to(torch.float32)
        scale = scale.reshape(-1, *([1] * (tensor.dim() - 1))) if scale.numel() > 1 else scale.reshape(())
        tensor = (tensor.to(torch.float32) * scale).to(torch.bfloat16)
    return tensor


def convert_part(stream: SafetensorsStream, spec: SingleFilePart, model: nn.Module, where: str) -> ConvertedPart | None:
    """The part's tensors under diffusers names, or None when the file holds none of the part."""
    keys = part_keys(stream, spec)
    if not keys:
        return None
    meta = {k: torch.empty(stream.shape(k), dtype=stream.dtype(k), device="meta") for k in keys}
    try:
        planned = spec.convert(dict(meta), model)
    except (KeyError, IndexError, ValueError, RuntimeError) as error:
        raise ModelLoadError(f"{where}: {stream.path.name} does not convert to {type(model).__name__} "
                             f"(is it another architecture or variant?): {type(error).__name__}: {error}") from None
    source_of = {id(tensor): key for key, tensor in meta.items()}
    renamed = {new: source_of[id(t)] for new, t in planned.items() if id(t) in source_of}
    computed_keys = [new for new, t in planned.items() if id(t) not in source_of]
    computed: dict[str, torch.Tensor] = {}
    if computed_keys:
        used = set(renamed.values())
        real = {k: (meta[k] if k in used else _dequantized(stream, k)) for k in keys}
        converted = spec.convert(real, model)
        if any(converted[k].is_meta for k in computed_keys):  # a tensor both renamed and computed from
            converted = spec.convert({k: _dequantized(stream, k) for k in keys}, model)
        computed = {k: converted[k].contiguous() for k in computed_keys}
        del real, converted
    scales = {}
    for new, old in renamed.items():
        scale_key = old[: -len("weight")] + "scale_weight"
        if old.endswith(".weight") and scale_key in stream:
            scales[new[: -len("weight")] + "scale_weight"] = scale_key
    return ConvertedPart(stream, {**renamed, **scales}, computed)
