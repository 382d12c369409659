"""The base-precision policy: which `weight_dtype` each model part's base weights are stored in.

`resolve_base_precision()` turns the config's requests (`model.parts.<part>.weight_dtype`) into a
concrete mode per part. It is a pure function of its arguments: no I/O and no device calls, so
the trainer, `launch.py info`, the GUI and the tests all get the same answer for the same machine
description (`Capabilities`, from capabilities.detect_capabilities()).

Requests
--------
`requested` is a mapping part -> mode (so auto can be per part: `{"unet": "auto", "vae":
"float32"}`), or one mode name applied to every part in `part_sizes`. The model is exactly the
parts in `requested`; other keys of `part_sizes` are ignored.

- an explicit mode passes through if it works with these capabilities (capabilities.mode_support);
  otherwise ValueError, one line per bad part, each naming `model.parts.<part>.weight_dtype` and
  why ("int8 needs a working torchao ..."). A mode that works only through its slow fallback
  (W8A8 without its kernel) passes with a warning in the plan.
- auto is resolved per part by the table below.

auto: the decision table
------------------------
Sizes are bytes of base weights: parameter count x the mode's bytes per parameter (its entry in
weight_modes.py: float32 4, bfloat16/float16 2, 8-bit modes ~1.01 with their scales, nf4 0.53 with
double quant). The ladder below is the entries' `auto_tier` / `auto_preference`; a mode without a
tier (float16, w8a8_fp8, modes registered without one) is never picked by auto.
The budget is HEADROOM (0.8) x free memory of the train device; the other 20% is left for
activations, the adapter, optimizer state and the allocator's slack. Parts with an explicit
mode count at that mode.

"Big" parts are those holding >= 15% (SMALL_PART_SHARE) of the model's parameters: the denoiser
(UNet / transformer) and, in families like Flux, a large text encoder. If no part reaches 15%
every part counts as big. Small parts (VAE, CLIP text encoders) always stay dense: they save
little and quantizing a VAE visibly hurts the latents it encodes.

    | what fits in 0.8 x free memory       | big auto parts                            | small auto parts |
    |--------------------------------------|-------------------------------------------|------------------|
    | everything dense                     | dense                                     | dense            |
    | big parts at 8-bit                   | 8-bit: int8 > float8 > w8a8_int8          | dense            |
    | big parts at nf4                     | nf4 (only if bitsandbytes works)          | dense            |
    | nothing                              | the smallest that works (nf4, else 8-bit) | dense            |
    |                                      | -> plan.fits False + a warning            |                  |

- dense is bfloat16; float32 only where a bfloat16 Linear does not run on the device. float16 is
  never picked by auto: without loss scaling its range overflows in training (SD's VAE is the
  well-known case), so it stays an explicit choice.
- big parts step down one at a time, largest first, and all of them go to 8-bit before any goes
  to nf4 (8-bit on a text encoder costs less quality than nf4 on the denoiser).
- 8-bit prefers int8 (torchao weight-only, well tested for training), then float8 (LinearFp8,
  needs only the float8 dtype), then w8a8_int8, which always works (dequantize fallback) but
  also rounds activations, so it is the last resort rather than a default.
- nothing fits: the smallest plan is still returned (with layer offloading, `offload_fraction`,
  the part can still train) and `plan_base_precision()` says so: `fits` False and a warning naming
  the bytes needed and the budget. `resolve_base_precision()` returns only the modes; callers
  that must report the problem use `plan_base_precision()`.
- free memory unknown (None, an unknown device type): auto parts get dense with a warning.
- sizes are nominal: layers kept dense (convolutions, `quantize_skip`, the model's own keep lists)
  make the real footprint of a quantized part somewhat larger; the headroom absorbs part of that.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from modules.quantization.capabilities import Capabilities, mode_support
from modules.quantization.weight_modes import BytesPerParameter, get_weight_mode, weight_mode_names

HEADROOM = 0.8
SMALL_PART_SHARE = 0.15
# a live view of the registry: each mode's WeightMode.bytes_per_parameter
BYTES_PER_PARAMETER = BytesPerParameter()


def auto_ladder(support: Mapping) -> list[str]:
    """auto's choices, cheapest in quality first: per tier of the registry (0 dense, 1 8-bit, 2
    4-bit) the preferred mode that works here; a tier with no working mode is left out."""
    ladder = {}
    for name in weight_mode_names():
        mode = get_weight_mode(name)
        if mode.auto_tier is None or not support[name].works:
            continue
        best = ladder.get(mode.auto_tier)
        if best is None or mode.auto_preference < get_weight_mode(best).auto_preference:
            ladder[mode.auto_tier] = name
    return [ladder[tier] for tier in sorted(ladder)]


@dataclass(frozen=True)
class PrecisionPlan:
    modes: dict[str, str]  # part -> concrete mode (never "auto")
    estimated_bytes: int  # base weights of all parts at these modes (parts without a size: 0)
    budget_bytes: int | None  # HEADROOM x free memory; None when free memory is unknown
    fits: bool | None  # estimated <= budget; None when free memory or a part's size is unknown
    warnings: tuple[str, ...]


def _config_path(part: str) -> str:
    return f"model.parts.{part}.weight_dtype"


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def plan_base_precision(requested: str | Mapping[str, str], family: str, part_sizes: Mapping[str, int],
                        free_memory: int | None, capabilities: Capabilities) -> PrecisionPlan:
    """The concrete mode per part, the estimated footprint and whether it fits (see the module doc)."""
    parts = dict.fromkeys(part_sizes, requested) if isinstance(requested, str) else dict(requested)
    support = mode_support(capabilities)

    errors = []
    for part, mode in parts.items():
        if mode == "auto":
            continue
        if mode not in support:
            known = ", ".join(weight_mode_names())
            errors.append(f"{_config_path(part)}: unknown mode {mode!r} (known: {known}, auto)")
        elif not support[mode].works:
            errors.append(f"{_config_path(part)}: {mode} does not work on this machine: {support[mode].why}")
    auto_parts = [part for part, mode in parts.items() if mode == "auto"]
    if auto_parts:
        # auto weighs every part against the budget, so every part needs a size, not just the auto ones
        errors += [f"{_config_path(part)}: auto needs the part's parameter count and {family} gives none for {part!r}"
                   for part in parts if part not in part_sizes]
    if errors:
        raise ValueError("\n".join(errors))

    warnings = []
    for part, mode in parts.items():
        if mode != "auto" and support[mode].fast_kernel is False:
            warnings.append(f"{_config_path(part)}: {mode} runs here through its {support[mode].why}; "
                            "it saves memory but not time")

    dense, *lower_tiers = auto_ladder(support)  # float32 always works: the dense tier is never empty

    modes = {part: (dense if mode == "auto" else mode) for part, mode in parts.items()}

    def estimate() -> int:
        return int(sum(part_sizes.get(part, 0) * BYTES_PER_PARAMETER[mode] for part, mode in modes.items()))

    budget = None if free_memory is None else int(HEADROOM * free_memory)
    if auto_parts and budget is None:
        warnings.append(f"{family}: free memory on {capabilities.device} is unknown; auto parts stay {dense}")
    elif auto_parts:
        total = sum(part_sizes[part] for part in parts)
        big = [part for part in auto_parts if part_sizes[part] >= SMALL_PART_SHARE * total]
        if not any(part_sizes[part] >= SMALL_PART_SHARE * total for part in parts):
            big = list(auto_parts)  # no dominant part: everything is fair game
        big.sort(key=lambda part: (-part_sizes[part], part))  # largest first; names break ties stably
        for tier in lower_tiers:
            for part in big:
                if estimate() <= budget:
                    break
                modes[part] = tier

    estimated = estimate()
    sizes_known = all(part in part_sizes for part in parts)
    fits = None if budget is None or not sizes_known else estimated <= budget
    if fits is False:
        warnings.append(
            f"{family}: the base weights need ~{_gib(estimated)} at the smallest precision that works here, "
            f"more than {HEADROOM:.0%} of the {_gib(free_memory)} free on {capabilities.device} ({_gib(budget)}); "
            "offload layers to the temp device (offload_fraction) or free some memory"
            if auto_parts else
            f"{family}: the base weights need ~{_gib(estimated)}, more than {HEADROOM:.0%} of the "
            f"{_gib(free_memory)} free on {capabilities.device} ({_gib(budget)})")
    return PrecisionPlan(modes, estimated, budget, fits, tuple(warnings))


def resolve_base_precision(requested: str | Mapping[str, str], family: str, part_sizes: Mapping[str, int],
                           free_memory: int | None, capabilities: Capabilities) -> dict[str, str]:
    """part -> concrete weight_dtype (never "auto"). Raises ValueError naming
    `model.parts.<part>.weight_dtype` for a mode that does not work here. Whether the result fits
    (and why not) is in `plan_base_precision()`, which this wraps."""
    return plan_base_precision(requested, family, part_sizes, free_memory, capabilities).modes
