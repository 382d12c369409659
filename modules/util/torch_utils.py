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
    is not available for that device type.

    Without autocast's weight cache: it keeps the low-precision copy of every trainable float32
    weight until the forward pass ends, which with gradient checkpointing (nothing else of the
    forward kept) is 2 bytes a trained parameter of waste: a full fine-tune of float32 weights
    peaked in its forward because of it (benchmarks/README.md). Each weight is used once a
    forward, so the cache saves no casts; what the backward needs, the graph keeps anyway."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    try:
        return torch.autocast(device_type=device.type, dtype=dtype, cache_enabled=False)
    except RuntimeError:
        return contextlib.nullcontext()


def make_generator(device: torch.device, seed: int) -> torch.Generator:
    """A seeded generator on `device`, or on the CPU for backends that have none of their own
    (random draws then happen on the CPU and move; CUDA and the CPU keep their own streams)."""
    try:
        return torch.Generator(device=device).manual_seed(seed)
    except RuntimeError:
        return torch.Generator().manual_seed(seed)


def shape_only(tensor: torch.Tensor) -> bool:
    """True for the planner's tensors (meta or fake: modules/plan/), whose values cannot be read, so
    code that branches on a value takes the branch the plan counts."""
    from torch._subclasses.fake_tensor import is_fake

    return tensor.is_meta or is_fake(tensor)
