"""An out-of-memory error on the train device, told as what to change.

torch's own message (CUDA: "Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 15.70 GiB
of which 1.20 GiB is free ...") says what was asked and what was free, but not which of the run's
settings would make it fit. `out_of_memory_error` keeps the first two and adds the config fields
that lower the train device's peak, each with its value in this run.
"""

from __future__ import annotations

import re
from types import TracebackType

import torch

from modules.config.train_config import TrainConfig
from modules.errors import UserError
from modules.quantization.weight_modes import get_weight_mode, is_weight_mode, weight_mode_names

_SIZE = r"([\d.]+ ?[KMGTP]?i?B)"
_ASKED = re.compile(r"Tried to allocate " + _SIZE)
_FREE = re.compile(r"of which " + _SIZE + " is free")
_TOTAL = re.compile(r"total capacity of " + _SIZE)



class OutOfMemory(UserError):
    """The train device ran out of memory; the message names what to change."""


def _gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB"


def _what_was_free(error: BaseException, device: torch.device) -> str:
    text = str(error)
    asked, free, total = _ASKED.search(text), _FREE.search(text), _TOTAL.search(text)
    parts = [f"asked for {asked.group(1)}" if asked else "asked for more than was free"]
    if free:
        parts.append(f"{free.group(1)} was free" + (f" of {total.group(1)}" if total else ""))
    elif device.type == "cuda" and torch.cuda.is_available():
        free_now, total_now = torch.cuda.mem_get_info(device)  # after the failed step let its tensors go
        parts.append(f"{_gib(free_now)} of {_gib(total_now)} is free now")
    return ", ".join(parts)


def _where(trainer, traceback: TracebackType | None) -> str:
    while traceback is not None:
        if traceback.tb_frame.f_code.co_name in ("sample", "sample_prompts"):
            return f"while sampling at step {trainer.step}"
        traceback = traceback.tb_next
    if getattr(trainer, "dataset", None) is None:
        return "while loading the model onto it and caching"
    return f"in training step {trainer.step + 1}"


def _smaller_weight_modes(current: str) -> str | None:
    """The registered weight modes that store fewer bytes a weight than `current`, by their share
    of its bytes (from each mode's own declaration: no mode is named here)."""
    if not is_weight_mode(current):  # (auto: the policy already picked what fits)
        return None
    own = get_weight_mode(current).bytes_per_parameter
    shares: dict[float, list[str]] = {}
    for name in weight_mode_names():
        size = get_weight_mode(name).bytes_per_parameter
        if size < own:
            shares.setdefault(round(size / own, 2), []).append(name)
    return "; ".join(f"{' or '.join(names)} store{'s' if len(names) == 1 else ''} {share:g}x its bytes"
                     for share, names in sorted(shares.items(), reverse=True)) or None


def fitting_fields(config: TrainConfig, has_blocks=lambda part: True) -> list[str]:
    """The settings that lower the train device's peak, with this run's values. Offloading and the
    weight modes are named for the parts with blocks (`has_blocks`: the family's checkpoint blocks;
    a VAE has none, and its convolutions are not quantized)."""
    fields = []
    for name, part in config.model.parts.items():
        if not has_blocks(name):
            continue
        at = f"model.parts.{name}"
        if part.offload_fraction != "auto" and part.offload_fraction < 1:
            fields.append(f"{at}.offload_fraction (now {part.offload_fraction}): raise it toward 1, or "
                          f"auto: that share of {name}'s blocks waits on temp_device")
        if part.train and not part.gradient_checkpointing:
            fields.append(f"{at}.gradient_checkpointing (now false): true keeps one block's activations, "
                          f"not all of them")
        smaller = _smaller_weight_modes(part.weight_dtype)
        if smaller:
            fields.append(f"{at}.weight_dtype (now {part.weight_dtype}): {smaller}")
    schedule, resolutions = config.schedule, config.data.resolutions
    if schedule.batch_size > 1:
        fields.append(f"schedule.batch_size (now {schedule.batch_size}): lower it, and raise "
                      f"schedule.gradient_accumulation to keep the effective batch")
    fields.append(f"data.resolution (now {', '.join(map(str, resolutions))}): activations grow with its "
                  f"square")
    if config.train_dtype == "float32":
        fields.append("train_dtype (now float32): bfloat16 halves the activations")
    return fields


def out_of_memory_error(error: BaseException, trainer) -> OutOfMemory:
    """The one message a training run's torch.OutOfMemoryError becomes."""
    device, family = trainer.device, getattr(trainer, "family", None)
    has_blocks = (lambda part: bool(family.checkpoint_blocks(part))) if getattr(family, "parts", None) else (
        lambda part: True)  # (before the model is loaded: every part)
    fields = "\n  ".join(fitting_fields(trainer.config, has_blocks))
    return OutOfMemory(f"out of memory on {device} {_where(trainer, error.__traceback__)}: "
                       f"{_what_was_free(error, device)}. To fit, change one or more of these settings:\n  {fields}")
