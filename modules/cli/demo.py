"""`launch.py demo`: a complete run that needs nothing but this checkout.

Builds a tiny random SD1.5-architecture model and eight captioned shape images inside the
workspace (once), then trains the built-in `demo` preset on them: about 50 steps, a sample,
a backup, and a kohya-format LoRA file.
"""

from __future__ import annotations

from pathlib import Path

from modules.config.loading import build_config
from modules.config.presets import load_preset_overlay
from modules.config.train_config import TrainConfig
from modules.data.synthetic_images import write_shape_images


def prepare_demo(workspace: Path, overrides: list[str] = ()) -> TrainConfig:
    workspace = Path(workspace)
    model_dir = workspace / "tiny-sd15"
    if not (model_dir / "model_index.json").is_file():
        from modules.model.sd15 import SD15Family

        SD15Family.make_tiny_model(model_dir)
    images = workspace / "images"
    if not any(images.glob("*.png")):
        write_shape_images(images, count=8, width=64, height=64)
    layer = {
        "model": {"family": "sd15", "base": str(model_dir)},
        "concepts": [{"name": "shapes", "path": str(images)}],
        "workspace_dir": str(workspace / "run"),
        # the demo's folder is its own: a second demo replaces the first one's result
        "output": {"path": str(workspace / "output" / "demo-lora.safetensors"), "if_exists": "overwrite"},
    }
    return build_config([load_preset_overlay("demo"), layer], overrides)
