"""Where a module's forward computes, which is not always where its first parameter sits.

transformers' `model.device` is its first parameter's device. A frozen text encoder whose token
table waits on the host (modules/offload/host_tables.py) has that table first (T5's `shared`,
CLIP's `token_embedding`, a decoder's `embed_tokens`) on the CPU while everything else computes on
the train device; the table's lookup marks itself with the device it sends its rows to, and that
is the answer here. Families ask this to choose where token ids and masks go.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

# set on a token lookup whose table stays on the host: the device its looked-up rows go to
ROWS_DEVICE = "host_table_rows_device"


def compute_device(module: nn.Module) -> torch.device:
    """The device `module` computes on: where a host-side token table of it sends its rows, else
    its first parameter's (or buffer's) device, as transformers' `.device` answers."""
    for child in module.modules():
        target = child.__dict__.get(ROWS_DEVICE)
        if target is not None:
            return target
    first = next(itertools.chain(module.parameters(), module.buffers()), None)
    return first.device if first is not None else torch.device("cpu")
