"""Load a model part tensor by tensor into an empty (meta) model, quantizing as it goes.

The order of docs/architecture.md: build the architecture on the meta device (no memory), decide
which Linear layers are quantized, then read the checkpoint one tensor at a time; each tensor is
cast or quantized into its final place and the source buffer released before the next is read.
Peak memory stays near the final model (tests/test_load_memory.py measures it).

ComfyUI "scaled fp8" checkpoints store fp8 codes in `X.weight` with the true scale in
`X.scale_weight` (and a `scaled_fp8` marker tensor). The scale is never dropped: it becomes the
LinearFp8 scale when the layer stays fp8, and is multiplied in otherwise.

Loading is strict: keys the architecture lacks, keys it needs that the file lacks, and shape
mismatches refuse the load with the keys named.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from modules.loading.diffusers_folder import ModelLoadError, _quiet_loaders
from modules.loading.safetensors_stream import SafetensorsError, SafetensorsStream
from modules.loading.torch_files import load_weights_only
from modules.quantization.base import QuantizedLinear
from modules.quantization.half_storage import stored_dtype
from modules.quantization.replace import (
    QuantizationReport,
    is_quantized_mode,
    load_dense_weight,
    new_quantized_layer,
    plan_layers,
)
from modules.quantization.skip_rules import keeps_float32
from modules.quantization.weight_modes import LayerOptions
from modules.util.memory import freed_memory_returned_to_os, return_freed_heap
from modules.quantization.tied_weights import tied_weight_keys

_SCALE_SUFFIXES = (".scale_weight", ".scale_input")
# bytes read between two heap trims: what glibc keeps of the freed read buffers stays under a few
# percent of a part's bytes (without trims, 25% of it: plan_host_accuracy), at a few ms a trim
_TRIM_EVERY = 16 << 20
_MARKER = "scaled_fp8"


# --- the empty model -----------------------------------------------------------------------------

def empty_model(cls: Any, folder: Path, where: str) -> nn.Module:
    """The architecture of a diffusers or transformers class from its config.json, its parameters
    on meta (its buffers computed on the CPU: a checkpoint does not hold them), to load into."""
    from accelerate import init_empty_weights

    def build(make):
        with init_empty_weights():
            return make()

    return model_from_config(cls, folder, where, build)


def model_from_config(cls: Any, folder: Path, where: str, build: Callable[[Callable[[], nn.Module]], nn.Module]) -> nn.Module:
    """`cls` made from the config.json in `folder` by `build(make)`, which calls `make()` in the
    context it builds in (here or a skeleton: skeleton_build.py)."""
    _quiet_loaders()
    try:
        if hasattr(cls, "load_config"):  # diffusers ModelMixin
            config = cls.load_config(str(folder), local_files_only=True)
            return build(lambda: cls.from_config(config))
        config = cls.config_class.from_pretrained(str(folder), local_files_only=True)
        return build(lambda: cls(config))
    except (OSError, ValueError, TypeError) as error:
        raise ModelLoadError(f"{where}: cannot read the {cls.__name__} config in {folder}: {error}") from None


# --- checkpoint files ------------------------------------------------------------------------------

class _TorchBinSource:
    """A pickled .bin checkpoint, read with weights_only (never arbitrary unpickling)."""

    def __init__(self, path: Path, where: str):
        self.path = path
        self._tensors = load_weights_only(path, where, mmap=True)

    def keys(self) -> list[str]:
        return list(self._tensors)

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def read(self, name: str) -> torch.Tensor:
        return self._tensors.pop(name)


_VARIANT = re.compile(r"\.(fp16|bf16|non_ema|ema)\.")


def checkpoint_files(folder: Path, where: str) -> list[Path]:
    """The weight files of a component folder: a safetensors index's shards or one safetensors
    file, else (older exports) pickled .bin files. Plain names win over variants
    (`.fp16.safetensors`, as diffusers writes them beside the full-precision file); a folder that
    has only a variant uses it."""
    for suffix in ("safetensors", "bin"):
        for variant in (False, True):
            indexes = sorted(p for p in folder.glob(f"*.{suffix}.index.json") if bool(_VARIANT.search(p.name)) == variant)
            if indexes:
                weight_map = json.loads(indexes[0].read_text())["weight_map"]
                return [folder / name for name in dict.fromkeys(weight_map.values())]
            files = sorted(p for p in folder.glob(f"*.{suffix}") if bool(_VARIANT.search(p.name)) == variant)
            if len(files) > 1 and variant:
                files = files[:1]  # fp16 before bf16 before ema: any one of them is the whole model
            if len(files) > 1:
                names = ", ".join(p.name for p in files)
                raise ModelLoadError(f"{where}: several weight files and no index in {folder}: {names}")
            if files:
                return files
    raise ModelLoadError(f"{where}: no weights (*.safetensors or *.bin) in {folder}")


def _open(path: Path, where: str):
    try:
        return SafetensorsStream(path) if path.suffix == ".safetensors" else _TorchBinSource(path, where)
    except SafetensorsError as error:  # its message starts with the path
        raise ModelLoadError(f"{where}: {error}") from None
    except OSError as error:
        raise ModelLoadError(f"{where}: cannot read {path}: {error.strerror or error}") from None


# --- the load --------------------------------------------------------------------------------------

def _target_dtype(model: nn.Module, key: str, tensor_dtype: torch.dtype, dense: torch.dtype) -> torch.dtype:
    if not tensor_dtype.is_floating_point:
        return tensor_dtype  # index buffers stay integers
    # the tensor's full name: an entry may name a parameter (Wan's `scale_shift_table`), as diffusers
    # matches it against the parameter name's components
    return torch.float32 if keeps_float32(model, key) else dense


def _assign(model: nn.Module, key: str, value: torch.Tensor) -> None:
    module_name, _, attr = key.rpartition(".")
    module = model.get_submodule(module_name)
    if attr in module._parameters:
        module._parameters[attr] = nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[attr] = value


def _read_weight(source, key: str) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The tensor at `key`; for a scaled-fp8 weight, (fp8 codes, scale)."""
    tensor = source.read(key)
    scale_key = key[: -len("weight")] + "scale_weight"
    if key.endswith(".weight") and scale_key in source:
        return tensor, source.read(scale_key).to(torch.float32)
    return tensor


