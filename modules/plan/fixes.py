"""The smallest change that makes a plan fit, as `--set` lines, each verified by re-planning.

Tried in order of what they cost a run: park more of a part's blocks (offload_fraction up, in
tenths; a trained part gets gradient checkpointing with it, which offloading needs), then gradient
checkpointing on where it is off (with parking, if that alone is not enough), then the frozen big
parts' weights down auto's ladder (8-bit, then 4-bit), then the batch size halved. The first
candidate whose re-plan fits is the answer; the lines are what `--set` takes.
"""

from __future__ import annotations

from modules.config.loading import build_config
from modules.quantization.weight_modes import get_weight_mode, weight_mode_names

FRACTIONS = tuple(round(0.1 * i, 1) for i in range(1, 11))


def lower_tiers() -> list[str]:
    """auto's 8-bit and 4-bit choices (the preferred registered mode of each lower tier)."""
    best: dict[int, str] = {}
    for name in weight_mode_names():
        mode = get_weight_mode(name)
        if not mode.auto_tier:
            continue
        if mode.auto_tier not in best or mode.auto_preference < get_weight_mode(best[mode.auto_tier]).auto_preference:
            best[mode.auto_tier] = name
    return [best[tier] for tier in sorted(best)]


def _offload_lines(config, part: str, fraction: float) -> list[str]:
    lines = [f"model.parts.{part}.offload_fraction={fraction:g}"]
    part_config = config.model.parts[part]
    if part_config.train and part_config.gradient_checkpointing is not True:
        lines.append(f"model.parts.{part}.gradient_checkpointing=true")
    return lines


def candidates(config, planner, sizes: dict, family) -> list[list[str]]:
    parts = config.model.parts
    with_blocks = sorted((n for n in sizes if sizes[n]["blocks"]), key=lambda n: -sizes[n]["bytes"])
    out: list[list[str]] = []
    for part in with_blocks:
        current = parts[part].offload_fraction
        for fraction in FRACTIONS:
            if current == "auto" or fraction > current:
                out.append(_offload_lines(config, part, fraction))
    # (the text encoders too where the text is not cached: they run in every step, Planner.step_parts)
    step_parts = planner.step_parts(config)
    in_step = [n for n in with_blocks if n == family.denoiser_part or parts[n].train or n in step_parts]
    for part in in_step:
        if parts[part].gradient_checkpointing is not True:
            line = f"model.parts.{part}.gradient_checkpointing=true"
            out.append([line])
            out += [[line, f"model.parts.{part}.offload_fraction={f:g}"] for f in FRACTIONS
                    if parts[part].offload_fraction == "auto" or f > parts[part].offload_fraction]
    total = sum(s["bytes"] for s in sizes.values())
    big = [n for n in sorted(sizes, key=lambda n: -sizes[n]["bytes"]) if sizes[n]["bytes"] >= 0.15 * total]
    for mode in lower_tiers():
        frozen = [n for n in big if not parts[n].train or config.method.type != "fine_tune"]
        changed = [n for n in frozen if parts[n].weight_dtype != mode]
        for count in range(1, len(changed) + 1):
            out.append([f"model.parts.{n}.weight_dtype={mode}" for n in changed[:count]])
    batch = config.schedule.batch_size
    while batch > 1:
        batch //= 2
        out.append([f"schedule.batch_size={batch}"])
    return out


def find_fixes(planner, config, vram, ram, gpu_class_name) -> list[str]:
    """The `--set` lines of the first candidate that fits (empty: none found)."""
    from modules.plan.run_plan import trained_kinds

    modes = planner.weight_modes(config)
    sized = planner.sizes(config, modes)
    base = config.model_dump(mode="json")
    for lines in candidates(config, planner, sized["parts"], sized["family"]):
        try:
            changed = build_config([base], lines)
        except ValueError:  # a change the config refuses (a quantized fine-tuned part): not a fix
            continue
        if trained_kinds(changed, sized["family"]) != trained_kinds(config, sized["family"]):
            continue
        if planner.plan(changed, vram, ram, gpu_class_name).fits:
            return [f"--set {line}" for line in lines]
    return []
