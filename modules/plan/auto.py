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
                      vram: int | None, resting: tuple[str, ...] = (), tables: tuple[str, ...] = ()) -> dict[str, float]:
    """Each part's offload fraction: the config's, or for auto the smallest share (in STEPs) whose
    parking brings the weights (with a fine-tune's state) under the budget left by the rest; 0 with
    no budget. The activations, gradients and adapters are left to the other parts of the plan: a
    fraction that leaves too little room for them shows in the verdict. `resting`: parts only
    sampling runs (family.resting_parts), wholly on the host while training: 1.0. `tables`: the parts
    whose token table stays on the host (offload/host_tables.py host_table_parts): its bytes are not
    on the device, so they are neither in the budget nor in what parking must make room for."""
    fractions = {}
    for name, part in config.model.parts.items():
        fraction = part.offload_fraction
        fractions[name] = 1.0 if name in resting else 0.0 if fraction == "auto" else float(fraction)
    autos = [name for name, part in config.model.parts.items() if part.offload_fraction == "auto"
             and name not in resting]
    if not autos or vram is None:
        return fractions
    def on_device(name: str) -> int:  # its bytes but a host table's
        return sizes[name]["bytes"] - (sizes[name]["table"] if name in tables else 0)

    def cost(name: str) -> float:
        size = sizes[name]
        factor = 1.0
        if trained.get(name) == "weights" and size["bytes"]:
            factor += state_per_parameter * size["parameters"] / size["bytes"]
        return factor
    fixed = sum(on_device(n) * cost(n) * (1 - fractions[n]) for n in sizes if n not in autos)
    for name in sorted(autos, key=lambda n: -on_device(n)):
        others = fixed + sum(on_device(n) * cost(n) * (1 - fractions[n]) for n in autos if n != name)
        blocks = sizes[name]["blocks"]
        offloadable = sum(blocks) * cost(name)
        excess = on_device(name) * cost(name) - (vram - others)
        if excess <= 0 or offloadable <= 0:
            continue
        window = 2 * max(blocks) * cost(name)
        fractions[name] = min(1.0, math.ceil((excess + window) / offloadable / STEP - 1e-9) * STEP)
    return fractions


def resolve_auto_weight_modes(planner, config: TrainConfig, vram: int | None, ram: int | None,
                              gpu_class_name: str | None, ladder: list[str] | None = None,
                              ) -> tuple[TrainConfig, dict[str, dict]]:
    """`weight_dtype: auto` parts resolved through the plan: the fastest storage that fits. Dense
    (bfloat16) first; then the big parts (>= 15% of the model's bytes, largest first) one at a
    time to 8-bit, then to 4-bit (auto's ladder, as the precision policy steps); small parts stay
    dense. `ladder`: the dense mode then the lower tiers to try (a device's working modes:
    policy.auto_ladder); default bfloat16 and the registry's preferred 8- and 4-bit modes. No
    budget, or nothing fits: dense, or the smallest, said in `why`. Returns the config with the
    modes set and, per resolved part, {"value", "why"} for the plan's `auto`."""
    from modules.config.loading import build_config
    from modules.plan.fixes import lower_tiers

    autos = [name for name, part in config.model.parts.items() if part.weight_dtype == "auto"]
    if not autos:
        return config, {}
    dense_mode, *tiers = ladder or ["bfloat16", *lower_tiers()]
    base = config.model_dump(mode="json")
    dense = dict.fromkeys(autos, dense_mode)

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
    for tier in tiers:
        for name in big:
            steps.append({**steps[-1], name: tier})
    for modes in steps:
        candidate = with_modes(modes)
        if planner.plan(candidate, vram, ram, gpu_class_name).fits:
            text = ("everything fits dense" if modes == dense else
                    "the densest storage that fits the budget (big parts stepped down, largest first)")
            return candidate, why(modes, text)
    return with_modes(steps[-1]), why(steps[-1], "nothing fits: the smallest storage (park blocks: offload_fraction)")


# --- the step's shape: gradient_checkpointing: auto and schedule.batch_size: auto ------------------

def step_autos(config: TrainConfig) -> tuple[list[str], bool]:
    """(the parts with gradient_checkpointing: auto, whether schedule.batch_size is auto)."""
    parts = [name for name, part in config.model.parts.items() if part.gradient_checkpointing == "auto"]
    return parts, config.schedule.batch_size == "auto"


def forced_checkpointing(config: TrainConfig, name: str, parking_decided: bool = False) -> str | None:
    """Why part `name` must checkpoint whatever the plan says (None: it need not). A trained part
    with `offload_fraction: auto` parks only if the step needs it: with `parking_decided` the plan
    decides both (checkpointing off means parking nothing), else it is taken to park."""
    part = config.model.parts[name]
    if part.activation_offloading:
        return "activation offloading keeps the inputs that checkpointing saves"
    if part.train and part.offload_fraction != 0 and not (parking_decided and parks_if_needed(config, name)):
        return "a trained part with parked blocks recomputes each block in the backward pass"
    return None


