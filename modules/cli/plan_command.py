"""`launch.py plan --config F [--preset P] [--set k=v ...] [--vram SIZE] [--ram SIZE] [--gpu CLASS] [--json]`:
the memory and speed plan of a config (modules/plan/), as a table per part or as JSON."""

from __future__ import annotations

import re

from modules.errors import UserError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


class SizeError(UserError, ValueError):
    pass


def parse_size(text: str, option: str) -> int:
    """'16GiB', '12GB', '24000MB', '1.5TiB' or plain bytes -> bytes; SizeError naming `option`."""
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise SizeError(f"{option}: {text!r} is not a size (give a number with a unit: 16GiB, 12GB, 24000MB)")
    return int(float(match.group(1)) * _UNITS[unit])


def default_budget(config, read_vram: bool = True) -> tuple[int | None, int | None]:
    """The train device's free memory (where `read_vram`) and the host's available RAM, as `info` reads them."""
    from modules.quantization.capabilities import _system_memory, detect_capabilities
    from modules.util.torch_utils import resolve_device

    device = resolve_device(config.train_device)
    try:
        vram = None if device.type == "cpu" or not read_vram else detect_capabilities(device).free_memory
    except (RuntimeError, AssertionError) as error:  # planning for a GPU this machine lacks
        raise SizeError(f"train_device: {config.train_device!r} is not available here to read its free memory "
                        f"({str(error).strip() or type(error).__name__}); give --vram SIZE to plan for it") from None
    return vram, _system_memory()[1]


def _gib(n: float | None) -> str:
    return "?" if n is None else f"{n / 2**30:.2f}"


COLUMNS = ("weights", "trained", "gradients", "optimizer_state", "activations", "offload_window")
HEADERS = ("weights", "trained", "grads", "optim", "activ.", "window")


def format_plan(plan: dict) -> str:
    lines = [f"plan for {plan['family']} (GiB; train device / host)"]
    head = f"{'part':16} {'dtype':10} {'offload':>7} {'ckpt':>4} " + " ".join(f"{h:>7}" for h in HEADERS)
    lines.append(head + f" {'device':>8} {'parked':>8}")
    for name, part in plan["parts"].items():
        device = part["device"]
        lines.append(f"{name:16} {part['weight_dtype']:10} {part['offload_fraction']:7.2f} "
                     f"{'yes' if part['gradient_checkpointing'] else 'no':>4} "
                     + " ".join(f"{_gib(device[c]):>7}" for c in COLUMNS)
                     + f" {_gib(device['total']):>8} {_gib(part['parked']):>8}")
    budget, host, transfer = plan["budget"], plan["host"], plan["transfer"]
    lines.append(f"train device peak {_gib(plan['device']['peak'])} GiB of {_gib(budget['vram'])} GiB")
    phases = plan["device"].get("outside_step_phases") or {}
    if phases:  # caching and sampling, each its weights and activations: which sets the peak
        step = plan["device"]["step"]
        peak = max([("the training step", step), *phases.items()], key=lambda item: item[1])[0]
        lines[-1] += (f" (training step {_gib(step)} GiB; " + ", ".join(f"{name} {_gib(value)} GiB"
                                                                       for name, value in phases.items())
                      + f": set by {peak})")
    elif plan["device"].get("outside_step"):  # parts the step never runs: on the device only outside it
        lines[-1] += (f" (training step {_gib(plan['device']['step'])} GiB; caching and sampling "
                      f"{_gib(plan['device']['outside_step'])} GiB of weights)")
    lines.append(f"host: load peak {_gib(host['load_peak'])} GiB, training {_gib(host['train_peak'])} GiB "
                 f"(pinned {_gib(host['pinned'])} GiB) of {_gib(budget['ram'])} GiB")
    seconds = transfer["seconds_per_step"]
    lines.append(f"per step: {transfer['bytes_per_step'] / 2**30:.2f} GiB host<->device, "
                 f"{plan['flops_per_step'] / 1e12:.1f} TFLOP, ~{seconds:.2f} s on a {transfer['gpu_class']} "
                 "(estimated, not measured on a GPU)")
    for path, choice in plan["auto"].items():
        lines.append(f"auto: {path} -> {choice['value']} ({choice['why']})")
    for note in plan["notes"]:
        lines.append(f"note: {note}")
    verdict = {True: "fits", False: "does not fit", None: "no budget known: no verdict"}[plan["fits"]]
    lines.append(f"verdict: {verdict}")
    if plan["fits"] is False:
        lines += [f"  fix: {fix}" for fix in plan["fixes"]] or ["  no change found that fits"]
    return "\n".join(lines)


def run_plan_command(config, vram: str | None, ram: str | None, gpu: str | None, variant: str | None) -> dict:
    from modules.plan.gpu_classes import gpu_class
    from modules.plan.run_plan import plan_run

    try:
        gpu_class(gpu)
    except ValueError as error:
        raise SizeError(f"--gpu: {error}") from None
    vram_bytes = parse_size(vram, "--vram") if vram else None
    ram_bytes = parse_size(ram, "--ram") if ram else None
    if vram is None or ram is None:
        default_vram, default_ram = default_budget(config, read_vram=vram is None)
        vram_bytes = default_vram if vram is None else vram_bytes
        ram_bytes = default_ram if ram is None else ram_bytes
    return plan_run(config, vram_bytes, ram_bytes, gpu, variant=variant).as_dict()
