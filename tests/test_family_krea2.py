"""Krea-2 on a tiny offline model: training learns under the flow target (transformer and the
Qwen3-VL language model) and the loss falls; the prompt embeddings are Krea2Pipeline's own
(template, padding before the suffix, real-token positions, the model index's tapped layers, 34
tokens dropped, mask); padding tokens are masked; the base model's sigmas shift by the image's
size and the distilled one's by the fixed mu; diffusers files load in `Krea2Pipeline.load_lora_weights`
with every adapter used and compute what the trainer's hooked model computes; every saved stem is
one ComfyUI maps; blocks run in the listed order; the single original-layout transformer file loads
the folder's tensors; sampling runs CFG from the live modules; quantized transformers train;
offloading half the blocks trains the same adapter; a resumed run equals an uninterrupted one."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from conftest import fixed_loss, train_config
from family_cross import (
    loads_beside_a_skeleton_denoiser,
    perturbed_adapters,
    prediction_with,
)

from modules.adapters.adapter_set import build_adapter_set
from modules.adapters.formats.files import (
    file_state,
    format_warnings,
    save_adapter_file,
)
from modules.config.train_config import AdapterConfig


@pytest.fixture(scope="session")
def tiny_krea2(tiny_family_model):
    return tiny_family_model("krea2")


@pytest.fixture(scope="module")
def family(tmp_path_factory, tiny_krea2, shape_images):
    from modules.model.krea2 import Krea2Family

    family = Krea2Family(train_config(tiny_krea2, shape_images, tmp_path_factory.mktemp("krea2"),
                                      {"model": {"family": "krea2"}}))
    family.load()
    return family


def test_krea2_trains_the_transformer_and_the_loss_falls(tmp_path, tiny_krea2, one_image):
    """(The text encoder trains under the first-step guard in tests/test_unreachable_layers.py.)"""
    from safetensors import safe_open

    from modules.trainer.generic_trainer import GenericTrainer

    config = train_config(tiny_krea2, one_image, tmp_path, {
        "model": {"family": "krea2", "parts": {"transformer": {"gradient_checkpointing": True}}},
        "adapter": {"layer_preset": "all-linear", "rank": 16, "alpha": 16}, "schedule": {"epochs": 10, "batch_size": 1},
        "optimizer": {"lr": 1e-2},
    })
    trainer = GenericTrainer(config)
    trainer.start()
    before = fixed_loss(trainer, draws=8)
    trainer.train()  # the first step's guard checks every adapter learned
    after = fixed_loss(trainer, draws=8)
    path = trainer.end()
    assert after < before * 0.8, (before, after)
    with safe_open(str(path), "pt") as file:
        keys = list(file.keys())
        assert file.metadata()["ss_base_model_version"] == "krea2"
    for stem in ("lora_unet_blocks_0_attn_wq", "lora_unet_blocks_1_attn_gate", "lora_unet_blocks_1_mlp_down",
                 "lora_unet_txtfusion_layerwise_blocks_0_attn_wo", "lora_unet_txtfusion_projector",
                 "lora_unet_first", "lora_unet_tproj_1", "lora_unet_txtmlp_3", "lora_unet_last_linear"):
        assert f"{stem}.lora_down.weight" in keys, stem


def _pipeline(folder):
    from diffusers import Krea2Pipeline

    return Krea2Pipeline.from_pretrained(str(folder), local_files_only=True)


def test_the_embeddings_are_the_pipelines_and_predict_targets_the_flow(family, tiny_krea2):
    """Krea2Pipeline.encode_prompt on its own Qwen3VLModel gives the family's embeddings and mask
    (the tiny model index taps hidden states 1 and 2); predict targets noise - latents."""
    captions = ["a red circle", "a much longer caption about a small blue square"]
    text = family.encode_text(family.tokenize(captions))
    pipe = _pipeline(tiny_krea2)
    assert family.select_layers == tuple(pipe.text_encoder_select_layers) == (1, 2)
    with torch.no_grad():
        embeds, mask = pipe.encode_prompt(captions, device=torch.device("cpu"),
                                          max_sequence_length=family.max_sequence_length)
    assert embeds.shape == text["hidden_states"].shape == (2, family.max_sequence_length, 2, 32)
    assert torch.equal(mask, text["attention_mask"].bool())
    assert (embeds - text["hidden_states"]).abs().max() < 1e-5
    assert mask.sum(1)[0] < mask.sum(1)[1] and mask[:, -1].all()  # padding before the (real) suffix

    latents = torch.randn(2, 16, 8, 12, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        prediction, target, *_ = family.predict(latents, text, torch.Generator().manual_seed(3))
    assert prediction.shape == latents.shape
    noise = torch.randn(latents.shape, generator=torch.Generator().manual_seed(3))
    assert torch.allclose(target, noise - latents)


def test_padding_tokens_are_masked(family):
    """A caption padded to 16 or to 24 text tokens predicts the same (padding takes no position and
    no attention); a longer caption does not."""
    latents = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(1))
    length = family.tokenizer.model_max_length

    def prediction(caption, max_length):
        family.tokenizer.model_max_length = max_length
        try:
            text = family.encode_text(family.tokenize([caption]))
        finally:
            family.tokenizer.model_max_length = length
        with torch.no_grad():
            return family.denoise(latents, torch.tensor([0.5]), text)

    short, long = prediction("a cat", 34 + 16), prediction("a cat", 34 + 24)
    assert torch.allclose(short, long, atol=1e-5), (short - long).abs().max()
    assert (prediction("a cat sat", 34 + 16) - short).abs().max() > 1e-4


def test_denoise_is_the_pipelines_transformer_call(family):
    """The packed latents, position ids and sigma-as-timestep the pipeline hands its transformer."""
    pipe_class = type(family.pipeline())
    latents = torch.randn(1, 16, 8, 12, generator=torch.Generator().manual_seed(2))
    text = family.encode_text(family.tokenize(["a cat"]))
    pipe = family.pipeline()
    packed = pipe._pack_latents(latents, 1, 16, 8, 12)
    assert torch.equal(family._pack(latents), packed)
    assert torch.equal(family._unpack(packed, 8, 12), latents)
    ids = pipe_class.prepare_position_ids(text["hidden_states"].shape[1], 4, 6, "cpu")
    with torch.no_grad():
        theirs = family.transformer(hidden_states=packed, encoder_hidden_states=text["hidden_states"],
                                    timestep=torch.tensor([0.3]), position_ids=ids,
                                    encoder_attention_mask=text["attention_mask"].bool(), return_dict=False)[0]
        ours = family.denoise(latents, torch.tensor([0.3]), text)
    assert torch.allclose(ours, pipe._unpack_latents(theirs, 32, 48).squeeze(2), atol=1e-6)


def test_training_sigmas_shift_as_the_pipeline_samples(family, monkeypatch):
    """The base model: mu from the token count (256/6400, 0.5/1.15 of its scheduler config); the
    distilled one: the fixed mu 1.15, whatever the size."""
    from diffusers.pipelines.krea2.pipeline_krea2 import calculate_shift

    unit = torch.tensor([0.2, 0.5, 0.8])
    monkeypatch.setattr(family, "training_times", lambda batch, generator: unit)

    def shifted(mu):
        return math.exp(mu) / (math.exp(mu) + (1 / unit - 1))

    config = family.noise_scheduler.config
    for tokens in (256, 4096):
        mu = calculate_shift(tokens, config.base_image_seq_len, config.max_image_seq_len, config.base_shift,
                             config.max_shift)
        assert torch.allclose(family.sample_sigmas(3, tokens, None), shifted(mu))
    assert config.max_image_seq_len == 6400 and config.max_shift == 1.15
    monkeypatch.setattr(family, "is_distilled", True)
    assert torch.allclose(family.sample_sigmas(3, 256, None), shifted(1.15))
    assert torch.allclose(family.sample_sigmas(3, 4096, None), shifted(1.15))


def test_the_model_index_says_distilled(tiny_family_model, shape_images, tmp_path):
    from modules.model.detect import detect_family
    from modules.model.krea2 import Krea2Family

    folder = tiny_family_model("krea2", is_distilled=True)
    assert json.loads((folder / "model_index.json").read_text())["is_distilled"] is True
    assert detect_family(folder) == "krea2"
    family = Krea2Family(train_config(folder, shape_images, tmp_path, {"model": {"family": "krea2"}}))
    family.load()
    assert family.is_distilled and family.pipeline().config.is_distilled


def test_load_lora_weights_matches_the_hooked_model(family, tiny_krea2, tmp_path):
    """Every Linear layer of the transformer, in a diffusers file, loads in Krea2Pipeline with no
    adapter left out and computes what the trainer's hooked model computes."""
    from peft.tuners.lora import LoraLayer

    from modules.adapters.formats.files import load_adapter_file

    adapters = perturbed_adapters(family, ["transformer"], layer_preset="all-linear")
    try:
        path = tmp_path / "krea2-diffusers.safetensors"
        save_adapter_file(path, adapters, family, "diffusers", torch.float32, {})
        ours, count, state = prediction_with(family, family.transformer, 16), len(adapters), adapters.state_dict()
        assert not format_warnings("diffusers", adapters, family)
        assert any("loads nothing" in w for w in format_warnings("kohya", adapters, family))
        assert any("refuses" in w for w in format_warnings("comfy", adapters, family))
    finally:
        adapters.unhook()
    again = build_adapter_set(family, AdapterConfig(rank=4, alpha=2, layer_preset="all-linear"), ["transformer"],
                              torch.device("cpu"))
    try:  # and the file reads back into the trainer's adapters
        load_adapter_file(path, again, family)
        assert all(torch.allclose(tensor, state[key], atol=1e-7) for key, tensor in again.state_dict().items())
    finally:
        again.unhook()
    plain = prediction_with(family, family.transformer, 16)
    pipe = _pipeline(tiny_krea2)
    pipe.load_lora_weights(str(path))
    assert sum(isinstance(m, LoraLayer) for m in pipe.transformer.modules()) == count
    theirs = prediction_with(family, pipe.transformer, 16)
    assert (ours - plain).abs().max() > 1e-3
    assert (ours - theirs).abs().max() < 1e-5


