"""The preflight: what the config alone shows is wrong is reported before the model loads, all of
it together, each problem naming its dotted field; nothing is written."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, train_config
from forked_launch import launch_run
from mounts import full_disk, read_only_folder
from safetensors.torch import save_file

from modules.model.detect import detect_family, detect_model
from modules.trainer.preflight import PreflightError, preflight_problems, run_preflight

LOADING = "[loading model]"  # the trainer's first status after the preflight


def launch(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    result = launch_run(args, capture_output=True, text=True, cwd=ROOT, timeout=300)
    return result, time.monotonic() - started


def tree(*folders: Path) -> dict[str, str]:
    """Every file under `folders` with a hash of its bytes: equal before and after means nothing changed."""
    return {str(path): hashlib.sha256(path.read_bytes()).hexdigest()
            for folder in folders if folder.exists() for path in sorted(folder.rglob("*")) if path.is_file()}


def config_dict(base: Path, images: Path, tmp_path: Path, **changes) -> dict:
    data = {"model": {"base": str(base)}, "concepts": [{"path": str(images)}], "data": {"resolution": 64},
            "adapter": {"rank": 4, "alpha": 2}, "schedule": {"epochs": 1, "batch_size": 2},
            "workspace_dir": str(tmp_path / "ws"), "tensorboard": False, "train_device": "cpu",
            "output": {"path": str(tmp_path / "out" / "lora.safetensors"), "dtype": "float32"}}
    data.update(changes)
    return data


def field_lines(problems: list[str], field: str) -> list[str]:
    return [p for p in problems if p.startswith(field + ":")]


# --- each check, in process -------------------------------------------------------------------

def test_a_good_config_has_no_problems_and_writes_nothing(tmp_path, tiny_model, shape_images):
    config = train_config(tiny_model, shape_images, tmp_path)
    assert preflight_problems(config) == []
    assert list(tmp_path.iterdir()) == []  # neither the workspace nor the output folder was made


def test_an_output_path_that_is_a_folder(tmp_path, tiny_model, shape_images):
    folder = tmp_path / "out"
    folder.mkdir()
    config = train_config(tiny_model, shape_images, tmp_path, {"output": {"path": str(folder)}})
    (line,) = field_lines(preflight_problems(config), "output.path")
    assert f"{folder} is a folder" in line and str(folder / "lora.safetensors") in line


@pytest.mark.parametrize("path, said", [("/dev/null", "is not a regular file"),
                                         ("out/lora.pt", "does not end in .safetensors"),
                                         ("out/lora", "does not end in .safetensors")])
def test_an_output_path_that_is_a_device_or_lacks_the_suffix_is_refused(tmp_path, tiny_model, shape_images, path,
                                                                       said):
    # no /dev/null-2 written into /dev; a name without .safetensors is refused, not renamed
    target = path if path.startswith("/") else str(tmp_path / path)
    config = train_config(tiny_model, shape_images, tmp_path, {"output": {"path": target}})
    (line,) = field_lines(preflight_problems(config), "output.path")
    assert said in line and target in line


def test_an_empty_workspace_is_refused_not_taken_as_the_current_folder(tmp_path, tiny_model, shape_images,
                                                                      monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = train_config(tiny_model, shape_images, tmp_path, {"workspace_dir": ""})
    (line,) = field_lines(preflight_problems(config), "workspace_dir")
    assert "empty" in line and str(tmp_path) in line


def test_a_pickled_model_base_is_one_problem_not_one_per_part(tmp_path, shape_images):
    pickled = tmp_path / "model.ckpt"
    pickled.write_bytes(b"not read")
    config = train_config(pickled, shape_images, tmp_path)
    (line,) = preflight_problems(config)
    assert line.startswith("model.base: model.ckpt: only .safetensors")


def test_a_pickled_init_from_is_refused_before_the_model_loads(tmp_path, tiny_model, shape_images):
    pickled = tmp_path / "old.pt"
    pickled.write_bytes(b"not read")
    config = train_config(tiny_model, shape_images, tmp_path, {"adapter": {"init_from": str(pickled)}})
    assert preflight_problems(config) == ["adapter.init_from: old.pt: only .safetensors adapter files are read "
                                          "(pickled .pt/.ckpt files can run code when loaded)"]


def test_a_concept_folder_without_images_is_refused_before_the_model_loads(tmp_path, tiny_model, shape_images):
    empty = tmp_path / "data"
    (empty / "sub").mkdir(parents=True)
    shutil.copy(next(shape_images.glob("*.png")), empty / "sub")  # a user's images, one folder down
    config = train_config(tiny_model, shape_images, tmp_path, {"concepts": [{"path": str(shape_images)},
                                                                            {"path": str(empty)}]})
    (line,) = field_lines(preflight_problems(config), "concepts[1].path")
    assert line.startswith(f"concepts[1].path: no image in {empty} (training reads .jpeg, .jpg, .png, .webp")
    assert line.endswith("set concepts[1].include_subfolders to true to read them")


def test_a_workspace_that_is_a_file(tmp_path, tiny_model, shape_images):
    (tmp_path / "ws").write_text("not a folder")
    config = train_config(tiny_model, shape_images, tmp_path)
    (line,) = field_lines(preflight_problems(config), "workspace_dir")
    assert f"{tmp_path / 'ws'} is a file" in line


def test_a_train_device_this_torch_does_not_have(tmp_path, tiny_model, shape_images):
    config = train_config(tiny_model, shape_images, tmp_path, {"train_device": "cuda:99"})
    (line,) = field_lines(preflight_problems(config), "train_device")
    assert "'cuda:99' is not available here" in line
    if torch.version.cuda is None:
        assert f"this torch ({torch.__version__}) is built without CUDA" in line


def test_a_temp_device_this_torch_does_not_have(tmp_path, tiny_model, shape_images):
    """temp_device (where offloaded layers and activations wait) is probed as train_device is."""
    config = train_config(tiny_model, shape_images, tmp_path, {"temp_device": "cuda:99"})
    (line,) = preflight_problems(config)
    assert line.startswith("temp_device: 'cuda:99' is not available here")


def test_a_model_of_another_family_is_named_as_what_it_is(tmp_path, tiny_model, shape_images):
    config = train_config(tiny_model, shape_images, tmp_path, {"model": {"family": "sdxl"}})
    (line,) = preflight_problems(config)
    assert line == (f"model.base: {tiny_model} is a Stable Diffusion 1.5 model (StableDiffusionPipeline); the config "
                    "says model.family 'sdxl' (Stable Diffusion XL): set model.family to 'sd15'")


def test_a_truncated_weight_file_is_found_before_loading(tmp_path, tiny_model, shape_images):
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    (weights,) = (model / "vae").glob("*.safetensors")
    weights.write_bytes(weights.read_bytes()[:-100])
    config = train_config(model, shape_images, tmp_path / "run")
    (line,) = preflight_problems(config)
    assert line.startswith(f"model.parts.vae: {weights}: truncated:") and "(an interrupted download or copy?)" in line


def test_a_caption_that_is_not_utf8_is_named(tmp_path, tiny_model, shape_images):
    images = tmp_path / "images"
    shutil.copytree(shape_images, images)
    captions = sorted(images.glob("*.txt"))
    captions[0].write_bytes("caf\xe9 au lait".encode("latin-1"))
    captions[1].write_bytes("\ufeffa red circle".encode("utf-8"))  # a byte-order mark is fine
    config = train_config(tiny_model, images, tmp_path / "run")
    (line,) = preflight_problems(config)
    assert line == (f"concepts[0]: caption file {captions[0]} is not UTF-8 text (byte 0xe9 at position 3); "
                    "save it as UTF-8")
    captions[0].write_text("café au lait", encoding="utf-8")
    assert preflight_problems(config) == []


def test_a_dense_dtype_that_does_not_run_here(tmp_path, tiny_model, shape_images, monkeypatch):
    import modules.quantization.capabilities as capabilities

    monkeypatch.setattr(capabilities, "_dense_dtype_works", lambda dtype, device: dtype != torch.bfloat16)
    config = train_config(tiny_model, shape_images, tmp_path, {"train_dtype": "bfloat16",
                                                               "model": {"parts": {"vae": {"weight_dtype": "bfloat16"}}}})
    assert sorted(preflight_problems(config)) == ["model.parts.vae.weight_dtype: bfloat16 does not run on cpu here",
                                                  "train_dtype: bfloat16 does not run on cpu here"]
    config = train_config(tiny_model, shape_images, tmp_path, {"adapter": {"dtype": "bfloat16"}})
    assert preflight_problems(config) == ["adapter.dtype: bfloat16 does not run on cpu here"]


def test_a_weight_mode_that_does_not_run_here(tmp_path, tiny_model, shape_images, monkeypatch):
    import modules.quantization.capabilities as capabilities

    without_bitsandbytes = capabilities.Capabilities(
        device="cpu", device_name="test", cuda=False, compute_capability=None, total_memory=None, free_memory=None,
        dense_dtypes=("float32",), float8_dtypes=True, torchao_int8=True, bitsandbytes=False, int_mm=True,
        scaled_mm=False)
    monkeypatch.setattr(capabilities, "detect_capabilities", lambda device: without_bitsandbytes)
    config = train_config(tiny_model, shape_images, tmp_path, {"model": {"parts": {"unet": {"weight_dtype": "nf4"},
                                                                                   "vae": {"weight_dtype": "float8"}}}})
    (line,) = preflight_problems(config)
    assert line.startswith("model.parts.unet.weight_dtype: nf4 does not work on this machine")


def test_the_estimated_adapter_is_the_one_training_builds(tmp_path, tiny_model, shape_images):
    """The disk estimate counts the adapter tensors a backup holds: equal to the real adapter set's."""
    from modules.adapters.adapter_set import build_adapter_set
    from modules.model.sd15 import SD15Family
    from modules.adapters.adapter_size import adapter_size

    loaded = None
    for adapter in ({"type": "lora"}, {"type": "lora", "dora": True, "layer_preset": "all"}, {"type": "loha"},
                    {"type": "lokr", "rank": 2}, {"type": "oft", "block_size": 8}):
        config = train_config(tiny_model, shape_images, tmp_path, {"adapter": adapter, "model": {
            "parts": {"text_encoder": {"train": True}}}})
        family = SD15Family(config)
        estimate = adapter_size(config, family)
        if loaded is None:
            family.weight_modes = {part: "float32" for part in config.model.parts}
            family.load()
            loaded = family.parts
        family.parts = loaded
        real = build_adapter_set(family, config.adapter, ["text_encoder", "unet"], torch.device("cpu"))
        real.unhook()
        assert estimate.parameters == sum(p.numel() for p in real.parameters()), adapter
        assert estimate.nbytes == sum(t.numel() * t.element_size() for t in real.state_dict().values()), adapter


