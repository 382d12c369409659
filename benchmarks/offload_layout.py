"""Which blocks layer offloading parks on real-width models, and what that costs in transfers.

    python -m benchmarks.offload_layout [--prefetch 1]

Each denoiser is built from its diffusers config in resources/model_configs on the meta device
(shapes, no memory), in bfloat16, and its blocks are the family's own `checkpoint_blocks`. For
offload_fraction 0.25, 0.5 and 0.75 it prints the blocks parked, parked block bytes / block bytes
(the traffic each pass moves, against what the fraction asks), and the most parked bytes on the
train device at once (the needed block plus the prefetched ones, over a training step and a
forward-only pass): what offloading adds to the memory of the resident blocks.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

CONFIGS = Path(__file__).resolve().parent.parent / "resources" / "model_configs"
# (label, family, part, config folder)
MODELS = [
    ("SDXL UNet", "sdxl", "unet", "sdxl/unet"),
    ("FLUX.1 transformer", "flux", "transformer", "flux/transformer"),
    ("FLUX.2 dev transformer", "flux2", "transformer", "flux2/transformer_dev"),
    ("FLUX.2 klein 4B transformer", "flux2", "transformer", "flux2/transformer"),
    ("Qwen-Image transformer", "qwen_image", "transformer", "qwen_image/transformer"),
]
FRACTIONS = (0.25, 0.5, 0.75)


def real_width_block_bytes(family: str, part: str, folder: str) -> list[int]:
    """The bfloat16 bytes of each of the family's checkpoint blocks of `part`, in execution order,
    for the model whose diffusers config is in resources/model_configs/`folder`."""
    import diffusers
    from accelerate import init_empty_weights

    from modules.config.loading import build_config
    from modules.config.families import get_family_class
    from modules.offload.layer_tensors import block_bytes

    path = CONFIGS / folder
    model_class = getattr(diffusers, json.loads((path / "config.json").read_text())["_class_name"])
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bfloat16 (a cast afterwards warns about fp32 modules)
    try:
        with init_empty_weights():
            module = model_class.from_config(model_class.load_config(str(path)))
    finally:
        torch.set_default_dtype(default)
    instance = get_family_class(family)(build_config([{"model": {"family": family}}]))
    instance.parts[part] = module
    return [block_bytes(block) for block in instance.checkpoint_blocks(part)]


def layout_rows(sizes: list[int], prefetch: int) -> list[dict]:
    from modules.offload.schedule import bytes_in_flight, choose_parked

    window, total = 1 + prefetch, sum(sizes)
    rows = []
    for fraction in FRACTIONS:
        parked = choose_parked(sizes, fraction, window)
        rows.append({"fraction": fraction, "parked": len(parked), "blocks": len(sizes),
                     "parked_share": sum(sizes[i] for i in parked) / total,
                     "in_flight": bytes_in_flight(sizes, parked, window), "largest": max(sizes), "total": total})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefetch", type=int, default=1, help="offload_prefetch (blocks brought ahead)")
    args = parser.parse_args()
    from modules.util.library_logs import quiet_library_logs

    quiet_library_logs()
    gib = 2**30
    print(f"prefetch {args.prefetch}; bfloat16 bytes; in flight: most parked bytes on the train device at once")
    print(f"{'model':30} {'fraction':>8} {'parked':>9} {'parked bytes':>13} {'in flight':>10} {'largest block':>14}")
    for label, family, part, folder in MODELS:
        sizes = real_width_block_bytes(family, part, folder)
        for row in layout_rows(sizes, args.prefetch):
            print(f"{label:30} {row['fraction']:8.2f} {row['parked']:4d}/{row['blocks']:<4d} "
                  f"{row['parked_share']:12.1%} {row['in_flight'] / gib:8.2f} G {row['largest'] / gib:12.2f} G"
                  f"   (blocks {row['total'] / gib:.2f} G)")


if __name__ == "__main__":
    main()
