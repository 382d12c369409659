"""Benchmark models and images, built offline with random weights.

`tiny` is the test-suite model; `small` is big enough (~35M UNet parameters) that per-step time
is dominated by UNet math rather than Python overhead, so trainer overhead shows up as a ratio.
"""

from __future__ import annotations

import argparse
from pathlib import Path

# Per size: overrides for make_tiny_model, plus the training resolution and batch the benchmark uses.
# The VAE has 2 down blocks (the make_tiny_model default), so latents are resolution / 2 and the
# UNet's sample_size is set to that.
SIZES = {
    "tiny": dict(
        unet=dict(sample_size=32),  # the other tiny values are make_tiny_model's defaults
        text=dict(),
        vae=dict(),
        resolution=64,
        batch=2,
    ),
    "small": dict(
        unet=dict(
            sample_size=64,
            block_out_channels=(128, 256, 256),
            layers_per_block=2,
            down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=256,
            attention_head_dim=8,
        ),
        text=dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                  max_position_embeddings=77, projection_dim=256),
        vae=dict(),
        resolution=128,
        batch=2,
    ),
}

def build_model(size: str, out: str | Path) -> Path:
    """Write the `size` model to `out` in diffusers layout; return the folder."""
    from modules.model.sd15 import (
        SD15Family,  # heavy import (torch, diffusers): only when building
    )

    spec = SIZES[size]
    return SD15Family.make_tiny_model(out, unet=spec["unet"], text=spec["text"], vae=spec["vae"], seed=0)


def write_images(folder: str | Path, size: int = 128) -> Path:
    """Write 8 captioned shape PNGs (the demo's kind) with a .txt caption beside each."""
    from modules.data.synthetic_images import write_shape_images

    write_shape_images(folder, count=8, width=size, height=size)
    return Path(folder)


def unet_parameter_count(model_dir: str | Path) -> int:
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel.from_pretrained(str(Path(model_dir) / "unet"), local_files_only=True)
    return sum(p.numel() for p in unet.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", choices=sorted(SIZES))
    parser.add_argument("--out", help="model folder to write (with --size)")
    parser.add_argument("--images", help="folder to write the 8 captioned images into")
    args = parser.parse_args()
    if not (args.size and args.out) and not args.images:
        parser.error("give --size and --out, or --images, or both")
    if args.size and args.out:
        build_model(args.size, args.out)
        print(f"{args.size} model in {args.out}: UNet {unet_parameter_count(args.out):,} parameters")
    if args.images:
        write_images(args.images)
        print(f"8 images in {args.images}")


if __name__ == "__main__":
    main()
