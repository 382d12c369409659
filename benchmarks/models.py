"""Benchmark models and images, built offline with random weights.

`tiny` is the test-suite model; `small` is big enough (~35M UNet parameters) that per-step time
is dominated by UNet math rather than Python overhead, so trainer overhead shows up as a ratio.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from PIL import Image, ImageDraw

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

COLORS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 70, 220), "yellow": (235, 210, 40),
          "white": (245, 245, 245), "black": (15, 15, 15), "purple": (140, 50, 170), "orange": (240, 140, 30)}
# Eight (shape, shape colour, background colour) triples: distinct captions, deterministic pixels.
IMAGES = [
    ("circle", "red", "blue"), ("square", "green", "white"), ("triangle", "yellow", "black"),
    ("circle", "white", "purple"), ("square", "orange", "blue"), ("triangle", "blue", "yellow"),
    ("circle", "black", "orange"), ("square", "purple", "green"),
]


def build_model(size: str, out: str | Path) -> Path:
    """Write the `size` model to `out` in diffusers layout; return the folder."""
    from modules.model.sd15 import SD15Family  # heavy import (torch, diffusers): only when building

    spec = SIZES[size]
    return SD15Family.make_tiny_model(out, unet=spec["unet"], text=spec["text"], vae=spec["vae"], seed=0)


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def write_images(folder: str | Path, size: int = 128) -> Path:
    """Write 8 captioned PNGs (shape drawings) with a .txt caption beside each."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for index, (shape, fg, bg) in enumerate(IMAGES):
        image = Image.new("RGB", (size, size), COLORS[bg])
        draw = ImageDraw.Draw(image)
        box = (size // 4, size // 4, 3 * size // 4, 3 * size // 4)
        if shape == "circle":
            draw.ellipse(box, fill=COLORS[fg])
        elif shape == "square":
            draw.rectangle(box, fill=COLORS[fg])
        else:
            draw.polygon([(size // 2, size // 4), (size // 4, 3 * size // 4), (3 * size // 4, 3 * size // 4)],
                         fill=COLORS[fg])
        stem = folder / f"{index:02d}_{fg}_{shape}"
        image.save(stem.with_suffix(".png"))
        caption = f"{_article(fg)} {fg} {shape} on {_article(bg)} {bg} background"
        stem.with_suffix(".txt").write_text(caption + "\n", encoding="utf-8")
    return folder


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