def test_diffusers_loads_nothing_from_kohya_and_refuses_comfy_files(family, tiny_krea2, tmp_path):
    """What the run warns: Krea2LoraLoaderMixin has no rule for lora_unet_ names (nothing loads)
    and its converter raises on a comfy file's lora_down/lora_up/alpha."""
    from peft.tuners.lora import LoraLayer

    adapters = perturbed_adapters(family, ["transformer"], layer_preset="attn")
    try:
        for fmt in ("kohya", "comfy"):
            save_adapter_file(tmp_path / f"{fmt}.safetensors", adapters, family, fmt, torch.float32, {})
    finally:
        adapters.unhook()
    pipe = _pipeline(tiny_krea2)
    pipe.load_lora_weights(str(tmp_path / "kohya.safetensors"))
    assert not any(isinstance(m, LoraLayer) for m in pipe.transformer.modules())
    with pytest.raises(ValueError, match="should be empty"):
        pipe.load_lora_weights(str(tmp_path / "comfy.safetensors"))


# ComfyUI's key map for Krea 2 (comfy/lora.py, a fact reproduced independently): its model keeps the
# original Krea 2 names (comfy/ldm/krea2/model.py), and per weight `diffusion_model.<X>` it maps
# `lora_unet_<X with _>` and `diffusion_model.<X>`; its Krea2 branch adds, per diffusers Linear <D> of
# comfy/utils.py krea2_to_diffusers, `<D>`, `diffusion_model.<D>`, `transformer.<D>`, `lycoris_<D with _>`;
# the Qwen3-VL language model only as `text_encoders.qwen3vl_4b.transformer.model.<k>`.
_COMFY_NATIVE = {"img_in": "first", "time_embed.linear_1": "tmlp.0", "time_embed.linear_2": "tmlp.2",
                 "time_mod_proj": "tproj.1", "txt_in.linear_1": "txtmlp.1", "txt_in.linear_2": "txtmlp.3",
                 "text_fusion.projector": "txtfusion.projector", "final_layer.linear": "last.linear"}
