"""Pinned host bytes for the parked blocks of real-width models, planned on the meta device.

    python -m benchmarks.offload_pinned [--fraction 0.5]

Each config's part is built from its diffusers config in resources/model_configs/ as a skeleton
(the family's own loading, parameters on the meta device: no weights, no memory), cast to the
config's dtype; the conductor's choice of parked blocks (schedule.choose_parked) and its arena
plan (offload/pinned_arenas.plan_arenas) run on the tensors' sizes. Prints per config: parked
block bytes / block bytes, and the pinned bytes the arenas take / the parked bytes, beside what
pinning each tensor on its own takes (torch's CUDA host allocator rounds each allocation up to
a power of two).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent

# (label, family, part, diffusers class path, dtype)
CONFIGS = [
    ("SDXL UNet bf16", "sdxl", "unet", "diffusers.UNet2DConditionModel", torch.bfloat16),
    ("SDXL UNet fp32", "sdxl", "unet", "diffusers.UNet2DConditionModel", torch.float32),
    ("FLUX.1 transformer bf16", "flux", "transformer", "diffusers.FluxTransformer2DModel", torch.bfloat16),
    ("FLUX.1 T5 encoder bf16", "flux", "text_encoder_2", "transformers.T5EncoderModel", torch.bfloat16),
]


def skeleton_blocks(family_name: str, part: str, class_path: str, dtype: torch.dtype) -> list[torch.nn.Module]:
    """The family's checkpoint blocks of `part`, built on the meta device from the shipped config."""
    import importlib

    from modules.config.loading import build_config
    from modules.config.families import get_family_class

    module_name, class_name = class_path.rsplit(".", 1)
    cls = getattr(importlib.import_module(module_name), class_name)
    config = build_config([{"model": {"family": family_name, "base": str(REPO / "resources" / "model_configs" / family_name)}}])
    family = get_family_class(family_name)(config)
    family.skeleton_parts = frozenset({part})
    family.parts[part] = family.load_part(part, cls).to(dtype)
    return family.checkpoint_blocks(part)


def measure(blocks: list[torch.nn.Module], fraction: float) -> dict[str, float]:
    from modules.offload.layer_tensors import block_bytes, layer_tensors, tensor_bytes
    from modules.offload.pinned_arenas import plan_arenas
    from modules.offload.schedule import choose_parked

    sizes = [block_bytes(b) for b in blocks]
    parked = choose_parked(sizes, fraction)
    tensors = [tensor_bytes(t.get()) for i in parked for t in layer_tensors(blocks[i])]
    parked_bytes = sum(tensors)
    plan = plan_arenas(tensors)
    one_by_one = sum(1 << max(n - 1, 0).bit_length() for n in tensors)
    return {"blocks": len(blocks), "parked_blocks": len(parked), "block_gb": sum(sizes) / 1e9,
            "parked_gb": parked_bytes / 1e9, "parked_share": parked_bytes / sum(sizes),
            "arenas": len(plan.arena_bytes), "pinned_gb": plan.pinned_bytes / 1e9,
            "pinned_ratio": plan.pinned_bytes / parked_bytes, "per_tensor_ratio": one_by_one / parked_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fraction", type=float, default=0.5)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from modules.util.library_logs import quiet_library_logs

    quiet_library_logs()
    print(f"offload_fraction {args.fraction}")
    print(f"{'config':26} {'parked/blocks':>18} {'parked share':>12} {'arenas':>6} {'pinned GB':>9} "
          f"{'pinned/parked':>13} {'per-tensor pinning':>18}")
    for label, family, part, class_path, dtype in CONFIGS:
        m = measure(skeleton_blocks(family, part, class_path, dtype), args.fraction)
        print(f"{label:26} {m['parked_blocks']:>4} of {m['blocks']:<4} {m['parked_gb']:5.2f} GB "
              f"{m['parked_share']:>11.1%} {m['arenas']:>6} {m['pinned_gb']:>9.3f} {m['pinned_ratio']:>13.4f} "
              f"{m['per_tensor_ratio']:>17.3f}x")


if __name__ == "__main__":
    main()
