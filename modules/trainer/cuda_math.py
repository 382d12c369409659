"""How float32 matrix products run on a CUDA train device.

TF32 (float32 range, a 10-bit mantissa, on the tensor cores) runs float32 matmuls several times
faster on NVIDIA cards since Ampere; torch leaves it off for matmuls by default. `tf32: false` in
the config keeps full float32. Convolutions already use TF32 under torch's defaults
(cudnn.allow_tf32). set_float32_matmul_precision is a switch torch 2.11 and 2.13 both have; it
also sets the newer per-backend `torch.backends.cuda.matmul.fp32_precision` (tests check both).
"""

from __future__ import annotations

import torch


def configure_cuda_math(device: torch.device | str, tf32: bool) -> None:
    """On a CUDA `device`, turn TF32 float32 matmuls on (`tf32`) or off; elsewhere change nothing
    (the setting is process-wide: a run on another device keeps torch's default)."""
    if torch.device(device).type != "cuda":
        return
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
