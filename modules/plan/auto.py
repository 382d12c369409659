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


def resolve_auto_weight_modes(planner, config: TrainConfig, vram: int | None, ram: int | None,
                              gpu_class_name: str | None) -> tuple[TrainConfig, dict[str, dict]]:
    """`weight_dtype: auto` parts resolved through the plan: the fastest storage that fits. Dense
    (bfloat16) first; then the big parts (>= 15% of the model's bytes, largest first) one at a
    time to 8-bit, then to 4-bit (auto's ladder, as the precision policy steps); small parts stay
    dense. No budget, or nothing fits: dense, or the smallest, said in `why`. Returns the config
    with the modes set and, per resolved part, {"value", "why"} for the plan's `auto`."""
    from modules.config.loading import build_config
    from modules.plan.fixes import lower_tiers

    autos = [name for name, part in config.model.parts.items() if part.weight_dtype == "auto"]
    if not autos:
        return config, {}
    base = config.model_dump(mode="json")
    dense = {name: "bfloat16" for name in autos}

    def with_modes(modes: dict[str, str]) -> TrainConfig:
        return build_config([base], [f"model.parts.{n}.weight_dtype={m}" for n, m in modes.items()])

    def why(modes, text):
        return {f"model.parts.{n}.weight_dtype": {"value": m, "why": text} for n, m in modes.items()}

    if vram is None and ram is None:
        return with_modes(dense), why(dense, "no budget known: dense storage")
    sizes = planner.sizes(with_modes(dense), planner.weight_modes(with_modes(dense)))["parts"]
    total = sum(s["bytes"] for s in sizes.values())
    big = sorted((n for n in autos if sizes[n]["bytes"] >= 0.15 * total), key=lambda n: -sizes[n]["bytes"]) \
        or sorted(autos, key=lambda n: -sizes[n]["bytes"])
    steps = [dict(dense)]
    for tier in lower_tiers():
        for name in big:
            steps.append({**steps[-1], name: tier})
    for modes in steps:
        candidate = with_modes(modes)
        if planner.plan(candidate, vram, ram, gpu_class_name).fits:
            text = ("everything fits dense" if modes == dense else
                    "the densest storage that fits the budget (big parts stepped down, largest first)")
            return candidate, why(modes, text)
    return with_modes(steps[-1]), why(steps[-1], "nothing fits: the smallest storage (park blocks: offload_fraction)")
