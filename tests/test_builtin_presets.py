"""Every built-in preset (resources/presets/<family>/*.json, discovered, so a new preset is
covered by being added) trains 2 steps on its family's tiny model with its own dtypes and weight
modes, samples, backs up and saves; where diffusers has a loader for the family and the adapter
type, the saved file loads with `load_lora_weights` and every adapter in it lands on a layer.

Overridden, and only because the test must run on a tiny model on CPU in seconds: model.base
(the tiny model), concepts (the shape images), data.resolution (32: the families whose bucket quantum is
16 or 32 px train at 32 px, the others at their 64-px quantum; what a step does is the same at any size),
schedule.max_steps (2), the sample prompts' steps/width/height (2 steps, 32 px: a quarter of 64 px's
pixels) and frames (at most 5:
still a video), the prompt images (shape images, as many as the preset names, at least the one a family
that samples from an image needs), train_device
(cpu), workspace_dir and output.path (tmp_path), tensorboard (off). Everything else, the weight
modes, train_dtype, output dtype and format, adapter, optimizer, batch size, gradient
accumulation, checkpointing and offloading, is the preset's own. A weight mode this CPU cannot run
skips the preset and says which, rather than training something else under its name."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from modules.config.loading import build_config
from modules.config.presets import list_presets, load_preset_overlay, save_preset
from modules.config.families import family_names, get_family_declaration
from modules.quantization.capabilities import detect_capabilities, working_modes

BUILTIN = [preset for preset in list_presets() if preset.builtin]
# adapter types whose files diffusers' `load_lora_weights` reads for every family: LoRA (and DoRA).
# The SD1.5/SDXL loaders refuse LoKr and OFT files ("keys have not been correctly renamed", tried
# with diffusers 0.42); Z-Image's reads LoKr, but no built-in Z-Image preset trains one.
DIFFUSERS_LOADS = {"lora"}


def _params():
    return [pytest.param(preset, id=f"{preset.family}/{preset.name}") for preset in BUILTIN]


@pytest.fixture(autouse=True)
def _isolated_user_dir(tmp_path, monkeypatch):
    """A user preset of the same name would shadow the built-in one; never read the real user dir."""
    monkeypatch.setenv("DIFFTRAINER_HOME", str(tmp_path / "home"))


def _test_overrides(preset_overlay: dict, model, images, tmp_path) -> dict:
    # a preset without prompts (the GUI's defaults have none) samples one, so sampling is tested too
    prompts = [{**prompt, "steps": 2, "width": 32, "height": 32, "frames": min(prompt.get("frames", 1), 5)}
               for prompt in preset_overlay.get("sampling", {}).get("prompts", [{"prompt": "a red square"}])]
    # a family that samples from an image (image-to-video) starts from shape images: as many as the preset's
    # prompt names (FLF2V's first and last frames, files on its user's disk), at least the family's fewest
    fewest = get_family_declaration(preset_overlay.get("model", {}).get("family", "sd15")).prompt_images[0]
    shapes = sorted(images.glob("*.png"))
    prompts = [{**prompt, "control_images": list(map(str, shapes[:max(len(prompt.get("control_images", [])), fewest)]))}
               for prompt in prompts]
    # an embedding preset's placeholder goes into the captions, as its user writes it into theirs
    placeholders = " ".join(e["placeholder"] for e in preset_overlay.get("embeddings", []) if e.get("train", True))
    captions = {"captions": {"prefix": f"{placeholders} "}} if placeholders else {}
    return {
        "model": {"base": str(model)},
        "concepts": [{"path": str(images), **captions}],
        "data": {"resolution": 32},
        "schedule": {"max_steps": 2},
        "sampling": {"prompts": prompts},
        "train_device": "cpu",
        "workspace_dir": str(tmp_path / "ws"),
        "output": {"path": str(tmp_path / "out" / "adapter.safetensors")},
        "tensorboard": False,
    }


def _lora_layers(pipe) -> int:
    from peft.tuners.lora import LoraLayer
    from torch import nn

    return sum(isinstance(module, LoraLayer)
               for component in pipe.components.values() if isinstance(component, nn.Module)
               for module in component.modules())


@pytest.mark.parametrize("preset", _params())
def test_builtin_preset_trains_samples_backs_up_and_saves(preset, tmp_path, tiny_family_model, shape_images):
    from modules.config.families import get_family_class

    overlay = load_preset_overlay(preset.name)
    # the tiny stand-in of the model the preset is made for (FLUX.2 [dev] presets: the dev architecture)
    options = get_family_class(preset.family).tiny_model_options(preset.name)
    _trains_samples_backs_up_and_saves(overlay, preset.family, tmp_path,
                                       lambda family: tiny_family_model(family, **options), shape_images)


@pytest.mark.parametrize("family", family_names())
def test_a_preset_saved_from_the_gui_defaults_trains_samples_and_saves(family, tmp_path, tiny_family_model,
                                                                       shape_images):
    """What a user gets from the GUI by picking a family and pressing Save as: the family's defaults
    (the window starts from `build_config` of the family, ui/state.py) saved as a user preset."""
    save_preset(build_config([{"model": {"family": family}}]), f"my {family} defaults")
    overlay = load_preset_overlay(f"my {family} defaults")
    _trains_samples_backs_up_and_saves(overlay, family, tmp_path, tiny_family_model, shape_images)


def _trains_samples_backs_up_and_saves(overlay: dict, family: str, tmp_path, tiny_family_model, shape_images):
    from modules.trainer.generic_trainer import GenericTrainer

    config = build_config([overlay, _test_overrides(overlay, tiny_family_model(family), shape_images, tmp_path)])
    assert config.model.family == family
    cpu_modes = working_modes(detect_capabilities("cpu"))
    for part, part_config in config.model.parts.items():
        if part_config.weight_dtype not in (*cpu_modes, "auto"):
            pytest.skip(f"model.parts.{part}.weight_dtype {part_config.weight_dtype!r} does not run on this CPU")

    from modules.trainer.callbacks import TrainCallbacks

    class SaveReports(TrainCallbacks):  # what each save's check says of the file (modules/saving/consumers)
        reports: list[dict] = []
        paths: list[Path] = []

        def on_save(self, path, consumers=None):
            self.reports.append(consumers or {})
            self.paths.append(Path(path))

    saves = SaveReports()
    trainer = GenericTrainer(config, saves)
    trainer.start()
    trainer.train()
    assert trainer.step == 2 and math.isfinite(trainer.last_loss)
    samples = trainer.sample()
    assert len(samples) == len(config.sampling.prompts) >= 1
    for path in samples:
        with Image.open(path) as image:
            assert np.asarray(image).std() > 0, f"{path.name} is one flat colour (a NaN decode)"
    assert trainer.backup().is_dir()
    saved = trainer.end()
    # Qwen-Image-Edit's Qwen2VLProcessor and FIBO-2's Qwen3VLProcessor need torchvision (not installed here);
    # their LoRA loaders and their pipelines' other components do not
    without = {"processor": None} if config.model.family in ("qwen_image_edit", "qwen_image_edit_plus",
                                                             "fibo2") else {}
    if saved.is_dir():  # a fine-tune of a family without a single-file writer saves a pipeline folder
        from diffusers import DiffusionPipeline, ModularPipeline

        if (saved / "modular_model_index.json").is_file():  # a modular pipeline's folder (Anima's)
            ModularPipeline.from_pretrained(str(saved)).load_components()  # loads whole, or raises
        else:
            DiffusionPipeline.from_pretrained(str(saved), local_files_only=True, **without)  # loads whole, or raises
        return
    assert saved.is_file()

    if config.method.type != "adapter":
        return  # a fine-tune saves a model, an embedding run its embedding file: no LoRA to load
    # the final save's files (one per expert for Wan 2.2: Wan22Family.adapter_files)
    file_sets = trainer.methods[0].file_sets()
    final = saves.paths[-len(file_sets):]
    assert final[0] == saved
    for report in saves.reports[-len(file_sets):]:
        comfyui = report.get("ComfyUI")  # the run's own check of its adapter file
        if comfyui is not None:  # every key of every preset's file is one ComfyUI applies (issue 27)
            assert comfyui["applied"] == comfyui["total"] > 0, comfyui["dropped"][:5]
    if config.adapter.type not in DIFFUSERS_LOADS:
        return  # no diffusers loader for this adapter type (see DIFFUSERS_LOADS)
    if config.model.family in ("flux", "flux_kontext", "chroma") and config.output.format in ("kohya", "comfy"):
        # diffusers' kohya-FLUX converter (Kontext's and Chroma's too) splits the fused qkv/linear1 LoRAs at FLUX's
        # real widths (3072/12288, hard-coded), so a tiny model's file cannot be split there; the
        # same layer sets load exactly at real width in tests/test_flux_kohya_files.py.
        return
    if config.model.family == "sd3" and config.output.format != "diffusers":
        # StableDiffusion3Pipeline.load_lora_weights reads diffusers-format files only (no converter
        # for sd-scripts' or OneTrainer's SD3 names); the SD3 presets save that format
        return
    if trainer.family.diffusers_refuses(config.output.format):
        return  # the family's key layout says diffusers' loader reads no file of this format (the run warns so)
    if config.model.family == "krea2" and config.output.format != "diffusers":
        # Krea2Pipeline.load_lora_weights reads diffusers files and ComfyUI-named peft ones (lora_A/lora_B, no
        # alpha): nothing of a kohya file, and it refuses a comfy one (tests/test_family_krea2.py); the Krea-2
        # presets save diffusers files, which ComfyUI maps too
        return
    if all(report.get("diffusers", {}).get("applied") == 0 for report in saves.reports[-len(file_sets):]):
        # the run's check says diffusers loads none of this format's adapters (Anima: its loader reads no kohya
        # key; its diffusers-format files load whole in tests/test_family_anima.py)
        return
    pipe = _base_pipeline(str(config.model.base), without)
    assert _lora_layers(pipe) == 0, "the shared pipeline still holds an earlier preset's adapters"
    try:
        for (suffix, _), path in zip(file_sets, final):
            pipe.load_lora_weights(str(path), adapter_name=f"trained{suffix}",
                                   **trainer.family.diffusers_load_options(suffix))
        assert _lora_layers(pipe) == len(trainer.adapters), "diffusers left adapters of the saved file unused"
    finally:
        pipe.unload_lora_weights()  # back to the plain base for the next preset of the family


_PIPELINES: dict[tuple[str, tuple], object] = {}


def _base_pipeline(base: str, without: dict):
    """The family's tiny pipeline, read from disk once for all the presets that load a LoRA into it
    (unloaded again after each), instead of once per preset."""
    from diffusers import DiffusionPipeline

    key = (base, tuple(sorted(without)))
    if key not in _PIPELINES:
        _PIPELINES[key] = DiffusionPipeline.from_pretrained(base, local_files_only=True, **without)
    return _PIPELINES[key]
