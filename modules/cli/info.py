"""`launch.py info [--json] [--device DEV]`: what this machine can train with: families, presets,
devices, and the base-weight precision modes that work on the train device (and whether
`compile: true` can compile each), with the one auto would pick for each family, and how
`sampling.vae_tiling: auto` and `offload_fraction: auto` resolve here. The GUI offers only the modes listed here."""

from __future__ import annotations

import torch

from modules.config.presets import list_presets
from modules.config.families import family_names, get_family_class
from modules.offload.planning import auto_offload_fraction
from modules.quantization.capabilities import (
    detect_capabilities,
    mode_support,
    working_modes,
)
from modules.quantization.compile_gate import compile_blocker
from modules.quantization.policy import (
    BYTES_PER_PARAMETER,
    HEADROOM,
    plan_base_precision,
)
from modules.quantization.weight_modes import DENSE_DTYPES
from modules.trainer.fit_check import free_device_memory
from modules.util.torch_utils import resolve_device


def _dtype_works(dtype: torch.dtype, device: str) -> bool:
    try:
        layer = torch.nn.Linear(8, 8).to(device=device, dtype=dtype)
        layer(torch.ones(2, 8, device=device, dtype=dtype)).sum().item()
        return True
    except (RuntimeError, TypeError):
        return False


def _train_device(name: str) -> torch.device:
    """The device `info` reports on; a device that cannot hold a tensor is the user's error."""
    try:
        device = resolve_device(name)
        torch.empty(1, device=device)
    except (RuntimeError, AssertionError, ValueError) as error:  # torch says "not compiled with CUDA" by assert
        raise ValueError(f"--device: {name!r} is not usable here: {error}") from None
    return device


def _compile_blocker(mode: str, works: bool, device: torch.device) -> str | None:
    """Why `compile: true` would be turned off for a part stored in `mode` on `device`, or None; the
    trainer asks the same gate. Quantized modes are probed computing in bfloat16 (what presets train
    in) where the device computes in it."""
    if not works:
        return f"{mode} does not work on {device}"
    dtype = DENSE_DTYPES.get(mode) or (torch.bfloat16 if _dtype_works(torch.bfloat16, str(device)) else torch.float32)
    return compile_blocker(mode, str(device), dtype)


def _auto_offload(modes: dict[str, str], sizes: dict[str, int], free_memory: int | None) -> dict[str, float]:
    """offload_fraction auto per part at these modes, from nominal sizes (a part's blocks are
    taken to hold all of its weights, which slightly overstates what can be parked)."""
    part_bytes = {part: int(sizes[part] * BYTES_PER_PARAMETER[mode]) for part, mode in modes.items()}
    total = sum(part_bytes.values())
    return {part: auto_offload_fraction(size, size, total - size, free_memory) for part, size in part_bytes.items()}


def _offload_auto(device: torch.device) -> dict:
    """How a run on `device` resolves `offload_fraction: auto`: through its plan against the free
    memory where the device says it (trainer/planned_autos.py: the least parking that fits the whole
    step, activations included), else left to the placement's own auto, which parks nothing."""
    free = free_device_memory(device)
    if free is None:
        return {"planned": False, "budget_bytes": None,
                "why": f"nothing parked: a run on {device.type} is not planned ({device.type} does not say what of "
                       "it is free for training); on a GPU it is resolved at train time by each run's plan against "
                       "the device's free memory: the least parking that fits the whole step (`launch.py plan "
                       "--vram` says per config)"}
    return {"planned": True, "budget_bytes": free,
            "why": "resolved at train time by each run's plan against the free memory: the least parking that "
                   "fits the whole step, activations included (`launch.py plan` says per config); per family "
                   "below, what the weights alone would need at auto's modes"}


def _vae_tiling_auto(device: torch.device) -> dict:
    """How a run on `device` resolves `sampling.vae_tiling: auto`: through its plan (per config, so
    not here) against the free memory where the device says it (the trainer's own free_device_memory,
    trainer/planned_autos.py), else untiled, no plan made."""
    free = free_device_memory(device)
    if free is None:
        return {"planned": False, "budget_bytes": None, "value": False,
                "why": f"untiled: a run on {device.type} is not planned (no train-device budget: {device.type} "
                       "does not say what of it is free for training), and auto resolves through the plan only "
                       "where the device says what is free"}
    return {"planned": True, "budget_bytes": free, "value": None,
            "why": "through each run's plan against the free memory: tiled only where the untiled sample decode "
                   "sets the peak over it and tiling lowers it (`launch.py plan` says per config)"}