def test_the_estimate_leaves_out_the_layers_whose_output_never_reaches_the_loss(tmp_path, tiny_family_model,
                                                                              shape_images):
    """SDXL reads CLIP-L at its penultimate block: training gives its last block no adapters, and
    the estimate, made from the checkpoint's names before the model loads, does not count them."""
    from modules.adapters.adapter_set import build_adapter_set
    from modules.adapters.adapter_size import adapter_size
    from modules.model.sdxl import SDXLFamily

    config = train_config(tiny_family_model("sdxl"), shape_images, tmp_path, {"model": {
        "family": "sdxl", "parts": {"text_encoder": {"train": True}, "unet": {"train": False}}}})
    family = SDXLFamily(config)
    estimate = adapter_size(config, family)
    family.weight_modes = {part: "float32" for part in config.model.parts}
    family.load()
    real = build_adapter_set(family, config.adapter, ["text_encoder"], torch.device("cpu"))
    real.unhook()
    (last,) = family.unreachable_prefixes("text_encoder")  # found from the module names
    assert dict(family.parts["text_encoder"].named_modules())[last[:-1]] is family.checkpoint_blocks("text_encoder")[-1]
    assert real.left_out and all(name.startswith(f"text_encoder.{last}") for name in real.left_out)
    assert estimate.parameters == sum(p.numel() for p in real.parameters())
    assert estimate.nbytes == sum(t.numel() * t.element_size() for t in real.state_dict().values())


