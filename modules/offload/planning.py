"""The `auto` offload fraction: the smallest share of a part's blocks to park so the train device
holds everything else with headroom."""

from __future__ import annotations

import math

from modules.config.method_configs import METHODS
from modules.quantization.weight_modes import get_weight_mode, is_weight_mode

HEADROOM = 0.8  # the share of free memory weights may take; the rest is activations and slack
STEP = 0.05  # fractions are rounded up to this, so small estimate errors do not matter


def auto_offload_fraction(part_bytes: int, offloadable_bytes: int, other_bytes: int,
                          free_memory: int | None, window_bytes: int = 0) -> float:
    """part_bytes: the part's weights; offloadable_bytes: those inside its blocks (what can be
    parked); other_bytes: what else lives on the train device (other parts, adapters);
    window_bytes: the parked blocks on the train device at once (the needed one and the prefetched
    ones), which parking must pay for too. Returns 0.0 where everything fits or free memory is
    unknown, at most 1.0."""
    if free_memory is None or offloadable_bytes <= 0:
        return 0.0
    budget = HEADROOM * free_memory - other_bytes
    excess = part_bytes - budget
    if excess <= 0:
        return 0.0
    return min(1.0, math.ceil((excess + window_bytes) / offloadable_bytes / STEP - 1e-9) * STEP)


def trained_bytes_factor(config, part: str) -> float:
    """Train-device bytes per weight byte of `part`: 1, or in a full fine-tune of it, 1 + its
    optimizer state per weight byte, since the state parks with its block (trained_tensors.py).
    The state is measured from one step of the configured optimizer (a bfloat16 weight stepped with
    stochastic rounding has float32 state, as measured)."""
    part_config = config.model.parts[part]
    if not METHODS.traits(config.method.type).trains_model_weights or not part_config.train:
        return 1.0
    from modules.optim.state_size import optimizer_state_bytes_per_parameter

    mode = part_config.weight_dtype  # a dense mode (the fine-tune's rules refuse the others)
    weight_bytes = get_weight_mode(mode).bytes_per_parameter if is_weight_mode(mode) else 4.0
    return 1.0 + optimizer_state_bytes_per_parameter(config) / weight_bytes