def machine_info(train_device: str = "auto") -> dict:
    """Everything `info` reports, as JSON-ready data. Raises ValueError for an unusable device."""
    device = _train_device(train_device)
    capabilities = detect_capabilities(device)
    support = mode_support(capabilities)
    working = working_modes(capabilities)
    devices = ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    presets = list_presets()
    offload = _offload_auto(device)

    families = {}
    for name in family_names():
        family = get_family_class(name)
        sizes = getattr(family, "nominal_part_parameters", None) or {}
        entry = {"label": family.label, "presets": [p.name for p in presets if p.family == name],
                 # per family, because a family may one day rule a mode out; today all share the device's
                 "weight_dtypes": list(working)}
        if sizes:
            plan = plan_base_precision("auto", name, sizes, capabilities.free_memory, capabilities)
            entry["recommended"] = {"weight_dtype": plan.modes, "estimated_bytes": plan.estimated_bytes,
                                    "budget_bytes": plan.budget_bytes, "fits": plan.fits,
                                    "warnings": list(plan.warnings),
                                    # against what the trainer plans offload with (None on the CPU: nothing parked)
                                    "offload_fraction": _auto_offload(plan.modes, sizes, offload["budget_bytes"])}
        else:
            entry["recommended"] = None
        families[name] = entry

    return {
        "torch": torch.__version__,
        "devices": {
            device_name: {
                "weight_dtypes": [dtype_name for dtype_name, dtype in
                                  (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16))
                                  if _dtype_works(dtype, device_name)],
                **({"name": torch.cuda.get_device_name(device_name),
                    "memory_gb": round(torch.cuda.get_device_properties(device_name).total_memory / 2**30, 1)}
                   if device_name.startswith("cuda") else {}),
            }
            for device_name in devices
        },
        "train_device": capabilities.as_dict(),
        "weight_dtypes": {mode: {"works": s.works, "fast_kernel": s.fast_kernel, "how": s.why,
                                 "supports_compile": blocker is None, "compile_blocker": blocker}
                          for mode, s in support.items()
                          for blocker in [_compile_blocker(mode, s.works, device)]},
        "auto_headroom": HEADROOM,
        "vae_tiling_auto": _vae_tiling_auto(device),
        "offload_auto": offload,
        "families": families,
    }


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.1f} GiB"


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _auto_line(field: str, auto: dict) -> str:
    budget = f" ({_gib(auto['budget_bytes'])} free now)" if auto["planned"] else ""
    return f"  {field} auto{budget}: {auto['why']}"


def format_info(info: dict) -> str:
    """The human-readable `info` (the default; `--json` prints `info` itself)."""
    caps = info["train_device"]
    cc = caps["compute_capability"]
    lines = [
        f"torch {info['torch']}",
        (f"train device: {caps['device']} ({caps['device_name']}{f', sm_{cc[0]}{cc[1]}' if cc else ''}): "
         f"{_gib(caps['free_memory'])} free of {_gib(caps['total_memory'])}"),
        (f"  torchao int8: {_yes(caps['torchao_int8'])}   bitsandbytes nf4: {_yes(caps['bitsandbytes'])}   "
         f"float8 dtypes: {_yes(caps['float8_dtypes'])}   torch._int_mm: {_yes(caps['int_mm'])}   "
         f"torch._scaled_mm: {_yes(caps['scaled_mm'])}"),
        _auto_line("sampling.vae_tiling", info["vae_tiling_auto"]),
        _auto_line("offload_fraction", info["offload_auto"]),
        "",
        f"weight_dtype on {caps['device']}:",
    ]
    for mode, support in info["weight_dtypes"].items():
        state = "works" if support["works"] else "no"
        speed = {True: "fast kernel", False: "slow fallback", None: ""}[support["fast_kernel"]] if support["works"] else ""
        lines.append(f"  {mode:10s} {state:6s}{speed:14s} {support['how']}")
        if support["works"]:
            lines.append("             compile: " + ("yes" if support["supports_compile"]
                                                   else f"no ({support['compile_blocker']})"))
    lines += ["", "devices:"]
    for name, device in info["devices"].items():
        extra = f" ({device['name']}, {device['memory_gb']} GB)" if "name" in device else ""
        lines.append(f"  {name}{extra}: {', '.join(device['weight_dtypes'])}")
    lines += ["", "families:"]
    for name, family in info["families"].items():
        lines.append(f"  {name}: {family['label']}")
        lines.append(f"    presets: {', '.join(family['presets']) or '-'}")
        lines.append(f"    weight_dtype here: {', '.join(family['weight_dtypes'])}, auto")
        recommended = family["recommended"]
        if recommended:
            modes = ", ".join(f"{part}={mode}" for part, mode in recommended["weight_dtype"].items())
            lines.append(f"    auto on {caps['device']}: {modes} (~{_gib(recommended['estimated_bytes'])} of "
                         f"a {_gib(recommended['budget_bytes'])} budget)")
            lines += [f"    warning: {warning}" for warning in recommended["warnings"]]
            if info["offload_auto"]["planned"]:  # (unplanned, nothing is parked: the line above says so once)
                offload = {part: f for part, f in recommended["offload_fraction"].items() if f}
                lines.append("    offload_fraction auto, the weights alone: " + (
                    ", ".join(f"{p}={f:g}" for p, f in offload.items()) if offload else "0 (they fit)"))
    return "\n".join(lines)
