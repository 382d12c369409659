"""Whether a run fits its train device, asked of the plan (modules/plan/) before the model loads:
preflight refuses a config whose planned peak is over the device's free memory, with the numbers
and the `--set` lines that make it fit, instead of an out-of-memory error minutes later.

Only where the device says how much is free (its torch module's `mem_get_info`: CUDA, the tests'
fake device with a capacity), and not where that is far more than the model can need (SURELY_FITS:
an H200 training SDXL is not planned here, so its start waits for no plan; the memory event's plan
is made beside the load instead: background_plan.py); on the CPU nothing is refused (its "device" memory is the host's, which the plan
cannot bound without knowing what else the machine runs).
"""

from __future__ import annotations

import torch

from modules.config.train_config import TrainConfig


def free_device_memory(device: torch.device) -> int | None:
    """Bytes free on `device` now, or None where the device cannot say (the CPU)."""
    if device.type == "cpu":
        return None
    module = getattr(torch, device.type, None)
    info = getattr(module, "mem_get_info", None)
    if not callable(info):
        return None
    try:
        return int(info(device)[0])
    except (RuntimeError, AssertionError):  # a device this torch lacks: preflight names train_device
        return None


def available_ram() -> int | None:
    import psutil

    return int(psutil.virtual_memory().available)


# a device with this many times the family's released float32 weights free is not planned: planning a
# real-width model costs up to a minute of CPU (modules/plan/: a fake training step), and no built-in
# setting needs that much room (activations at 1024 px, batch 4, stay well under 4x the weights)
SURELY_FITS = 8


def surely_fits(config: TrainConfig, free: int) -> bool:
    """Whether `free` bytes hold SURELY_FITS x the family's released weights in float32 (its
    nominal parameter counts): a run that cannot need planning."""
    from modules.config.families import get_family_class

    counts = getattr(get_family_class(config.model.family), "nominal_part_parameters", None) or {}
    return bool(counts) and free >= SURELY_FITS * 4 * sum(counts.values())


def fit_plan(config: TrainConfig, device: torch.device) -> dict | None:
    """The run's plan against the device's free memory and the host's available RAM, or None where
    the run is not planned (the device cannot say what is free, or it surely fits)."""
    free = free_device_memory(device)
    if free is None or surely_fits(config, free):
        return None
    from modules.plan.run_plan import plan_run

    return plan_run(config, free, available_ram()).as_dict()


def fit_problem(config: TrainConfig, device: torch.device, plan: dict | None = None) -> str | None:
    """One problem line (and its fixes below it) when the plan says the run does not fit, else None.
    `plan`: the run's plan made already against this device (its autos' resolution), else fit_plan's."""
    plan = plan if plan is not None else fit_plan(config, device)
    return refusal(plan, str(device)) if plan is not None and plan["fits"] is False else None


def refusal(plan: dict, device: str) -> str:
    """"train_device: the run does not fit ...": the planned peak against the budget, per part,
    the host's figures where they are what does not fit, and the fixes as `--set` lines."""
    gib = _gib
    peak, budget = plan["device"]["peak"], plan["device"]["budget"]
    parts = sorted(plan["parts"].items(), key=lambda item: -item[1]["device"]["total"])
    per_part = ", ".join(f"{name} {gib(part['device']['total'])}" for name, part in parts)
    if budget is not None and peak > budget:
        text = (f"train_device: the run does not fit on {device}: its planned peak is {gib(peak)}, "
                f"{gib(budget)} is free ({per_part})")
    else:
        text = f"train_device: the run does not fit: its planned device peak is {gib(peak)} ({per_part})"
    host, ram = plan["host"], plan["budget"].get("ram")
    host_peak = max(host["load_peak"], host["train_peak"])
    if ram is not None and host_peak > ram:
        text += (f"; the host needs {gib(host['load_peak'])} while loading and {gib(host['train_peak'])} while "
                 f"training, {gib(ram)} is available")
    fixes = plan.get("fixes") or []
    if fixes:
        return text + "; to fit, add:\n" + "\n".join(f"    {fix}" for fix in fixes)
    return text + "; no change of offloading, checkpointing or weight modes makes it fit here"


def _gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB"
