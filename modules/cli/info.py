"""`launch.py info`: what this machine can train with: families, presets, devices, dtypes."""

from __future__ import annotations

import torch

from modules.config.presets import list_presets
from modules.model.registry import family_names, get_family_class


def _dtype_works(dtype: torch.dtype, device: str) -> bool:
    try:
        layer = torch.nn.Linear(8, 8).to(device=device, dtype=dtype)
        layer(torch.ones(2, 8, device=device, dtype=dtype)).sum().item()
        return True
    except (RuntimeError, TypeError):
        return False


def machine_info() -> dict:
    devices = ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    presets = list_presets()
    return {
        "torch": torch.__version__,
        "devices": {
            device: {
                "weight_dtypes": [name for name, dtype in
                                  (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16))
                                  if _dtype_works(dtype, device)],
                **({"name": torch.cuda.get_device_name(device),
                    "memory_gb": round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1)}
                   if device.startswith("cuda") else {}),
            }
            for device in devices
        },
        "families": {
            name: {
                "label": get_family_class(name).label,
                "presets": [p.name for p in presets if p.family == name],
            }
            for name in family_names()
        },
    }
