"""A dense part stored in one 16-bit float while training computes in the other (`weight_dtype:
float16` under `train_dtype: bfloat16`, as OneTrainer users keep an fp16 checkpoint under bf16
mixed precision) is stored in the train dtype.

Kept in float16, its tensors meet bfloat16 activations wherever autocast does not cast: the
CPU's group_norm refuses a float16 weight beside a bfloat16 input ("mixed dtype (CPU)"), and an op
autocast promotes (torch.cat of SDXL's float16 text embedding and its bfloat16 time embedding)
knows no float16 under bfloat16 autocast ("Unexpected floating ScalarType in
at::autocast::prioritize", CUDA's autocast as well as the CPU's). Sampling runs without autocast
(modules/sampling/part_dtypes.py), where a float16 Linear cannot take a bfloat16 input at all.
Stored in bfloat16 it costs the same 2 bytes a parameter, and its matmuls compute exactly as under
autocast, which casts every float16 matmul weight to bfloat16 each forward; the trainer says so.
"""

from __future__ import annotations

import torch

from modules.quantization.weight_modes import DENSE_DTYPES

HALF_DTYPES = (torch.float16, torch.bfloat16)


def other_half(mode: str, train_dtype: torch.dtype) -> bool:
    """The dense `mode` is a 16-bit float other than the 16-bit `train_dtype`."""
    stored = DENSE_DTYPES.get(mode)
    return stored in HALF_DTYPES and train_dtype in HALF_DTYPES and stored != train_dtype


def part_compute_dtype(mode: str, train_dtype: torch.dtype) -> torch.dtype:
    """The dtype a part computes in and (dense) is stored in: its dense mode's dtype; the train
    dtype for a quantized mode and for the other 16-bit float."""
    if mode not in DENSE_DTYPES or other_half(mode, train_dtype):
        return train_dtype
    return DENSE_DTYPES[mode]


def stored_dtype(mode: str, compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype a part's floating tensors are stored in when loaded in `mode` to compute in
    `compute_dtype` (part_compute_dtype's): a dense mode's own, but the other 16-bit float's
    tensors in `compute_dtype`; a quantized mode's unquantized tensors in `compute_dtype`."""
    return compute_dtype if other_half(mode, compute_dtype) else DENSE_DTYPES.get(mode, compute_dtype)
