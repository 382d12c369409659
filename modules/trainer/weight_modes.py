"""Each part's storage mode for this machine: "auto" resolved, and a mode that cannot work here
refused before anything is loaded (modules/quantization/policy.py has the table)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from modules.config.errors import ConfigError
from modules.quantization.capabilities import detect_capabilities
from modules.quantization.half_storage import other_half
from modules.quantization.policy import plan_base_precision
from modules.quantization.weight_modes import DENSE_MODE_NAMES
from modules.util.torch_utils import dtype_of

if TYPE_CHECKING:
    from modules.trainer.generic_trainer import GenericTrainer


def resolve_weight_modes(trainer: GenericTrainer) -> dict[str, str]:
    """Each part's storage mode for this machine: "auto" resolved, and a mode that cannot work
    here refused before anything is loaded (policy.py has the table)."""
    requested = {name: part.weight_dtype for name, part in trainer.config.model.parts.items()}
    train_dtype = dtype_of(trainer.config.train_dtype)
    for name, mode in requested.items():
        if other_half(mode, train_dtype):  # the load stores it so (half_storage.py says why)
            trainer.callbacks.on_warning(
                f"model.parts.{name}.weight_dtype: {mode} under train_dtype {trainer.config.train_dtype}: stored in "
                f"{trainer.config.train_dtype} (the same 2 bytes a parameter; autocast casts each of its matmul "
                f"weights to {trainer.config.train_dtype} anyway)")
    if all(mode in DENSE_MODE_NAMES for mode in requested.values()):
        return requested  # nothing to probe: dense storage works everywhere torch runs
    capabilities = detect_capabilities(trainer.device)
    sizes = trainer.family.part_parameters() if "auto" in requested.values() else {}
    try:
        plan = plan_base_precision(requested, trainer.family.name, sizes, capabilities.free_memory, capabilities)
    except ValueError as error:
        raise ConfigError(str(error).splitlines()) from None
    for warning in plan.warnings:
        trainer.callbacks.on_warning(warning)
    trainer.callbacks.on_status("base weights: " + ", ".join(f"{part} {mode}" for part, mode in plan.modes.items()))
    return plan.modes


def quantize_device(trainer: GenericTrainer) -> torch.device | None:
    """Where quantized layers are quantized at load: the train device, whatever accelerator the
    config names (bitsandbytes and torchao take milliseconds a layer there, the CPU 100-400 ns a
    parameter: tens of minutes for a FLUX.1 transformer); None on the CPU (nothing to gain)."""
    device = torch.device(trainer.device)
    return None if device.type in ("cpu", "meta") else device
