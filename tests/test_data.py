"""modules/data: aspect buckets, concept folders and captions, image loading."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from modules.config.train_config import ConceptConfig
from modules.data.buckets import MAX_ASPECT, bucket_for
from modules.data.concepts import ConceptItem, DataError, scan_concept
from modules.data.images import image_size, load_cropped
from modules.data.synthetic_images import write_shape_images

EXIF_ORIENTATION = 0x0112


def save_image(path: Path, width: int = 32, height: int = 32, color=(200, 30, 30)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (width, height), color).save(path)
    return path


def scan(folder: Path, index: int = 0, **fields) -> tuple[list[ConceptItem], list[str]]:
    warnings: list[str] = []
    items = scan_concept(index, ConceptConfig(path=str(folder), **fields), warnings.append)
    return items, warnings


# --- aspect buckets -------------------------------------------------------------------------

BUCKETS = [
    # width, height, resolution, quantum -> bucket
    pytest.param(512, 512, 512, 64, (512, 512), id="square"),
    pytest.param(2048, 2048, 512, 64, (512, 512), id="large-square"),
    pytest.param(768, 512, 512, 64, (576, 384), id="3:2"),
    pytest.param(512, 768, 512, 64, (384, 576), id="2:3"),
    pytest.param(1920, 1080, 512, 64, (640, 384), id="16:9"),
    pytest.param(1000, 100, 512, 64, (1024, 256), id="10:1-clamped-to-4:1"),
    pytest.param(100, 1000, 512, 64, (256, 1024), id="1:10-clamped-to-1:4"),
    pytest.param(4000, 1000, 512, 64, (1024, 256), id="exactly-4:1"),
    pytest.param(1, 1, 512, 64, (512, 512), id="tiny-square"),
    pytest.param(3, 2, 512, 64, (576, 384), id="tiny-3:2"),
    pytest.param(64, 64, 64, 64, (64, 64), id="demo-resolution"),
    pytest.param(10, 10, 32, 64, (64, 64), id="resolution-below-quantum"),
    pytest.param(1024, 768, 1024, 64, (1152, 832), id="4:3-at-1024"),
    pytest.param(768, 512, 512, 8, (624, 416), id="quantum-8"),
]


@pytest.mark.parametrize("width, height, resolution, quantum, expected", BUCKETS)
def test_bucket_table(width, height, resolution, quantum, expected):
    assert bucket_for(width, height, resolution, quantum) == expected


@pytest.mark.parametrize("width, height, resolution, quantum, expected", BUCKETS)
def test_buckets_are_whole_quanta_and_fit_the_area(width, height, resolution, quantum, expected):
    bucket_width, bucket_height = bucket_for(width, height, resolution, quantum)
    assert bucket_width % quantum == 0 and bucket_height % quantum == 0
    if resolution >= quantum * MAX_ASPECT:  # below that the quantum itself is the floor
        assert bucket_width * bucket_height <= resolution * resolution


@pytest.mark.parametrize("width, height, resolution, expected", [
    (768, 512, 512, (512, 512)),
    (100, 1000, 512, (512, 512)),
    (1, 1, 512, (512, 512)),
    (768, 512, 500, (448, 448)),  # rounded down to the quantum
    (768, 512, 32, (64, 64)),     # never below the quantum
])
def test_without_aspect_buckets_every_image_is_square(width, height, resolution, expected):
    assert bucket_for(width, height, resolution, 64, aspect_buckets=False) == expected


# --- concepts and captions ------------------------------------------------------------------

def test_txt_captions_are_read_beside_each_image(tmp_path):
    write_shape_images(tmp_path, count=3, width=16, height=16)
    items, warnings = scan(tmp_path)
    assert len(items) == 3 and not warnings
    for item in items:
        assert item.caption == item.image.with_suffix(".txt").read_text(encoding="utf-8")
        assert item.caption.startswith("a ") and item.concept == 0


def test_txt_captions_are_stripped(tmp_path):
    save_image(tmp_path / "a.png")
    (tmp_path / "a.txt").write_text("  a red square\n\n", encoding="utf-8")
    (item,), _ = scan(tmp_path)
    assert item.caption == "a red square"


def test_missing_txt_captions_warn_with_a_count(tmp_path):
    for name in ("a.png", "b.jpg", "c.webp"):
        save_image(tmp_path / name)
    (tmp_path / "a.txt").write_text("captioned", encoding="utf-8")
    items, warnings = scan(tmp_path, 2)
    assert {i.image.name: i.caption for i in items} == {"a.png": "captioned", "b.jpg": "", "c.webp": ""}
    (warning,) = warnings
    assert "concepts[2]" in warning and "2 image(s)" in warning and str(tmp_path) in warning


def test_one_caption_file_for_the_folder(tmp_path):
    save_image(tmp_path / "a.png")
    save_image(tmp_path / "b.png")
    (tmp_path / "words.txt").write_text("sks dog\n", encoding="utf-8")
    items, warnings = scan(tmp_path, caption_source="file", caption_file="words.txt")
    assert [i.caption for i in items] == ["sks dog", "sks dog"] and not warnings
    assert [i.image.name for i in items] == ["a.png", "b.png"]


def test_a_missing_caption_file_names_the_field(tmp_path):
    save_image(tmp_path / "a.png")
    with pytest.raises(DataError) as caught:
        scan(tmp_path, 3, caption_source="file", caption_file="missing.txt")
    assert str(caught.value).startswith("concepts[3].caption_file:")
    assert "missing.txt" in str(caught.value)


@pytest.mark.parametrize("name, caption", [
    ("dog_on_grass (2).png", "dog on grass"),
    ("dog_on_grass.png", "dog on grass"),
    ("a red circle.jpg", "a red circle"),
    ("cat (12).webp", "cat"),
    ("v2_final.PNG", "v2 final"),
])
def test_captions_from_file_names(tmp_path, name, caption):
    save_image(tmp_path / name)
    (item,), warnings = scan(tmp_path, caption_source="filename")
    assert item.caption == caption and not warnings


def test_masks_and_other_files_are_not_training_images(tmp_path):
    save_image(tmp_path / "a.png")
    save_image(tmp_path / "a-masklabel.png")
    save_image(tmp_path / "b.jpeg")
    save_image(tmp_path / "b-masklabel.jpeg")
    (tmp_path / "notes.md").write_text("not an image", encoding="utf-8")
    (tmp_path / "a.txt").write_text("a", encoding="utf-8")
    (tmp_path / "b.txt").write_text("b", encoding="utf-8")
    items, _ = scan(tmp_path)
    assert [i.image.name for i in items] == ["a.png", "b.jpeg"]


def test_subfolders_only_with_include_subfolders(tmp_path):
    save_image(tmp_path / "top.png")
    save_image(tmp_path / "sub" / "inner.png")
    save_image(tmp_path / "sub" / "deeper" / "deepest.png")
    items, _ = scan(tmp_path, caption_source="filename")
    assert [i.image.name for i in items] == ["top.png"]
    items, _ = scan(tmp_path, caption_source="filename", include_subfolders=True)
    assert sorted(i.image.name for i in items) == ["deepest.png", "inner.png", "top.png"]


def test_txt_captions_in_subfolders_sit_beside_their_image(tmp_path):
    save_image(tmp_path / "sub" / "inner.png")
    (tmp_path / "sub" / "inner.txt").write_text("inside", encoding="utf-8")
    (item,), warnings = scan(tmp_path, include_subfolders=True)
    assert item.caption == "inside" and not warnings


@pytest.mark.parametrize("make", ["missing", "file"])
def test_a_path_that_is_not_a_folder_names_the_field(tmp_path, make):
    path = tmp_path / ("concept.png" if make == "file" else "concept")
    if make == "file":
        save_image(path)
    with pytest.raises(DataError) as caught:
        scan(path, 1)
    assert str(caught.value).startswith("concepts[1].path:") and str(path) in str(caught.value)


# --- images ---------------------------------------------------------------------------------

def three_stripes(width: int, height: int, vertical: bool) -> Image.Image:
    """Red | green | blue thirds (left to right, or top to bottom when vertical)."""
    image = Image.new("RGB", (width, height))
    colors = [(255, 0, 0), (0, 255, 0), (0, 0, 255)]
    for index, color in enumerate(colors):
        if vertical:
            box = (0, index * height // 3, width, (index + 1) * height // 3)
        else:
            box = (index * width // 3, 0, (index + 1) * width // 3, height)
        image.paste(color, box)
    return image


@pytest.mark.parametrize("size, bucket, vertical", [
    ((96, 32), (32, 32), False),   # landscape into a square: keep the middle
    ((32, 96), (32, 32), True),    # portrait into a square
    ((150, 90), (64, 32), False),  # landscape into a landscape bucket
    ((90, 150), (32, 64), True),   # portrait into a portrait bucket
])
def test_load_cropped_shape_range_and_center_crop(tmp_path, size, bucket, vertical):
    path = tmp_path / "stripes.png"
    three_stripes(*size, vertical=vertical).save(path)
    pixels = load_cropped(path, *bucket)
    width, height = bucket
    assert pixels.shape == (3, height, width) and pixels.dtype == torch.float32
    assert pixels.min() >= -1.0 and pixels.max() <= 1.0
    assert pixels.min() == -1.0 and pixels.max() == 1.0  # the full range is used
    center = pixels[:, height // 2, width // 2]
    assert torch.allclose(center, torch.tensor([-1.0, 1.0, -1.0]), atol=0.05)  # green, the middle


def test_load_cropped_of_a_small_grey_image_is_upscaled(tmp_path):
    path = tmp_path / "grey.png"
    Image.new("L", (5, 3), 128).save(path)
    pixels = load_cropped(path, 64, 64)
    assert pixels.shape == (3, 64, 64)
    assert torch.allclose(pixels, torch.full_like(pixels, 128 / 127.5 - 1), atol=1e-3)


def exif_rotated(path: Path) -> Path:
    """Stored 60 x 30, left half red and right half blue; EXIF 6 shows it turned 90 degrees
    clockwise: 30 x 60, red on top."""
    stored = Image.new("RGB", (60, 30), (255, 0, 0))
    stored.paste((0, 0, 255), (30, 0, 60, 30))
    exif = Image.Exif()
    exif[EXIF_ORIENTATION] = 6
    stored.save(path, exif=exif, quality=95)
    return path


def test_image_size_honours_exif_orientation(tmp_path):
    path = exif_rotated(tmp_path / "phone.jpg")
    assert image_size(path) == (30, 60)
    plain = save_image(tmp_path / "plain.jpg", 60, 30)
    assert image_size(plain) == (60, 30)


def test_load_cropped_applies_exif_orientation(tmp_path):
    path = exif_rotated(tmp_path / "phone.jpg")
    pixels = load_cropped(path, 32, 64)
    assert pixels.shape == (3, 64, 32)
    red, blue = torch.tensor([1.0, -1.0, -1.0]), torch.tensor([-1.0, -1.0, 1.0])
    assert torch.allclose(pixels[:, 8, 16], red, atol=0.15)   # top
    assert torch.allclose(pixels[:, 56, 16], blue, atol=0.15)  # bottom


def test_rgba_and_palette_images_load_as_rgb(tmp_path):
    Image.new("RGBA", (16, 16), (10, 20, 30, 0)).save(tmp_path / "alpha.png")
    Image.new("P", (16, 16), 3).save(tmp_path / "palette.png")
    for name in ("alpha.png", "palette.png"):
        assert load_cropped(tmp_path / name, 16, 16).shape == (3, 16, 16)