def test_a_workspace_without_room_for_the_backups(tmp_path, tiny_model, shape_images):
    # a tiny-model backup is ~290 KiB: one fits in 512 KiB, four do not
    with full_disk(tmp_path / "small", size="2m", leave_free=512 << 10) as small:
        config = train_config(tiny_model, shape_images, tmp_path, {
            "workspace_dir": str(small / "ws"), "schedule": {"backup_every": "1 steps"}})
        (line,) = preflight_problems(config)
        assert line.startswith(f"workspace_dir: not enough free disk space in {small}: 512.0 KiB free")
        assert "4 backup(s) of ~" in line and "lower backup.rolling_count" in line
        # with backups off one (written at a stop) remains, which fits
        config = train_config(tiny_model, shape_images, tmp_path, {"workspace_dir": str(small / "ws")})
        assert preflight_problems(config) == []


def test_a_workspace_and_output_on_one_disk_need_room_for_both(tmp_path, tiny_model, shape_images):
    """The one backup written at a stop (~286 KiB) fits in 320 KiB, and so does the output
    (~74 KiB), but not both: on one disk the needs add up."""
    with full_disk(tmp_path / "small", size="2m", leave_free=320 << 10) as small:
        alone = [train_config(tiny_model, shape_images, tmp_path, {"workspace_dir": str(small / "ws")}),
                 train_config(tiny_model, shape_images, tmp_path, {"output": {"path": str(small / "lora.safetensors")}})]
        assert [preflight_problems(config) for config in alone] == [[], []]
        both = train_config(tiny_model, shape_images, tmp_path, {
            "workspace_dir": str(small / "ws"), "output": {"path": str(small / "out" / "lora.safetensors")}})
        (line,) = preflight_problems(both)
        assert line.startswith(f"workspace_dir and output.path: not enough free disk space in {small}: 320.0 KiB free")
        assert "1 backup(s) of ~" in line and "the output file" in line


