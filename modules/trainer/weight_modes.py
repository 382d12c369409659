"""Each part's storage mode for this machine: "auto" resolved, and a mode that cannot work here
refused before anything is loaded (modules/quantization/policy.py has the table)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from modules.config.errors import ConfigError
from modules.quantization.capabilities import detect_capabilities
from modules.quantization.policy import plan_base_precision
from modules.quantization.replace import DENSE_MODES

if TYPE_CHECKING:
    from modules.trainer.generic_trainer import GenericTrainer


def resolve_weight_modes(trainer: GenericTrainer) -> dict[str, str]:
    """Each part's storage mode for this machine: "auto" resolved, and a mode that cannot work
    here refused before anything is loaded (policy.py has the table)."""
    requested = {name: part.weight_dtype for name, part in trainer.config.model.parts.items()}
    if all(mode in DENSE_MODES for mode in requested.values()):
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