_COMFY_BLOCK = {"attn.to_q": "attn.wq", "attn.to_k": "attn.wk", "attn.to_v": "attn.wv", "attn.to_gate": "attn.gate",
                "attn.to_out.0": "attn.wo", "ff.gate": "mlp.gate", "ff.up": "mlp.up", "ff.down": "mlp.down"}


def _comfyui_krea2_map(family) -> set[str]:
    transformer = family.transformer
    to_native = dict(_COMFY_NATIVE)
    blocks = [(f"transformer_blocks.{i}", f"blocks.{i}") for i in range(len(transformer.transformer_blocks))]
    for kind in ("layerwise_blocks", "refiner_blocks"):
        blocks += [(f"text_fusion.{kind}.{i}", f"txtfusion.{kind}.{i}")
                   for i in range(len(getattr(transformer.text_fusion, kind)))]
    for diffusers_block, native_block in blocks:
        to_native |= {f"{diffusers_block}.{d}": f"{native_block}.{n}" for d, n in _COMFY_BLOCK.items()}
    stems = set()
    for d, x in to_native.items():
        stems |= {f"lora_unet_{x.replace('.', '_')}", f"diffusion_model.{x}", d, f"diffusion_model.{d}",
                  f"transformer.{d}", f"lycoris_{d.replace('.', '_')}"}
    for key in family.parts["text_encoder"].state_dict():
        if key.endswith(".weight"):
            stems.add(f"text_encoders.qwen3vl_4b.transformer.model.{key.removesuffix('.weight')}")
    return stems