def parks_if_needed(config: TrainConfig, name: str) -> bool:
    """A trained part whose parking and checkpointing are both auto: both follow the plan."""
    part = config.model.parts[name]
    return part.train and part.offload_fraction == "auto" and part.gradient_checkpointing == "auto"


def frugal_step(config: TrainConfig, in_step: set[str]) -> TrainConfig:
    """The config with its step autos at their smallest (checkpointing on in the step, batch 1): what
    the weight modes are resolved against, before the step's own autos are."""
    parts, batch = step_autos(config)
    if not parts and not batch:
        return config
    from modules.config.loading import build_config

    lines = [f"model.parts.{n}.gradient_checkpointing={'true' if n in in_step else 'false'}" for n in parts]
    return build_config([config.model_dump(mode="json")], lines + (["schedule.batch_size=1"] if batch else []))


def resolve_auto_step(planner, config: TrainConfig, in_step: set[str], vram: int | None, ram: int | None,
                      gpu_class_name: str | None) -> tuple[TrainConfig, dict[str, dict]]:
    """`gradient_checkpointing: auto` and `schedule.batch_size: auto` resolved through the plan to the
    fastest step that fits. Checkpointing costs a recomputed forward, so it stays off while the step
    fits without it: the largest batch of AUTO_BATCH_SIZES that fits with it off, else the largest
    with it on (the auto parts in the step: `in_step`, the denoiser and the trained parts; a part the
    step does not run never checkpoints, one that must (forced_checkpointing) always does). No device
    budget (the CPU): checkpointing off and batch 1; nothing fits: on, and batch 1. Returns the config
    with the values set and, per resolved field, {"value", "why"}."""
    from modules.config.limits import AUTO_BATCH_SIZES
    from modules.config.loading import build_config

    parts, batch_auto = step_autos(config)
    if not parts and not batch_auto:
        return config, {}
    base = config.model_dump(mode="json")
    fixed = {n: (forced_checkpointing(config, n, parking_decided=True)
                 or ("not in the training step" if n not in in_step else None)) for n in parts}
    switched = [n for n in parts if fixed[n] is None]  # what the plan decides
    # a trained part without checkpointing cannot park (its backward needs every block's weights):
    # with checkpointing off its `offload_fraction: auto` is 0, on it is left to resolve_auto_offload
    unparked_when_off = [n for n in switched if parks_if_needed(config, n)]

    def candidate(on: bool, batch: int) -> TrainConfig:
        values = {n: bool(forced_checkpointing(config, n, parking_decided=True)) for n in parts if fixed[n]}
        values.update({n: on for n in switched})
        lines = [f"model.parts.{n}.gradient_checkpointing={'true' if v else 'false'}" for n, v in values.items()]
        lines += [] if on else [f"model.parts.{n}.offload_fraction=0" for n in unparked_when_off]
        return build_config([base], lines + ([f"schedule.batch_size={batch}"] if batch_auto else []))

    def peak_and_fit(candidate_config: TrainConfig) -> tuple[int, bool]:
        plan = planner.plan(candidate_config, vram, ram, gpu_class_name)
        return plan.device_peak, bool(plan.fits)

    def largest_batch(on: bool) -> int | None:
        """The largest auto batch that fits (a fixed batch: it, if it fits), or None."""
        if not batch_auto:
            return config.schedule.batch_size if peak_and_fit(candidate(on, 0))[1] else None
        one, fits_one = peak_and_fit(candidate(on, 1))
        if not fits_one:
            return None
        two, _ = peak_and_fit(candidate(on, 2))
        # the step's activations grow with the batch: the larger sizes are tried where the line
        # through batch 1 and 2 says they fit, and each is planned before it is taken
        for size in sorted(AUTO_BATCH_SIZES, reverse=True):
            if size <= 2 or one + (size - 1) * (two - one) <= vram:
                if size == 1 or peak_and_fit(candidate(on, size))[1]:
                    return size
        return 1

    why: dict[str, dict] = {}
    if vram is None:
        on, batch, reason = False, 1, "no train-device budget known here (the CPU)"
    elif not switched and not batch_auto:  # every auto part is decided without the plan
        on, batch, reason = False, 1, ""
    else:
        on, batch, reason = False, largest_batch(False), ""
        if batch is None and switched:
            on, batch = True, largest_batch(True)
        if batch is None:
            on, batch, reason = bool(switched), 1, "nothing fits the budget"
    for name in parts:
        if fixed[name]:
            value, text = bool(forced_checkpointing(config, name, parking_decided=True)), fixed[name]
        else:
            value = on
            text = reason or ("the step fits without recomputing" if not on else
                              "without it the step does not fit the budget")
        why[f"model.parts.{name}.gradient_checkpointing"] = {"value": value, "why": text}
    if batch_auto:
        why["schedule.batch_size"] = {"value": batch, "why": reason or (
            f"the largest of {', '.join(map(str, AUTO_BATCH_SIZES))} that fits the budget")}
    if not on:
        for name in unparked_when_off:
            why[f"model.parts.{name}.offload_fraction"] = {
                "value": 0.0, "why": "the step fits without parking (gradient checkpointing off)"
                if vram is not None else "no train-device budget known here: nothing parked"}
    return candidate(on, batch), why


