"""adapter.init_from with one expert's file (issue 28): a Wan 2.2 A14B run saves one file per expert,
each under a lone Wan transformer's names, so a run starts its trained expert from such a file
whichever expert wrote it; with both experts trained, a file named for one expert starts that one
and its sibling file the other, and a file named for neither (a Wan 2.1 LoRA) starts both. A
backup's layout (the low-noise expert's own `lora_unet2_` names) loads as it is."""

from __future__ import annotations

import pytest
import torch
from conftest import train_config
from family_cross import perturbed_adapters

from modules.adapters.formats.files import save_adapter_file
from modules.trainer.generic_trainer import GenericTrainer

EXPERTS = ("transformer", "transformer_2")


@pytest.fixture(scope="module")
def tiny_wan22(tiny_family_model):
    return tiny_family_model("wan22")


@pytest.fixture(scope="module")
def saved(tiny_wan22, shape_images, tmp_path_factory):
    """(the perturbed two-expert adapter state, the folder of its saved lora-high_noise / lora-low_noise files)."""
    from modules.model.wan22 import Wan22Family

    folder = tmp_path_factory.mktemp("wan22-init")
    family = Wan22Family(train_config(tiny_wan22, shape_images, folder, {"model": {"family": "wan22"}}))
    family.load()
    adapters = perturbed_adapters(family, list(EXPERTS))
    for suffix, parts in family.adapter_files(list(EXPERTS)):
        save_adapter_file(folder / f"lora{suffix}.safetensors", adapters.written_as(parts, family), family, "kohya",
                          torch.float32, {})
    return {k: v.detach().clone() for k, v in adapters.state_dict().items()}, folder


def _started(tiny_wan22, images, tmp_path, init_from, parts=None):
    config = train_config(tiny_wan22, images, tmp_path, {"model": {"family": "wan22", "parts": parts or {}},
                                                         "adapter": {"init_from": str(init_from)}})
    warnings = []
    trainer = GenericTrainer(config)
    trainer.callbacks.on_warning = warnings.append
    trainer.start()
    return {k: v.detach().cpu() for k, v in trainer.adapters.state_dict().items()}, warnings


def _expert(state, prefix):
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def test_one_experts_file_starts_the_one_trained_expert_and_a_pair_starts_both(tmp_path, tiny_wan22, one_image, saved):
    state, folder = saved
    high, low = _expert(state, "lora_unet_"), _expert(state, "lora_unet2_")
    assert high and low and any(not torch.equal(high[k], low[k]) for k in high)  # the two experts' differ
    ours, warnings = _started(tiny_wan22, one_image, tmp_path, folder / "lora-high_noise.safetensors",
                              {"transformer": {"train": False}})
    assert set(ours) == {f"lora_unet2_{k}" for k in high}  # the low-noise expert's, from the high-noise file
    assert all(torch.equal(ours[f"lora_unet2_{k}"], high[k]) for k in high)
    assert "adapter.init_from: started lora-high_noise.safetensors -> transformer_2" in warnings
    ours, warnings = _started(tiny_wan22, one_image, tmp_path / "both", folder / "lora-low_noise.safetensors")
    assert set(ours) == set(state) and all(torch.equal(ours[k], state[k]) for k in state)  # each from its own file
    assert ("adapter.init_from: started lora-high_noise.safetensors -> transformer; lora-low_noise.safetensors -> "
            "transformer_2") in warnings


def test_which_files_start_which_expert(tiny_wan22, shape_images, tmp_path, saved):
    from safetensors.torch import save_file

    from modules.model.wan22 import Wan22Family

    _, folder = saved
    family = Wan22Family(train_config(tiny_wan22, shape_images, tmp_path, {"model": {"family": "wan22"}}))
    lone = folder / "lora-high_noise.safetensors"
    wan21 = tmp_path / "wan21_lora.safetensors"  # named for neither expert: both start from it
    wan21.write_bytes(lone.read_bytes())
    assert family.init_from_files(wan21, [*EXPERTS, "text_encoder"]) == [
        (wan21, {"transformer": "transformer", "text_encoder": "text_encoder"}), (wan21, {"transformer_2": "transformer"})]
    alone = tmp_path / "x-low_noise.safetensors"  # no sibling: only its own expert starts from it
    alone.write_bytes(lone.read_bytes())
    assert family.init_from_files(alone, list(EXPERTS)) == [(alone, {"transformer_2": "transformer"})]
    backup = tmp_path / "backup.safetensors"  # both experts under their own names: the run's layout
    save_file({"lora_unet2_blocks_0_self_attn_q.lora_up.weight": torch.zeros(1)}, str(backup))
    assert family.init_from_files(backup, list(EXPERTS)) is None
    assert family.init_from_files(lone, ["text_encoder"]) is None  # no expert trains


def test_a_remote_run_sends_the_other_experts_file_too(tmp_path, tiny_wan22, shape_images, saved):
    """The box's run finds the sibling beside the named file, as here: both go to data/init/."""
    from modules.remote.run import RemoteRun

    _, folder = saved
    config = train_config(tiny_wan22, shape_images, tmp_path, {
        "model": {"family": "wan22"}, "adapter": {"init_from": str(folder / "lora-low_noise.safetensors")}})
    pairs, data = RemoteRun(None, tmp_path / "ws", tmp_path / "out.safetensors", "/box")._plan(config, False)
    assert {rel for _, rel, _, _ in pairs if rel.startswith("data/init/")} == {
        "data/init/lora-high_noise.safetensors", "data/init/lora-low_noise.safetensors"}
    assert data["adapter"]["init_from"] == "/box/data/init/lora-low_noise.safetensors"
    one_expert = config.model_copy(deep=True)
    one_expert.model.parts["transformer"].train = False  # only the named file starts the run
    pairs, _ = RemoteRun(None, tmp_path / "ws", tmp_path / "out.safetensors", "/box")._plan(one_expert, False)
    assert {rel for _, rel, _, _ in pairs if rel.startswith("data/init/")} == {"data/init/lora-low_noise.safetensors"}
