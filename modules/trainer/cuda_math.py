"""How float32 matrix products run on a CUDA train device.

TF32 (a 10-bit mantissa on the tensor cores) makes float32 matmuls several times faster on every
NVIDIA card since Ampere, for an error well below what training noise is; torch leaves it off for
matmuls by default. `tf32: false` in the config keeps full float32. Convolutions already use TF32
under torch's defaults (cudnn.allow_tf32). set_float32_matmul_precision is the switch both torch
2.11 and 2.13 keep (the newer per-backend fp32_precision settings must not be mixed with it).
"""

from __future__ import annotations

import torch


def configure_cuda_math(device: torch.device | str, tf32: bool) -> None:
    """On a CUDA `device`, turn TF32 float32 matmuls on (`tf32`) or off; elsewhere change nothing
    (the setting is process-wide, and on the CPU "high" would let oneDNN lower float32 precision)."""
    if torch.device(device).type != "cuda":
        return
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