def test_comfyuis_map_names_every_linear_layer_of_the_transformer(family):
    linears = {n for n, m in family.transformer.named_modules() if isinstance(m, torch.nn.Linear)}
    assert {s.removeprefix("transformer.") for s in _comfyui_krea2_map(family) if s.startswith("transformer.")} == linears


@pytest.mark.parametrize("adapter", [{"type": "lora"}, {"type": "lokr"}], ids=["lora", "lokr"])
def test_every_saved_stem_is_one_comfyui_maps(family, adapter):
    from modules.saving.consumers import comfyui

    adapters = build_adapter_set(family, AdapterConfig(rank=2, layer_preset="all-linear", **adapter),
                                 ["transformer", "text_encoder"], torch.device("cpu"))
    try:
        comfy_map = _comfyui_krea2_map(family)
        assert comfyui.stems(family) == comfy_map
        for fmt in ("kohya", "comfy", "diffusers"):
            stems = {re.sub(r"\.(lora_down\.weight|lora_up\.weight|lora_A\.weight|lora_B\.weight|alpha|lokr_\w+)$",
                            "", k) for k in file_state(adapters, family, fmt)}
            if fmt == "diffusers":  # ComfyUI reads the transformer's diffusers names, not text_encoder.
                stems = {s for s in stems if s.startswith("transformer.")}
            assert stems and not stems - comfy_map, (fmt, sorted(stems - comfy_map)[:5])
    finally:
        adapters.unhook()


