"""`weight_dtype: auto`, `gradient_checkpointing: auto`, `schedule.batch_size: auto`,
`offload_fraction: auto` and `sampling.vae_tiling: auto` resolved for this run before anything loads, through the plan
(modules/plan/auto.py: the densest storage among the modes that work on the device, then the
fastest step that fits, then the least parking that fits it, activations included) against the
train device's free memory and the host's available RAM; the run's log says each choice and why.
Where no plan is made, `weight_dtype: auto` is left to the precision policy (trainer/weight_modes.py).

Where the device cannot say what is free (the CPU) the plan is not asked: checkpointing off where
nothing forces it, batch 1, and offload left to the placement's own auto (which parks nothing
without a free figure; a trained part with both auto parks nothing and does not recompute). A plan that cannot be made: the smallest step, and offload likewise left to
the placement's auto (the weights it measures as they land). With several processes rank 0 decides
and the others take its choice (one batch size for all, as the global batch needs). The plan made
here is handed to preflight's fit check, so the run plans once.
"""

from __future__ import annotations

from modules.config.train_config import TrainConfig


def resolve_planned_autos(config: TrainConfig, device, ranks, say) -> tuple[TrainConfig, dict | None]:
    """(the config with its step autos set, the plan they came from or None). `say(line)` gets one
    line per resolved field."""
    from modules.plan.auto import step_autos

    parts, batch = step_autos(config)
    if not parts and not batch and not offload_autos(config) and not weight_autos(config) \
            and not tiling_auto(config):
        return config, None
    plan, choices = None, None
    if ranks.main:
        plan, choices = _choices(config, device)
    if ranks.world > 1:
        choices = ranks.broadcast(choices)
    from modules.config.loading import build_config

    lines = [f"{path}={_text(choice['value'])}" for path, choice in choices.items()]
    resolved = build_config([config.model_dump(mode="json")], lines)
    for path, choice in choices.items():
        say(f"{path}: auto -> {_text(choice['value'])} ({choice['why']})")
    return resolved, plan


def _choices(config: TrainConfig, device) -> tuple[dict | None, dict[str, dict]]:
    from modules.plan.auto import forced_checkpointing, parks_if_needed, step_autos
    from modules.trainer.fit_check import available_ram, free_device_memory

    free = free_device_memory(device)
    unplanned, checkpoint = "no train-device budget known here (the CPU)", False
    if free is not None:
        from modules.plan.run_plan import plan_run

        try:
            plan = plan_run(config, free, available_ram(), weight_ladder=device_weight_ladder(device)).as_dict()
        except Exception as error:  # noqa: BLE001  (a config preflight refuses next, or a planner bug: said, not fatal)
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            unplanned, checkpoint = f"the plan could not be made ({first}): the smallest step", True
        else:
            return plan, {path: choice for path, choice in plan["auto"].items() if path == "schedule.batch_size"
                          or path == "sampling.vae_tiling"
                          or path.endswith((".gradient_checkpointing", ".offload_fraction", ".weight_dtype"))}
    parts, batch = step_autos(config)
    choices = {}
    for name in parts:
        # without a budget a trained part whose parking is auto too parks nothing, so need not recompute
        forced = forced_checkpointing(config, name, parking_decided=not checkpoint)
        choices[f"model.parts.{name}.gradient_checkpointing"] = {
            "value": bool(forced) or checkpoint, "why": forced or unplanned}
        if not forced and not checkpoint and parks_if_needed(config, name):
            choices[f"model.parts.{name}.offload_fraction"] = {"value": 0.0, "why": unplanned}
    if batch:
        choices["schedule.batch_size"] = {"value": 1, "why": unplanned}
    if tiling_auto(config):  # untiled: without a plan nothing says the decode does not fit
        choices["sampling.vae_tiling"] = {"value": False, "why": unplanned}
    return None, choices


def device_weight_ladder(device) -> list[str]:
    """The weight modes `weight_dtype: auto` may take on `device`, dense first: those that work
    there (a GPU without fp8 kernels never gets fp8)."""
    from modules.quantization.capabilities import detect_capabilities, mode_support
    from modules.quantization.policy import auto_ladder

    return auto_ladder(mode_support(detect_capabilities(device)))


def weight_autos(config: TrainConfig) -> list[str]:
    return [name for name, part in config.model.parts.items() if part.weight_dtype == "auto"]


def tiling_auto(config: TrainConfig) -> bool:
    """`sampling.vae_tiling: auto` with a sample prompt to decode (without one there is nothing to choose)."""
    return config.sampling.vae_tiling == "auto" and any(p.enabled for p in config.sampling.prompts)


def offload_autos(config: TrainConfig) -> list[str]:
    return [name for name, part in config.model.parts.items() if part.offload_fraction == "auto"]


def _text(value) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else f"{value:g}" if isinstance(value, float) \
        else str(value)
