"""Small torch helpers shared by the generic code: dtype names, device resolution, autocast."""

from __future__ import annotations

import contextlib

import torch

from modules.quantization.weight_modes import DenseDtypes


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype of a dense dtype name ("float32", "bfloat16", ...): the dense weight
    modes' dtypes (modules/quantization/weight_modes.py) are the one table of them."""
    try:
        return DenseDtypes()[name]
    except KeyError:
        raise KeyError(f"{name!r} is not a dense dtype (known: {', '.join(DenseDtypes())})") from None


def resolve_device(name: str) -> torch.device:
    """'auto' picks CUDA when present, then Apple's MPS, then the CPU; anything else is taken as given."""
    if name != "auto":
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def autocast(device: torch.device, dtype: torch.dtype):
    """Autocast to `dtype` on `device`, or nothing when computing in float32 or where autocast
    is not available for that device type."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    try:
        return torch.autocast(device_type=device.type, dtype=dtype)
    except RuntimeError:
        return contextlib.nullcontext()


def make_generator(device: torch.device, seed: int) -> torch.Generator:
    """A seeded generator on `device`, or on the CPU for backends that have none of their own
    (random draws then happen on the CPU and move; CUDA and the CPU keep their own streams)."""
    try:
        return torch.Generator(device=device).manual_seed(seed)
    except RuntimeError:
        return torch.Generator().manual_seed(seed)
