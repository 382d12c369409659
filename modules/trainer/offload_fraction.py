"""A part's layer-offloading fraction: the config's, or for "auto" the share of its blocks that
must wait on the temp device for the rest of the model to fit the train device's free memory.

`auto` counts what is really on the train device when the part is placed, not what the parts
would weigh there whole: a part parked wholly (FLUX.2 dev's 12.7 GB text encoder at
offload_fraction 1) holds only its non-block layers and a window of blocks there, and a part
already there (placed earlier, or quantized on the device) is in the device's free memory already,
so counting it whole as well would count it twice. The parts with a fixed fraction are placed
first (part_setup.py), so an `auto` part sees them; an `auto` part placed after another counts
that one's non-block bytes, which it cannot park. Parking pays for its window too: the needed
block and the prefetched ones sit on the train device (at most the largest blocks). A frozen text
encoder's token table stays on the host (offload/host_tables.py: trainer.host_tables, made before
any part is placed), so it counts in neither the part's bytes nor a later part's unparkable ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from modules.config.errors import ConfigError
from modules.offload.layer_tensors import block_bytes, layer_tensors, tensor_bytes
from modules.offload.planning import auto_offload_fraction, trained_bytes_factor
from modules.quantization.capabilities import detect_capabilities

if TYPE_CHECKING:
    from modules.trainer.generic_trainer import GenericTrainer


def on_device(train: torch.device, where: torch.device) -> bool:
    """A tensor at `where` is on the train device `train` ("cuda" without an index: the current one)."""
    if where.type != train.type:
        return False
    if train.index is not None:
        return where.index == train.index
    return train.type != "cuda" or where.index == torch.cuda.current_device()


def bytes_on(module: nn.Module, device: torch.device) -> int:
    """The bytes of `module`'s tensors that sit on `device` now."""
    return sum(tensor_bytes(t.get()) for t in layer_tensors(module) if on_device(device, t.get().device))


def placement_order(trainer: GenericTrainer) -> list[str]:
    """The parts with a fixed fraction first, then the `auto` ones, each group in the family's order."""
    parts = trainer.config.model.parts
    return sorted(trainer.family.parts, key=lambda name: parts[name].offload_fraction == "auto")


def offload_fraction(trainer: GenericTrainer, part: str, still_to_place: list[str] = ()) -> float:
    """`still_to_place`: the parts placed after this one (only `auto` ones, in placement_order)."""
    requested = trainer.config.model.parts[part].offload_fraction
    if requested == 0:
        return 0.0
    blocks = trainer.family.checkpoint_blocks(part)
    if not blocks:
        raise ConfigError([f"model.parts.{part}.offload_fraction: the {trainer.family.name} family has no "
                           f"blocks to offload in {part}"])
    if requested != "auto":
        return requested
    device = torch.device(trainer.device)
    parts = trainer.family.parts
    scale = trained_bytes_factor(trainer.config, part)  # a fine-tune's optimizer state parks with its weights
    def off_device(name: str) -> int:  # its token table, which waits on the host
        return trainer.host_tables[name].nbytes if name in trainer.host_tables else 0

    part_bytes = int((block_bytes(parts[part]) - off_device(part)) * scale)
    offloadable = int(sum(block_bytes(b) for b in blocks) * scale)
    free = detect_capabilities(device).free_memory
    if free is None:
        return _reported(trainer, part, 0.0)
    placed = {name: bytes_on(module, device) for name, module in parts.items() if name not in still_to_place}
    # what the train device holds free with none of the model on it; the headroom is a share of that
    weights_free = free + sum(placed.values())
    later = sum(block_bytes(parts[n]) - sum(block_bytes(b) for b in trainer.family.checkpoint_blocks(n))
                - off_device(n) for n in still_to_place if n != part)
    other = sum(b for name, b in placed.items() if name != part) + later
    window = (1 + trainer.config.model.parts[part].offload_prefetch) * max(block_bytes(b) for b in blocks) * scale
    fraction = auto_offload_fraction(part_bytes, offloadable, other, weights_free, int(window))
    return _reported(trainer, part, fraction)


def _reported(trainer: GenericTrainer, part: str, fraction: float) -> float:
    trainer.callbacks.on_status(f"model.parts.{part}.offload_fraction: auto -> {fraction:g}")
    return fraction
