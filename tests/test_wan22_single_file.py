"""Wan 2.2 A14B from single files as ComfyUI ships them: the tiny wan22's two experts written as Wan
2.1 14B-layout transformer files (the high-noise one under `model.diffusion_model.` as model.base,
the low-noise one bare as model.parts.transformer_2.path) load the folder's tensors into their own
experts, with the boundary ratio of the config folder, and train; a base file without the low-noise
path, or an expert's file of another shape, is named before any weight loads."""

from __future__ import annotations

import pytest
import torch
from conftest import train_config
from test_wan_single_file import transformer_to_original

from modules.loading.diffusers_folder import ModelLoadError

EXPERTS = ("transformer", "transformer_2")


def _folder_state(folder, part):
    from safetensors.torch import load_file

    return load_file(str(next((folder / part).glob("*.safetensors"))))


@pytest.fixture(scope="module")
def tiny_wan22(tiny_family_model):
    return tiny_family_model("wan22")


@pytest.fixture(scope="module")
def expert_files(tiny_wan22, tmp_path_factory):
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("wan22-files")
    high = folder / "wan2.2_t2v_high_noise_tiny_fp32.safetensors"
    low = folder / "wan2.2_t2v_low_noise_tiny_fp32.safetensors"
    high_state = transformer_to_original(_folder_state(tiny_wan22, "transformer"))
    save_file({"model.diffusion_model." + k: v.contiguous() for k, v in high_state.items()}, str(high))
    low_state = transformer_to_original(_folder_state(tiny_wan22, "transformer_2"))
    save_file({k: v.contiguous() for k, v in low_state.items()}, str(low))
    return high, low


def _config(tiny_wan22, images, tmp_path, base, low=None, **overlay):
    parts = {"text_encoder": {"path": str(tiny_wan22 / "text_encoder")}, "vae": {"path": str(tiny_wan22 / "vae")}}
    if low is not None:
        parts["transformer_2"] = {"path": str(low)}
    return train_config(base, images, tmp_path, {"model": {"family": "wan22", "parts": parts}}, overlay)


def test_the_two_expert_files_load_the_folders_tensors_and_train(tmp_path, tiny_wan22, one_image, expert_files,
                                                                 monkeypatch):
    from modules.model.detect import detect_family, family_mismatch
    from modules.model.wan22 import Wan22Family
    from modules.trainer.generic_trainer import GenericTrainer

    high, low = expert_files
    assert detect_family(high) == "wan" and family_mismatch(high, "wan22") is None  # a Wan 2.1 14B-layout file
    assert "set model.family to 'wan22'" in family_mismatch(tiny_wan22, "wan")  # a folder still says what it is
    # the tiny model's part configs and model index stand for resources/model_configs/wan22/
    monkeypatch.setattr(Wan22Family, "released_config_folder", classmethod(lambda cls: tiny_wan22))
    config = _config(tiny_wan22, one_image, tmp_path, high, low, schedule={"max_steps": 2, "batch_size": 1})
    trainer = GenericTrainer(config)
    trainer.start()
    family = trainer.family
    assert family.from_single_file("transformer") and family.part_file("transformer_2") == low
    assert family.boundary_ratio == 0.875
    for expert in EXPERTS:  # each file's tensors in its own expert (the two differ)
        folder, loaded = _folder_state(tiny_wan22, expert), family.parts[expert].state_dict()
        assert set(loaded) == set(folder), expert
        assert all(torch.equal(loaded[k].cpu(), folder[k]) for k in folder), expert
    before = {k: v.detach().clone() for k, v in trainer.adapters.state_dict().items()}
    trainer.train()
    after = trainer.adapters.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    path = trainer.end()
    assert sorted(p.name for p in path.parent.iterdir()) == ["lora-high_noise.safetensors",
                                                             "lora-low_noise.safetensors"]