# --- offload_fraction: auto, against the whole step ----------------------------------------------

def resolve_auto_offload(planner, config: TrainConfig, vram: int | None, ram: int | None,
                         gpu_class_name: str | None) -> tuple[TrainConfig, dict[str, dict]]:
    """`offload_fraction: auto` parts resolved through the plan against the whole step: parking
    starts where the weights alone would fit (offload_fractions) and grows by STEP, on the auto part
    with the most bytes still on the device, until the step's activations, adapters, gradients and
    optimizer state fit too, or everything that can be parked is. Parking costs transfers each
    step, so no more is parked than that. No device budget: nothing parked. Returns the config with
    the fractions set and, per auto part, {"value", "why"}."""
    from modules.config.loading import build_config

    autos = [name for name, part in config.model.parts.items() if part.offload_fraction == "auto"]
    if not autos:
        return config, {}
    base = config.model_dump(mode="json")

    def with_fractions(fractions: dict[str, float]) -> TrainConfig:
        return build_config([base], [f"model.parts.{n}.offload_fraction={f:g}" for n, f in fractions.items()])

    def why(fractions, text):
        return {f"model.parts.{n}.offload_fraction": {"value": f, "why": text} for n, f in fractions.items()}

    if vram is None:
        nothing = dict.fromkeys(autos, 0.0)
        return with_fractions(nothing), why(nothing, "no train-device budget known here: nothing parked")
    sizes = planner.sizes(config, planner.weight_modes(config))["parts"]
    # (a trained part that parks recomputes its blocks: config validation refuses auto without checkpointing)
    parkable = [name for name in autos if sizes[name]["blocks"]]
    plan = planner.plan(config, vram, ram, gpu_class_name)
    fractions = {name: plan.parts[name].offload_fraction for name in autos}
    while True:
        candidate = with_fractions(fractions)
        plan = planner.plan(candidate, vram, ram, gpu_class_name)
        if plan.device_peak <= vram:
            text = ("the smallest share of the blocks that fits the budget, the step's activations included"
                    if any(fractions.values()) else "everything fits without parking")
            return candidate, why(fractions, text)
        growable = [name for name in parkable if fractions[name] < 1.0]
        if not growable:
            return candidate, why(fractions, "nothing fits the budget, even with every block parked")
        name = max(growable, key=lambda n: sizes[n]["bytes"] * (1 - fractions[n]))
        fractions[name] = min(1.0, round(fractions[name] + STEP, 6))


# --- sampling.vae_tiling: auto, last ---------------------------------------------------------------

def resolve_auto_vae_tiling(planner, config: TrainConfig, vram: int | None, ram: int | None,
                            gpu_class_name: str | None) -> tuple[TrainConfig, dict[str, dict]]:
    """`sampling.vae_tiling: auto` resolved against the plan of the config as the other autos left
    it (they were chosen against the tiled decode, phase_pass.planned_tiling): tiled only where the
    untiled sampling phase sets a device peak over the budget and tiling lowers it; a tiled decode
    costs time and can show seams, so it is not taken where the whole one fits. No budget (the
    CPU): untiled; no sample prompt: left as it is. Returns the config with the value set and {"value", "why"}."""
    from modules.config.loading import build_config

    if config.sampling.vae_tiling != "auto" or not any(p.enabled for p in config.sampling.prompts):
        return config, {}  # (without a sample prompt there is no decode to choose for)
    base = config.model_dump(mode="json")

    def choice(tiled: bool, why: str) -> tuple[TrainConfig, dict[str, dict]]:
        chosen = build_config([base], [f"sampling.vae_tiling={'true' if tiled else 'false'}"])
        return chosen, {"sampling.vae_tiling": {"value": tiled, "why": why}}

    if vram is None:
        return choice(False, "no train-device budget known here (the CPU)")
    whole = planner.plan(build_config([base], ["sampling.vae_tiling=false"]), vram, ram, gpu_class_name)
    sampling = whole.outside_step_phases.get("sampling")
    if whole.device_peak <= vram:
        return choice(False, "the untiled sample decode fits the budget")
    if sampling is None or sampling < whole.device_peak:
        return choice(False, "the peak over the budget is not sampling's: tiling would not lower it")
    tiled = planner.plan(build_config([base], ["sampling.vae_tiling=true"]), vram, ram, gpu_class_name)
    if tiled.device_peak >= whole.device_peak:
        return choice(False, "the decode is not what sets sampling's peak: tiling would not lower it")
    return choice(True, f"the untiled decode sets the peak ({whole.device_peak / 2**30:.2f} GiB, sampling) over the "
                        f"budget; tiled {tiled.device_peak / 2**30:.2f} GiB")
