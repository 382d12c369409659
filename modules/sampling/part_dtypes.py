"""While sampling, every model part computes in the dtype training gives it.

diffusers pipelines pick one dtype for the latents from whatever they see first (SD: the text
encoder's embeddings; FLUX: the CLIP embeddings) and hand it to every part. With parts in
different dtypes (bf16 text encoder and UNet, float32 VAE: the shipped SD presets; a float32
text encoder beside a bf16 transformer) the first mismatched layer raises. Training casts at each
part's boundary to `family.compute_dtype(part)` (read from the config, never from a parameter,
which may be fp8 or uint8); during sampling the same cast sits on each part's entry modules as a
forward pre-hook, so no pipeline code needs to know the parts' dtypes. Where a pipeline itself
moves a part to another dtype (SDXL's float16 VAE decodes in float32), the family says so in
`sampling_dtype`.

Autocast would not do: it casts inside a float32 part too (the VAE the presets keep in float32
would decode in bf16), and it exists only for some device types.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import torch


def cast_floats(value, dtype: torch.dtype):
    """`value` with every floating tensor of two or more dimensions cast to `dtype`, through
    lists, tuples and dicts. Scalars and 1-d tensors (timesteps, guidance) pass unchanged: the
    models embed those at their own precision (a bf16 timestep 979 would read as 980).
    A container with nothing to cast is passed on itself, not a copy: a module may fill a list it
    is handed (the Wan VAE's causal cache of earlier frames, `feat_cache`), and a copy would lose
    what it wrote there (a 5-frame Wan sample decoded to 2 frames)."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() and value.dim() >= 2 and value.dtype != dtype:
            return value.to(dtype)
        return value
    if isinstance(value, (list, tuple)):
        items = [cast_floats(item, dtype) for item in value]
        return value if all(a is b for a, b in zip(items, value)) else type(value)(items)
    if isinstance(value, dict):
        items = {key: cast_floats(item, dtype) for key, item in value.items()}
        return value if all(items[key] is item for key, item in value.items()) else items
    return value


def _cast_inputs(dtype: torch.dtype, module, args, kwargs):
    return cast_floats(args, dtype), cast_floats(kwargs, dtype)


@contextmanager
def parts_in_compute_dtypes(family) -> Iterator[None]:
    """Inputs of each part's entry modules (`family.sampling_entry_modules`) are cast to the part's
    `family.sampling_dtype` (its compute dtype but where the pipeline moves it) until the block ends."""
    handles = []
    try:
        for part in family.parts:
            hook = partial(_cast_inputs, family.sampling_dtype(part))
            for module in family.sampling_entry_modules(part):
                handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
        yield
    finally:
        for handle in handles:
            handle.remove()
