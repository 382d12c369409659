"""What a full fine-tune's backups and saved files hold, for the preflight's disk estimate (the
counterpart of adapters/adapter_size.py): a backup holds every trained weight in its storage
dtype (float32 or bfloat16; planned_bytes adds the optimizer state and EMA per trained parameter),
and each saved file is the whole model, every part, in output.dtype. Counts come from the
checkpoint headers (family.part_parameters), nothing is loaded.
"""

from __future__ import annotations

import torch

from modules.adapters.adapter_size import AdapterSize
from modules.util.torch_utils import dtype_of


def fine_tune_size(config, family, single_file: bool) -> AdapterSize:
    counts = family.part_parameters()
    trained = [name for name, part in config.model.parts.items()
               if part.train and family.spec(name).adapter_prefix]
    parameters = sum(counts[name] for name in trained)
    nbytes = sum(counts[name] * torch.empty((), dtype=dtype_of(config.model.parts[name].weight_dtype)).element_size()
                 for name in trained)
    # a single file holds every part in output.dtype; a diffusers folder writes the trained parts
    # and links the rest to the base's files (a copy where the disk differs: counted, to be safe)
    elements = sum(counts.values())
    return AdapterSize(parameters=parameters, elements=elements, nbytes=nbytes)