def test_the_transformer_runs_its_blocks_in_the_listed_order(family):
    from family_cross import blocks_run_in_listed_order

    fusion = family.transformer.text_fusion
    assert family.checkpoint_blocks("transformer") == [*fusion.layerwise_blocks, *fusion.refiner_blocks,
                                                       *family.transformer.transformer_blocks]
    latents = torch.randn(1, 16, 8, 8)
    text = family.encode_text(family.tokenize(["a"]))
    blocks_run_in_listed_order(family, "transformer", lambda: family.denoise(latents, torch.tensor([0.5]), text))
    blocks_run_in_listed_order(family, "text_encoder", lambda: family.encode_text(family.tokenize(["a"])))


def _original_layout_file(path, tiny_krea2, family):
    """The tiny transformer written as an original-layout Krea 2 file (`blocks.0.attn.wq`, `txtfusion.`,
    `last.modulation.lin`, under model.diffusion_model.)."""
    from safetensors.torch import load_file, save_file

    from modules.model.keys.krea2 import krea2_original_module_name

    folder = load_file(str(next((tiny_krea2 / "transformer").glob("*.safetensors"))))
    original = {}
    for key, tensor in folder.items():
        module, _, leaf = key.rpartition(".")
        if leaf == "weight" and isinstance(family.transformer.get_submodule(module), torch.nn.Linear):
            name = f"{krea2_original_module_name(family.transformer, module)}.weight"
        elif leaf == "bias":
            name = f"{krea2_original_module_name(family.transformer, module)}.bias"
        else:  # norms and modulation tables, as the original names them
            name = (key.replace("transformer_blocks.", "blocks.").replace("text_fusion.", "txtfusion.")
                    .replace(".norm1.weight", ".prenorm.scale").replace(".norm2.weight", ".postnorm.scale")
                    .replace(".attn.norm_q.weight", ".attn.qknorm.qnorm.scale")
                    .replace(".attn.norm_k.weight", ".attn.qknorm.knorm.scale")
                    .replace("txt_in.norm.weight", "txtmlp.0.scale").replace("final_layer.norm.weight", "last.norm.scale")
                    .replace("final_layer.scale_shift_table", "last.modulation.lin"))
            if re.fullmatch(r"blocks\.\d+\.scale_shift_table", name):
                name, tensor = name.replace("scale_shift_table", "mod.lin"), tensor.reshape(-1)
        original["model.diffusion_model." + name] = tensor.contiguous()
    assert not any("transformer_blocks" in k or "scale_shift_table" in k for k in original)
    save_file(original, str(path))
    return path


def _load_single_file(path, tiny_krea2, shape_images, tmp_path):
    from modules.model.krea2 import Krea2Family

    config = train_config(path, shape_images, tmp_path, {"model": {
        "family": "krea2", "parts": {"text_encoder": {"path": str(tiny_krea2 / "text_encoder")},
                                     "vae": {"path": str(tiny_krea2 / "vae")}}}})
    from_file = Krea2Family(config)
    from_file.model_configs_dir = tiny_krea2  # the tiny model's part configs and model index (Raw's)
    from_file.load()
    return from_file


