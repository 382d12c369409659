"""Captioned images of simple shapes, drawn with PIL: the demo's dataset and the tests' data."""

from __future__ import annotations

from pathlib import Path

from PIL import Image, ImageDraw

COLORS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 70, 220), "yellow": (235, 210, 40),
          "white": (245, 245, 245), "black": (15, 15, 15), "purple": (140, 50, 170), "orange": (240, 140, 30)}
SHAPES = ("circle", "square", "triangle")


def draw_shape(shape: str, color: str, background: str, width: int, height: int) -> Image.Image:
    image = Image.new("RGB", (width, height), COLORS[background])
    draw = ImageDraw.Draw(image)
    size = min(width, height) * 0.6
    left, top = (width - size) / 2, (height - size) / 2
    box = (left, top, left + size, top + size)
    if shape == "circle":
        draw.ellipse(box, fill=COLORS[color])
    elif shape == "square":
        draw.rectangle(box, fill=COLORS[color])
    else:
        draw.polygon([(width / 2, top), (left + size, top + size), (left, top + size)], fill=COLORS[color])
    return image


def write_shape_images(folder: str | Path, count: int = 8, width: int = 64, height: int = 64) -> list[Path]:
    """`count` PNGs with a .txt caption beside each ("a red circle on a blue background")."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    names = list(COLORS)
    paths = []
    for index in range(count):
        shape = SHAPES[index % len(SHAPES)]
        color = names[index % len(names)]
        background = names[(index * 3 + 2) % len(names)]
        if background == color:
            background = names[(names.index(color) + 1) % len(names)]
        path = folder / f"{index:03d}-{color}-{shape}.png"
        draw_shape(shape, color, background, width, height).save(path)
        path.with_suffix(".txt").write_text(f"a {color} {shape} on a {background} background", encoding="utf-8")
        paths.append(path)
    return paths


def write_edit_pairs(folder: str | Path, count: int = 2, width: int = 64, height: int = 64,
                     control_size: tuple[int, int] | None = None) -> list[Path]:
    """Edit pairs in the `folders` layout (docs/data.md): `target/NNN.png` with its instruction in
    `target/NNN.txt` ("make the circle red"), and `control/NNN.png`, the same shape in another colour,
    `control_size` (width, height) if given. Both have their left third black, so a mirrored image
    differs from the image. The targets' paths."""
    folder = Path(folder)
    (folder / "target").mkdir(parents=True, exist_ok=True)
    (folder / "control").mkdir(parents=True, exist_ok=True)
    names = list(COLORS)
    control_width, control_height = control_size or (width, height)
    paths = []
    for index in range(count):
        shape, color = SHAPES[index % len(SHAPES)], names[index % len(names)]
        before, background = names[(index + 3) % len(names)], names[(index * 3 + 2) % len(names)]
        if background in (color, before):
            background = next(n for n in names if n not in (color, before))
        target = folder / "target" / f"{index:03d}.png"
        image = draw_shape(shape, color, background, width, height)
        ImageDraw.Draw(image).rectangle((0, 0, width // 3, height), fill=COLORS["black"])
        image.save(target)
        target.with_suffix(".txt").write_text(f"make the {shape} {color}", encoding="utf-8")
        control = draw_shape(shape, before, background, control_width, control_height)
        ImageDraw.Draw(control).rectangle((0, 0, control_width // 3, control_height), fill=COLORS["black"])
        control.save(folder / "control" / f"{index:03d}.png")
        paths.append(target)
    return paths
