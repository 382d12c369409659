"""What the plan decides for `auto` fields (the weight modes and offload fractions of the parts
that ask for auto), as pure functions of the sizes the planner measured."""

from __future__ import annotations

import math

from modules.config.train_config import TrainConfig

STEP = 0.05  # offload fractions are rounded up to this (as the trainer's own auto)


def planned_weight_modes(config: TrainConfig) -> dict[str, str]:
    """part -> concrete weight mode: an explicit mode as it is; auto as the densest mode of auto's
    ladder until the plan resolves it (resolve_auto)."""
    return {name: "bfloat16" if part.weight_dtype == "auto" else part.weight_dtype
            for name, part in config.model.parts.items()}


def offload_fractions(config: TrainConfig, sizes: dict, trained: dict[str, str], state_per_parameter: float,
                      vram: int | None) -> dict[str, float]:
    """Each part's offload fraction: the config's, or for auto the smallest share (in STEPs) whose
    parking brings the weights (with a fine-tune's state) under the budget left by the rest; 0 with
    no budget. The activations, gradients and adapters are left to the other parts of the plan: a
    fraction that leaves too little room for them shows in the verdict."""
    fractions = {}
    for name, part in config.model.parts.items():
        fraction = part.offload_fraction
        fractions[name] = 0.0 if fraction == "auto" else float(fraction)
    autos = [name for name, part in config.model.parts.items() if part.offload_fraction == "auto"]
    if not autos or vram is None:
        return fractions
    def cost(name: str) -> float:
        size = sizes[name]
        factor = 1.0
        if trained.get(name) == "weights" and size["bytes"]:
            factor += state_per_parameter * size["parameters"] / size["bytes"]
        return factor
    fixed = sum(sizes[n]["bytes"] * cost(n) * (1 - fractions[n]) for n in sizes if n not in autos)
    for name in sorted(autos, key=lambda n: -sizes[n]["bytes"]):
        others = fixed + sum(sizes[n]["bytes"] * cost(n) * (1 - fractions[n]) for n in autos if n != name)
        blocks = sizes[name]["blocks"]
        offloadable = sum(blocks) * cost(name)
        excess = sizes[name]["bytes"] * cost(name) - (vram - others)
        if excess <= 0 or offloadable <= 0:
            continue
        window = 2 * max(blocks) * cost(name)
        fractions[name] = min(1.0, math.ceil((excess + window) / offloadable / STEP - 1e-9) * STEP)
    return fractions