def test_the_single_transformer_file_loads_the_folders_tensors(tmp_path, tiny_krea2, shape_images, family):
    """An original-layout Krea 2 transformer file converted by diffusers' converter; text encoder and VAE
    from folders."""
    from modules.model.detect import detect_family

    path = _original_layout_file(tmp_path / "krea2.safetensors", tiny_krea2, family)
    assert detect_family(path) == "krea2"
    assert detect_family(tiny_krea2) == "krea2"
    from_file = _load_single_file(path, tiny_krea2, shape_images, tmp_path)
    assert not from_file.is_distilled  # Raw's model index, and the file's name says nothing else
    ours, theirs = from_file.transformer.state_dict(), family.transformer.state_dict()
    assert set(ours) == set(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.parametrize("name", ["turbo.safetensors", "krea2_turbo_bf16.safetensors", "Krea-2-Distilled.safetensors"])
def test_a_distilled_single_file_is_told_apart_by_its_name(tmp_path, tiny_krea2, shape_images, family, name):
    """The Turbo (distilled) checkpoint has Raw's keys and shapes, and a single file is read with Raw's
    model index: the file's name (Krea's turbo.safetensors, ComfyUI's krea2_turbo_*) marks it distilled,
    so training draws times at the fixed shift and the pipeline samples as distilled, as from the folder."""
    path = _original_layout_file(tmp_path / name, tiny_krea2, family)
    turbo = _load_single_file(path, tiny_krea2, shape_images, tmp_path)
    assert turbo.is_distilled and turbo.pipeline().config.is_distilled  # the shift: the test above


def test_sample_runs_cfg_from_the_live_modules(family, monkeypatch):
    from diffusers import Krea2Transformer2DModel

    from modules.config.train_config import SamplePromptConfig

    calls = []
    forward = Krea2Transformer2DModel.forward
    monkeypatch.setattr(Krea2Transformer2DModel, "forward",
                        lambda self, *a, **k: calls.append(k["encoder_attention_mask"]) or forward(self, *a, **k))
    prompt = SamplePromptConfig(prompt="a red circle", steps=2, cfg=3.0, width=64, height=64, seed=3)
    image = family.sample(prompt, torch.device("cpu"))
    assert image.size == (64, 64)
    assert image.getextrema() != ((0, 0), (0, 0), (0, 0))
    assert len(calls) == 4  # two steps, each with the prompt and the (empty) negative prompt
    assert all(mask is not None and not mask.all() for mask in calls)  # padding masked while sampling too
    calls.clear()
    family.sample(prompt.model_copy(update={"cfg": 1.0}), torch.device("cpu"))
    assert len(calls) == 2  # cfg 1: no guidance


def test_an_nf4_transformer_trains(tmp_path, tiny_krea2, one_image):
    from family_cross import initializes_and_steps

    initializes_and_steps(tiny_krea2, one_image, tmp_path, "krea2", "transformer", "nf4", dora=False)


def test_an_fp8_transformer_trains_and_keeps_its_norms_float32(tmp_path, tiny_krea2, one_image, monkeypatch):
    """A float8 transformer takes a step; Krea2Transformer2DModel's _keep_in_fp32_modules (its
    zero-centred RMSNorm scales) stay float32 and its time embedding (_skip_layerwise_casting_patterns)
    and final layer stay dense."""
    from family_cross import initializes_and_steps

    from modules.trainer.generic_trainer import GenericTrainer

    trainers = []
    start = GenericTrainer.start
    monkeypatch.setattr(GenericTrainer, "start", lambda self: trainers.append(self) or start(self))
    initializes_and_steps(tiny_krea2, one_image, tmp_path, "krea2", "transformer", "float8", dora=False,
                          overlay={"train_dtype": "bfloat16"})
    transformer = trainers[0].family.transformer
    assert transformer.transformer_blocks[0].norm1.weight.dtype == torch.float32
    assert transformer.transformer_blocks[0].attn.norm_q.weight.dtype == torch.float32
    assert transformer.txt_in.norm.weight.dtype == torch.float32
    assert type(transformer.time_embed.linear_1) is torch.nn.Linear  # stays dense
    assert type(transformer.final_layer.linear) is torch.nn.Linear
    assert type(transformer.transformer_blocks[0].attn.to_q) is not torch.nn.Linear  # quantized


def test_offloading_half_the_transformer_trains_the_same_adapter(fake_device, tmp_path, tiny_krea2, one_image):
    from family_cross import offloaded_training_matches

    offloaded_training_matches(tiny_krea2, one_image, tmp_path, "krea2", "transformer", fake_device)


def test_a_resumed_run_equals_an_uninterrupted_one(tmp_path, tiny_krea2, one_image):
    from family_cross import resumed_training_matches

    resumed_training_matches(tiny_krea2, one_image, tmp_path, "krea2")


def test_a_skeleton_transformer_leaves_the_load_unchanged(family):
    loads_beside_a_skeleton_denoiser(family)  # what `launch.py cache` loads