def test_run_preflight_raises_one_error_with_every_problem(tmp_path, tiny_model, shape_images):
    config = train_config(tiny_model, shape_images, tmp_path, {"train_device": "cuda:99",
                                                               "output": {"path": str(tmp_path)}})
    with pytest.raises(PreflightError) as caught:
        run_preflight(config)
    assert [p.split(":")[0] for p in caught.value.problems] == ["train_device", "output.path"]
    assert str(caught.value).startswith("the run cannot start (2 problems):\n  train_device: ")


# --- family detection -------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["sd15", "sdxl", "flux", "z_image", "sd3", "chroma", "flux2"])
def test_each_family_folder_is_detected(family, tmp_path):
    configs = ROOT / "resources" / "model_configs" / family
    assert detect_family(configs) == family
    # without model_index.json: the denoiser's config; a component folder on its own: its config
    folder = tmp_path / "no-index"
    shutil.copytree(configs, folder)
    (folder / "model_index.json").unlink()
    assert detect_family(folder) == family
    denoiser = "unet" if family in ("sd15", "sdxl") else "transformer"
    assert detect_family(folder / denoiser) == family


def _single_file(path: Path, *keys: str) -> Path:
    save_file({key: torch.zeros(1) for key in keys}, str(path))
    return path


@pytest.mark.parametrize("family, keys", [
    ("sd15", ["model.diffusion_model.input_blocks.0.0.weight", "cond_stage_model.transformer.text_model.x"]),
    ("sdxl", ["model.diffusion_model.input_blocks.0.0.weight", "model.diffusion_model.label_emb.0.0.weight"]),
    ("sdxl", ["conditioner.embedders.1.model.ln_final.weight"]),
    ("flux", ["double_blocks.0.img_attn.qkv.weight", "single_blocks.0.linear1.weight"]),
    ("flux", ["model.diffusion_model.double_blocks.0.img_attn.qkv.weight"]),
    ("z_image", ["noise_refiner.0.attention.qkv.weight", "layers.0.attention.qkv.weight"]),
    ("sd3", ["model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight", "first_stage_model.encoder.conv_in.weight"]),
    # FLUX's blocks and the distilled guidance layer
    ("chroma", ["double_blocks.0.img_attn.qkv.weight", "distilled_guidance_layer.in_proj.weight"]),
    # FLUX's block names and the shared modulations
    ("flux2", ["model.diffusion_model.double_blocks.0.img_attn.qkv.weight",
               "model.diffusion_model.single_stream_modulation.lin.weight"]),
    # diffusers' names (ComfyUI's qwen_image_*.safetensors), bare or under model.diffusion_model.
    ("qwen_image", ["transformer_blocks.0.img_mod.1.weight", "txt_in.weight"]),
    ("qwen_image", ["model.diffusion_model.transformer_blocks.0.img_mod.1.weight"]),
])
def test_each_family_single_file_is_detected_from_its_keys(family, keys, tmp_path):
    assert detect_family(_single_file(tmp_path / "model.safetensors", *keys)) == family


