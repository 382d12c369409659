"""A part's layer-offloading fraction: the config's, or for "auto" the share of its blocks that
must wait on the temp device for the rest of the model to fit the train device's free memory."""

from __future__ import annotations

from typing import TYPE_CHECKING

from modules.config.errors import ConfigError
from modules.offload.layer_tensors import block_bytes
from modules.offload.planning import auto_offload_fraction
from modules.quantization.capabilities import detect_capabilities

if TYPE_CHECKING:
    from modules.trainer.generic_trainer import GenericTrainer


def offload_fraction(trainer: GenericTrainer, part: str) -> float:
    requested = trainer.config.model.parts[part].offload_fraction
    if requested == 0:
        return 0.0
    blocks = trainer.family.checkpoint_blocks(part)
    if not blocks:
        raise ConfigError([f"model.parts.{part}.offload_fraction: the {trainer.family.name} family has no "
                           f"blocks to offload in {part}"])
    if requested != "auto":
        return requested
    part_bytes = block_bytes(trainer.family.parts[part])
    other = sum(block_bytes(m) for n, m in trainer.family.parts.items() if n != part)
    free = detect_capabilities(trainer.device).free_memory
    fraction = auto_offload_fraction(part_bytes, sum(block_bytes(b) for b in blocks), other, free)
    trainer.callbacks.on_status(f"model.parts.{part}.offload_fraction: auto -> {fraction:g}")
    return fraction