def _dequantize_scaled(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # a per-tensor scale is one number; a per-channel one has a value per output row
    scale = scale.reshape(-1, *([1] * (codes.dim() - 1))) if scale.numel() > 1 else scale.reshape(())
    return codes.to(torch.float32) * scale


@freed_memory_returned_to_os()  # for the load only: see there (issue 19)
def load_streamed(model: nn.Module, folder: Path, *, part: str, where: str, mode: str,
                  compute_dtype: torch.dtype, quantize_skip: list[str] | None = None,
                  layer_options: LayerOptions = LayerOptions(), rename: Callable[[str], str] | None = None,
                  ignore_unexpected: list[str] | None = None, sources: list | None = None,
                  quantize_device: torch.device | None = None,
                  quantized_home: torch.device | None = None) -> tuple[nn.Module, QuantizationReport | None]:
    """Fill the meta `model` from the checkpoint in `folder` (or from `sources`: objects with
    keys(), __contains__ and read(), such as single_file.ConvertedPart; `folder` then only names
    where the weights came from in messages).

    mode: a dense dtype name (float32/bfloat16/float16), or a quantized mode whose Linear layers
    compute in `compute_dtype` while every other floating tensor is stored in `compute_dtype` too.
    `_keep_in_fp32_modules` of the model class stay float32 in every mode.

    quantize_device: an accelerator to quantize each Linear on, one layer at a time (None: where
    the layer is stored); quantized_home: where the quantized layers are stored (the train device
    for a part that stays there, the temp device for one that will be parked; None: the CPU).
    Everything else is loaded onto the CPU. layer_options: the part's options for the mode's
    layers (`ModelPartConfig.layer_options`).
    """
    dense = stored_dtype(mode, compute_dtype)  # (the other 16-bit float's: half_storage.py)
    expected = {key: tensor.shape for key, tensor in model.state_dict().items()}
    report = None
    quantized: dict[str, nn.Module] = {}
    if is_quantized_mode(mode):
        report = QuantizationReport(mode)
        targets, report.skipped = plan_layers(model, part, quantize_skip or [])
        options = layer_options.on(quantized_home or "cpu")
        for name in targets:
            layer = new_quantized_layer(mode, model.get_submodule(name), compute_dtype, options)
            model.set_submodule(name, layer)
            quantized[name] = layer
        report.quantized = targets
    ignore = [re.compile(p) for p in (ignore_unexpected or [])]
    unexpected, mismatched, seen = [], [], set()
    read_since_trim = 0
    if sources is None:
        sources = (_open(path, where) for path in checkpoint_files(folder, where))
    for source in sources:
        for file_key in source.keys():
            if file_key.rpartition(".")[2] == _MARKER:
                continue
            if file_key.endswith(_SCALE_SUFFIXES):
                # read together with their weight below; a scale whose weight is absent is reported
                if file_key.rpartition(".")[0] + ".weight" not in source:
                    unexpected.append(file_key)
                continue
            key = rename(file_key) if rename else file_key
            if key not in expected:
                if not any(p.search(key) for p in ignore):
                    unexpected.append(file_key)
                continue
            value = _read_weight(source, file_key)
            codes = value[0] if isinstance(value, tuple) else value
            if tuple(codes.shape) != tuple(expected[key]):
                mismatched.append(f"{file_key} {tuple(codes.shape)} (model: {tuple(expected[key])})")
                continue
            seen.add(key)
            module_name, _, attr = key.rpartition(".")
            layer = quantized.get(module_name)
            if layer is not None:
                if isinstance(value, tuple) and attr == "weight" and layer.keeps_scaled_fp8 and value[1].numel() == 1:
                    layer.set_quantized(*value)  # the checkpoint's own fp8 codes and scale, kept as they are
                else:
                    dense_value = _dequantize_scaled(*value) if isinstance(value, tuple) else value
                    load_dense_weight(layer, attr, dense_value, compute_dtype, work_device=quantize_device)
                    del dense_value  # before the next tensor is read: one dense weight at a time
            else:
                dense_value = _dequantize_scaled(*value) if isinstance(value, tuple) else value
                _assign(model, key, dense_value.to(_target_dtype(model, key, dense_value.dtype, dense)))
            read_since_trim += codes.numel() * codes.element_size()
            del value, codes
            if read_since_trim >= _TRIM_EVERY:
                return_freed_heap()
                read_since_trim = 0
        del source
    _tie_weights(model, expected, seen)
    _refuse_mismatch(model, where, folder, sorted(set(expected) - seen), unexpected, mismatched)
    return model.requires_grad_(False).eval(), report


def _tie_weights(model: nn.Module, expected: dict, seen: set[str]) -> None:
    """transformers models tie some weights after loading (T5's encoder.embed_tokens is its
    `shared` embedding; SmolLM3's head is its token table where its config ties them) and their
    files hold only one name: the other becomes the same tensor. A tied Linear is never quantized
    (skip_rules.py), so the tensor it gets is its own weight's, as the plan's skeleton ties it."""
    for alias, source in tied_weight_keys(model).items():
        if alias not in expected or source not in expected:
            continue
        if source in seen and alias not in seen:
            target, origin = alias, source
        elif alias in seen and source not in seen:
            target, origin = source, alias
        else:
            continue
        module_name, _, attr = target.rpartition(".")
        origin_module, _, origin_attr = origin.rpartition(".")
        setattr(model.get_submodule(module_name), attr, getattr(model.get_submodule(origin_module), origin_attr))
        seen.add(target)


def _refuse_mismatch(model: nn.Module, where: str, folder: Path, missing: list[str], unexpected: list[str],
                     mismatched: list[str]) -> None:
    problems = []
    for label, names in (("missing", missing), ("unexpected", unexpected), ("mismatched", mismatched)):
        if names:
            shown = ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")
            problems.append(f"{label} keys: {shown}")
    if problems:
        raise ModelLoadError(
            f"{where}: the checkpoint in {folder} does not fit {type(model).__name__} "
            "(refusing to initialise weights at random): " + "; ".join(problems)
        )
    left_on_meta = [name for name, tensor in _tensors(model) if tensor.is_meta]
    if left_on_meta:  # a quantized layer whose weight never arrived, or a buffer no file holds
        raise ModelLoadError(f"{where}: no weights for {', '.join(left_on_meta[:8])} in {folder}")


def _tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for name, module in model.named_modules():
        tensors = module.offload_tensors() if isinstance(module, QuantizedLinear) else {
            **dict(module.named_parameters(recurse=False)), **dict(module.named_buffers(recurse=False))}
        for attr, tensor in tensors.items():
            yield f"{name}.{attr}" if name else attr, tensor
