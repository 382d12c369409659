"""A part's layer-offloading fraction: the config's, or for "auto" the share of its blocks that
must wait on the temp device for the rest of the model to fit the train device's free memory."""

from __future__ import annotations

from typing import TYPE_CHECKING

from modules.config.errors import ConfigError
from modules.offload.layer_tensors import block_bytes
from modules.offload.planning import auto_offload_fraction, trained_bytes_factor
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
    scale = trained_bytes_factor(trainer.config, part)  # a fine-tune's optimizer state parks with its weights
    part_bytes = int(block_bytes(trainer.family.parts[part]) * scale)
    other = sum(block_bytes(m) for n, m in trainer.family.parts.items() if n != part)
    free = detect_capabilities(trainer.device).free_memory
    fraction = auto_offload_fraction(part_bytes, int(sum(block_bytes(b) for b in blocks) * scale), other, free)
    trainer.callbacks.on_status(f"model.parts.{part}.offload_fraction: auto -> {fraction:g}")
    return fraction
