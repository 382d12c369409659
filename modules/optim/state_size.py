"""Bytes of optimizer state per trained parameter, for the disk and memory estimates made before
the model loads (modules/trainer/backup_size.py, modules/offload/planning.py): one step of the
configured optimizer on a LoRA-sized tensor says it (8 for AdamW, ~2.2 for AdamW8bit, 12 for
Prodigy, ~0.3 for Adafactor...).
"""

from __future__ import annotations

import torch
from torch import nn

from modules.config.train_config import TrainConfig


def optimizer_state_bytes_per_parameter(config: TrainConfig) -> float:
    """Bytes of optimizer state per trained parameter, from one real step of the configured optimizer."""
    from modules.optim.optimizers import build_optimizer

    parameter = nn.Parameter(torch.zeros(16, 768))  # a rank-16 LoRA factor of a 768-wide layer
    try:
        optimizer = build_optimizer(config.optimizer, [{"params": [parameter], "lr": config.optimizer.lr,
                                                        "name": "size-estimate"}])
        parameter.grad = torch.full_like(parameter, 1e-3)
        optimizer.step()
    except Exception:  # noqa: BLE001  (an optimizer that cannot step on the CPU: assume Adam's two moments)
        return 8.0
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in state) / parameter.numel()
