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


def _round_bits_in_place(values: torch.Tensor) -> torch.Tensor:
    """`values` (float32, contiguous) rounded stochastically in place: afterwards its low 16 bits are
    zero, so casting it to bfloat16 is exact. Uses the device's default generator (saved in
    backups with the other random states, so a resumed run draws the same noise).

    Scratch memory is the noise (4 bytes a value) and a NaN mask (1 byte), no float32 copies: this
    runs on the largest weight of the model (~30M values in SD1.5) inside the training step.
    Infinities keep their bit pattern by themselves (their low 16 bits are zero, the noise is below
    2^16, so nothing carries); a NaN could round to an infinity and is put back."""
    nan = torch.isnan(values)
    bits = values.view(torch.int32)
    # -65536 is 0xFFFF0000: keep the sign, exponent and the 7 mantissa bits bfloat16 has
    # (as a 0-dim tensor: a plain int takes another overload that some backends lack; see tests/fake_device.py)
    bits.add_(torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=bits.device))
    bits.bitwise_and_(torch.tensor(-65536, dtype=torch.int32))
    return values.masked_fill_(nan, float("nan"))


def stochastic_round_to_bfloat16(values: torch.Tensor) -> torch.Tensor:
    """`values` (float32) rounded stochastically to bfloat16 (values is left as it was)."""
    return _round_bits_in_place(values.clone(memory_format=torch.contiguous_format)).to(torch.bfloat16)


def copy_stochastically_(target: torch.Tensor, values: torch.Tensor) -> None:
    """target (bfloat16) = values (float32) rounded stochastically. `values` is scratch: it is left
    holding the rounded values (the stepper's float32 copy, thrown away right after)."""
    target.copy_(_round_bits_in_place(values if values.is_contiguous() else values.contiguous()))
