"""How many bytes a run's backups and saved files will take, known before the model loads.

How the estimate is made (the preflight refuses a run whose disk cannot hold it):
- The adapter: the trained parts' weight shapes come from their checkpoint headers (no weight is
  read). The layers the config's layer preset or filter selects get one real adapter each of
  the configured type, rank and dtype, built once per distinct shape on an uninitialised base
  layer; its tensors are what a backup and a saved file hold. A single file in the original
  layout names its layers otherwise than the presets expect: there every Linear-shaped weight of
  the part counts (an overestimate of about a third for attention+MLP presets).
- The optimizer: one step of the configured optimizer on a LoRA-sized tensor says how many
  bytes of state it keeps per trained parameter (8 for AdamW, ~2.2 for AdamW8bit, 12 for
  Prodigy, ~0.3 for Adafactor...); the EMA keeps a float32 copy.
- A backup is adapter + optimizer state + EMA. `backup.rolling_count` of them stay, and the
  next is written before the oldest goes: rolling_count + 1 at once (one when backups are off:
  a stop still writes one). Saves every `save_every` stay (workspace/save/), each one adapter
  file in output.dtype, and the final output is one more.
Not counted: the latent and text cache (its size depends on the images and the family's
encoders) and tensorboard logs, both small next to the above for adapter training.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
from torch import nn

from modules.config.train_config import TrainConfig
from modules.util.torch_utils import dtype_of

# 2-D weights that are embedding tables, not Linear layers (CLIP, T5, Qwen names)
_EMBEDDING = re.compile(r"(token_embedding|position_embedding|embed_tokens|relative_attention_bias|^shared)$")
_SCALES = (".scale_weight", ".scale_input")
_BACKUP_OVERHEAD = 1 << 16  # config.json, file headers, the scheduler and RNG states


@dataclass(frozen=True)
class AdapterSize:
    parameters: int  # trained parameters (what the optimizer keeps state for)
    elements: int  # elements of the saved tensors (parameters and buffers such as alpha)
    nbytes: int  # bytes of the saved tensors in adapter.dtype


@dataclass(frozen=True)
class PlannedBytes:
    backups: int  # in workspace_dir/backup, at the most
    backup_count: int
    saves: int  # in workspace_dir/save
    save_count: int
    output: int  # at output.path


def trained_parts(config: TrainConfig, family) -> list[str]:
    return [name for name, part in config.model.parts.items() if part.train and family.spec(name).adapter_prefix]


def adapter_size(config: TrainConfig, family) -> AdapterSize | None:
    """The adapter this config trains, measured as described above; None where a part's weights are
    a pickled .bin file (no header to read shapes from)."""
    adapter = config.adapter
    if adapter.layer_filter:
        patterns, with_conv = [re.compile(p) for p in adapter.layer_filter], True
    else:
        regexes, with_conv = family.layer_presets[adapter.layer_preset]
        patterns = [re.compile(p) for p in regexes]
    measured: dict[tuple[str, tuple[int, ...]], AdapterSize] = {}
    parameters = elements = nbytes = 0
    for part in trained_parts(config, family):
        shapes = _weight_shapes(family, part)
        if shapes is None:
            return None
        layers = {name: shape for name, shape in shapes.items()
                  if (len(shape) == 2 and not _EMBEDDING.search(name)) or (with_conv and len(shape) == 4)}
        chosen = [shape for name, shape in layers.items() if any(p.search(f"{part}.{name}") for p in patterns)]
        if not chosen and family.from_single_file(part):
            chosen = list(layers.values())
        for shape in chosen:
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

        stream = family.single_file_stream()
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


def optimizer_state_bytes_per_parameter(config: TrainConfig) -> float:
    """Bytes of optimizer state per trained parameter, from one real step of the configured optimizer."""
    from modules.optim.optimizers import build_optimizer

    parameter = nn.Parameter(torch.zeros(16, 768))  # a rank-16 LoRA factor of a 768-wide layer
    try:
        optimizer = build_optimizer(config.optimizer, [{"params": [parameter], "lr": config.optimizer.lr,
                                                        "name": "size-estimate"}])
        parameter.grad = torch.full_like(parameter, 1e-3)
        optimizer.step()
    except Exception:  # noqa: BLE001  (an optimizer that cannot step on the CPU: assume Adam's two moments)
        return 8.0
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in state) / parameter.numel()


def planned_bytes(config: TrainConfig, adapter: AdapterSize, steps: int | None) -> PlannedBytes:
    """What the run writes at the most, for an adapter of `adapter`'s size and about `steps`
    optimizer steps in all (None: unknown)."""
    schedule = config.schedule
    backup = adapter.nbytes + int(adapter.parameters * optimizer_state_bytes_per_parameter(config))
    if config.ema.enabled:
        backup += adapter.parameters * 4  # the float32 average
    backup_count = config.backup.rolling_count + 1 if schedule.backup_every.value > 0 else 1
    save_count = _count(schedule.save_every.value, schedule.save_every.unit, steps, schedule.epochs)
    one_file = adapter.elements * torch.empty((), dtype=dtype_of(config.output.dtype)).element_size()
    return PlannedBytes(backups=backup_count * (backup + _BACKUP_OVERHEAD), backup_count=backup_count,
                        saves=save_count * one_file, save_count=save_count, output=one_file)


def _count(every: float, unit: str, steps: int | None, epochs: int) -> int:
    if every <= 0:
        return 0
    if unit == "epochs":
        return math.floor(epochs / every)
    if unit == "steps" and steps is not None:
        return math.floor(steps / every)
    return 1  # minutes (or steps unknown): how many depends on the machine's speed


def planned_steps(config: TrainConfig, images_per_epoch: int) -> int:
    """Optimizer steps of the run: max_steps, or the epochs' batches (every resolution trains each image)."""
    schedule = config.schedule
    if schedule.max_steps:
        return schedule.max_steps
    samples = images_per_epoch * len(config.data.resolutions)
    per_epoch = math.ceil(math.ceil(samples / schedule.batch_size) / schedule.gradient_accumulation)
    return schedule.epochs * max(per_epoch, 1)


def describe(nbytes: int | float) -> str:
    value, unit = float(nbytes), "bytes"
    for bigger in ("KiB", "MiB", "GiB", "TiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{value:.0f} {unit}" if unit == "bytes" else f"{value:.1f} {unit}"
