"""A sample prompt's control (reference) images for the edit families: each read, covered to the
sample's size and centre-cropped, as training brings each control to its target's bucket."""

from __future__ import annotations

from pathlib import Path

from modules.errors import UserError


def fitted_control_images(paths: list[str], width: int, height: int, most: int, family_label: str) -> list:
    """The controls of one sample as RGB PIL images of width x height; a file that cannot be read,
    or more files than the family takes, is one message naming it."""
    from PIL import Image, ImageOps

    if len(paths) > most:
        raise UserError(f"sampling: {len(paths)} control images given ({', '.join(paths)}); {family_label} takes {most}")
    images = []
    for path in map(Path, paths):
        try:
            with Image.open(path) as opened:
                image = ImageOps.exif_transpose(opened).convert("RGB")
        except (OSError, ValueError) as error:
            raise UserError(f"sampling: control image {path} cannot be read ({error})") from None
        images.append(ImageOps.fit(image, (width, height), Image.Resampling.LANCZOS))
    return images