def test_a_model_no_family_trains_is_named_not_guessed(tmp_path):
    video = detect_model(_single_file(tmp_path / "video.safetensors", "model.diffusion_model.patchify_proj.weight"))
    assert video.family is None and "ltx-video" in video.kind
    assert detect_model(_single_file(tmp_path / "vae.safetensors", "first_stage_model.encoder.conv_in.weight")) is None
    index = tmp_path / "hunyuan" / "model_index.json"
    index.parent.mkdir()
    index.write_text(json.dumps({"_class_name": "HunyuanDiTPipeline"}))
    assert detect_model(index.parent).family is None and detect_model(index.parent).kind == "HunyuanDiTPipeline"
    assert detect_model(tmp_path / "nothing-here") is None


# --- through the CLI --------------------------------------------------------------------------

def test_every_problem_at_once_before_the_model_loads(tmp_path, tiny_model, shape_images):
    images = tmp_path / "images"
    shutil.copytree(shape_images, images)
    bad_caption = sorted(images.glob("*.txt"))[1]
    bad_caption.write_bytes(b"\xff\xfe not utf-8")
    output_folder = tmp_path / "out"
    (output_folder / "lora.safetensors").parent.mkdir()
    (output_folder / "lora.safetensors").write_bytes(b"a good adapter from an earlier run")
    workspace = tmp_path / "ws"
    (workspace / "backup").mkdir(parents=True)
    (workspace / "config.json").write_text("{}")
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps(config_dict(
        tiny_model, images, tmp_path, train_device="cuda:99", output={"path": str(output_folder)},
        model={"base": str(tiny_model), "family": "sdxl"})))
    before = tree(tmp_path)

    result, seconds = launch("train", "--config", str(config_file))

    assert result.returncode == 1 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[0] == "error: the run cannot start (4 problems):"
    assert [line.split(":")[0].strip() for line in lines[1:]] == ["train_device", "output.path", "model.base",
                                                                   "concepts[0]"]
    assert "is a Stable Diffusion 1.5 model" in lines[3]
    assert str(bad_caption) in lines[4]
    assert LOADING not in result.stderr and seconds < 120
    assert tree(tmp_path) == before


def test_read_only_and_full_disks_are_found_before_the_model_loads(tmp_path, tiny_model, shape_images):
    earlier = b"a good adapter from an earlier run"
    with read_only_folder(tmp_path / "ro", {"lora.safetensors": earlier}) as read_only, \
            full_disk(tmp_path / "full", leave_free=32 << 10) as full:
        config_file = tmp_path / "config.json"
        config_file.write_text(json.dumps(config_dict(
            tiny_model, shape_images, tmp_path, workspace_dir=str(full / "ws"),
            output={"path": str(read_only / "lora.safetensors")})))
        before = tree(read_only, full)

        result, _ = launch("train", "--config", str(config_file))

        assert result.returncode == 1 and "Traceback" not in result.stderr and LOADING not in result.stderr
        lines = result.stderr.strip().splitlines()
        assert lines[0] == "error: the run cannot start (2 problems):"
        assert lines[1] == f"  output.path: cannot write in {read_only} (Read-only file system)" or \
            lines[1] == f"  output.path: cannot write in {read_only} (Permission denied)"
        assert lines[2].startswith(f"  workspace_dir: not enough free disk space in {full}: 32.0 KiB free")
        assert tree(read_only, full) == before