def test_a_missing_or_misshapen_expert_file_is_named_before_any_weight_loads(tmp_path, tiny_wan22, shape_images,
                                                                            expert_files, monkeypatch):
    from safetensors.torch import save_file

    from modules.model.wan22 import Wan22Family
    from modules.trainer.preflight import _model_problems

    high, _ = expert_files
    loaded = []
    monkeypatch.setattr(Wan22Family, "released_config_folder", classmethod(lambda cls: tiny_wan22))
    monkeypatch.setattr(Wan22Family, "load_part", lambda self, part, *a, **k: loaded.append(part))
    with pytest.raises(ModelLoadError, match=r"^model\.parts\.transformer_2\.path: model\.base wan2\.2_t2v_high_noise_"
                                             r"tiny_fp32\.safetensors is one expert's file \(the high-noise one's\); "
                                             r"name the low-noise expert's file here"):
        Wan22Family(_config(tiny_wan22, shape_images, tmp_path, high)).load()
    problems, _ = _model_problems(_config(tiny_wan22, shape_images, tmp_path, high))
    assert str(problems[0]).startswith("model.parts.transformer_2.path: ")  # the preflight's line
    # a 1.3B-shaped file (width and blocks in its header only) as the low-noise expert
    small = tmp_path / "wan2.1_t2v_1.3B_fp16.safetensors"
    save_file({"patch_embedding.weight": torch.zeros(1536, 16, 1, 2, 2, dtype=torch.float8_e4m3fn),
               **{f"blocks.{i}.self_attn.norm_q.weight": torch.zeros(1) for i in range(30)}}, str(small))
    with pytest.raises(ModelLoadError, match=r"^model\.parts\.transformer_2\.path: the file holds a Wan transformer "
                                             r"1536 wide with 30 blocks \(text-to-video\)"):
        Wan22Family(_config(tiny_wan22, shape_images, tmp_path, high, small)).load()
    assert loaded == []


def test_the_released_configs_build_each_expert_and_the_i2v_experts_load_too(tmp_path, tiny_family_model,
                                                                              shape_images):
    """Header-only files of the released shape (5120 wide, 40 blocks) build each expert from its own
    released config, 16 input channels for wan22 and 36 for wan22_i2v; an I2V expert given to wan22
    is named for what it holds. The tiny wan22_i2v's expert files load its folder's tensors."""
    from safetensors.torch import save_file

    from modules.config.families import get_family_class

    def header_file(name, channels):
        path = tmp_path / name
        save_file({"patch_embedding.weight": torch.zeros(5120, channels, 1, 2, 2, dtype=torch.float8_e4m3fn),
                   **{f"blocks.{i}.self_attn.norm_q.weight": torch.zeros(1) for i in range(40)}}, str(path))
        return path

    def family(name, base, low, configs=None):
        parts = {"text_encoder": {"path": str(tmp_path)}, "vae": {"path": str(tmp_path)},
                 "transformer_2": {"path": str(low)}}
        built = get_family_class(name)(train_config(base, shape_images, tmp_path,
                                                    {"model": {"family": name, "parts": parts}}))
        built.model_configs_dir = configs
        return built

    for name, channels in (("wan22", 16), ("wan22_i2v", 36)):
        high, low = header_file(f"{name}_high.safetensors", channels), header_file(f"{name}_low.safetensors", channels)
        experts = family(name, high, low)
        for expert in EXPERTS:
            folder = experts.part_folder(expert)
            assert (folder.parent.name, folder.name) == (name, expert)
    misfit = family("wan22", tmp_path / "wan22_i2v_high.safetensors", tmp_path / "wan22_i2v_low.safetensors")
    for _ in range(2):  # the config asked for, then the file opened as the preflight and the load open it
        with pytest.raises(ModelLoadError, match=r"^model\.base: the file holds a Wan transformer 5120 wide with 40 "
                                                 r"blocks \(image-to-video\)"):
            misfit.part_folder("transformer")
        with pytest.raises(ModelLoadError, match=r"^model\.base: the file holds a Wan transformer 5120 wide with 40 "
                                                 r"blocks \(image-to-video\)"):
            misfit.single_file_stream()  # checked again each time, not taken as passed
    tiny = tiny_family_model("wan22_i2v")
    files = []
    for expert in EXPERTS:
        files.append(tmp_path / f"i2v_{expert}.safetensors")
        state = transformer_to_original(_folder_state(tiny, expert))
        save_file({k: v.contiguous() for k, v in state.items()}, str(files[-1]))
    parts = {"text_encoder": {"path": str(tiny / "text_encoder")}, "vae": {"path": str(tiny / "vae")},
             "transformer_2": {"path": str(files[1])}}
    i2v = get_family_class("wan22_i2v")(train_config(files[0], shape_images, tmp_path,
                                                     {"model": {"family": "wan22_i2v", "parts": parts}}))
    i2v.model_configs_dir = tiny
    i2v.load()
    assert i2v.boundary_ratio == 0.9
    for expert in EXPERTS:
        folder, loaded = _folder_state(tiny, expert), i2v.parts[expert].state_dict()
        assert set(loaded) == set(folder) and all(torch.equal(loaded[k], folder[k]) for k in folder), expert
