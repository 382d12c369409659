"""Stochastic rounding of float32 values to bfloat16.

bfloat16 keeps 8 bits of mantissa: near 1.0 its spacing is 2^-7, so a typical update (lr 1e-5
times a unit-sized Adam step) rounds back to the old weight every time and the weight never
moves. Rounding up with probability equal to the discarded remainder makes the rounding
unbiased: E[round(x)] = x, so small updates add up on average (as in OneTrainer and Nerogar's
bf16 stochastic rounding). The float32 bit pattern is bfloat16's plus 16 low bits; adding a
uniform random 16-bit integer to those bits and truncating rounds up exactly when the noise
carries into bit 16, i.e. with probability low_bits / 2^16.
"""

from __future__ import annotations

import torch


def stochastic_round_to_bfloat16(values: torch.Tensor) -> torch.Tensor:
    """`values` (float32) rounded stochastically to bfloat16, using the device's default generator
    (saved in backups with the other random states, so a resumed run draws the same noise)."""
    bits = values.contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=bits.device)
    # -65536 is 0xFFFF0000: keep the sign, exponent and the 7 mantissa bits bfloat16 has
    rounded = (bits + noise).bitwise_and_(-65536)
    finite = torch.isfinite(values)  # inf and nan keep their own bit patterns
    return torch.where(finite, rounded.view(torch.float32), values).to(torch.bfloat16)


def copy_stochastically_(target: torch.Tensor, values: torch.Tensor) -> None:
    """target (bfloat16) = values (float32) rounded stochastically."""
    target.copy_(stochastic_round_to_bfloat16(values))
