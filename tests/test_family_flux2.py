"""FLUX.2 [klein] and [dev] on tiny offline models: the family's text and latent encodings equal
Flux2KleinPipeline's own, training learns (transformer and Qwen3), the saved files load in
`Flux2KleinPipeline.load_lora_weights` with every adapter used and compute what the trainer's
hooked model computes, blocks run in the listed order, the single original-layout transformer
file loads the folder's tensors, quantized and offloaded training work, and sampling draws an image."""

from __future__ import annotations

import pytest
import torch
from conftest import fixed_loss, train_config
from family_cross import loads_beside_a_skeleton_denoiser, perturbed_adapters, prediction_with

from modules.adapters.formats.files import save_adapter_file


@pytest.fixture(scope="session")
def tiny_flux2(tiny_family_model):
    return tiny_family_model("flux2")


def _loaded_family(model, shape_images, workspace):
    from modules.model.flux2 import Flux2Family

    family = Flux2Family(train_config(model, shape_images, workspace, {"model": {"family": "flux2"}}))
    family.load()
    return family


@pytest.fixture(scope="module")
def family(tmp_path_factory, tiny_flux2, shape_images):
    return _loaded_family(tiny_flux2, shape_images, tmp_path_factory.mktemp("flux2"))


@pytest.fixture(scope="module")
def pipe(tiny_flux2):
    from diffusers import Flux2KleinPipeline

    return Flux2KleinPipeline.from_pretrained(str(tiny_flux2), local_files_only=True)


def test_flux2_trains_the_transformer_and_qwen3_and_the_loss_falls(tmp_path, tiny_flux2, one_image):
    from safetensors import safe_open

    from modules.trainer.generic_trainer import GenericTrainer

    config = train_config(tiny_flux2, one_image, tmp_path, {
        "model": {"family": "flux2", "parts": {"transformer": {"gradient_checkpointing": True},
                                               "text_encoder": {"train": True}}},
        "adapter": {"layer_preset": "all-linear"}, "schedule": {"epochs": 20, "batch_size": 1},
        "optimizer": {"lr": 1.5e-2},
    })
    trainer = GenericTrainer(config)
    trainer.start()
    assert "text_encoder.layers.27.self_attn.q_proj" in trainer.adapters.left_out  # never read: no adapter
    before = fixed_loss(trainer, draws=8)
    trainer.train()  # the first step's guard checks every adapter, Qwen3's too, learned
    after = fixed_loss(trainer, draws=8)
    path = trainer.end()
    assert after < before * 0.8, (before, after)
    with safe_open(str(path), "pt") as file:
        keys = list(file.keys())
        assert file.metadata()["ss_base_model_version"] == "flux2"
        assert file.metadata()["modelspec.architecture"] == "flux-2-klein-4b/lora"
    for stem in ("lora_unet_double_blocks_0_img_attn_qkv", "lora_unet_double_blocks_0_txt_mlp_0",
                 "lora_unet_single_blocks_1_linear1", "lora_unet_single_blocks_1_linear2",
                 "lora_unet_double_stream_modulation_img_lin",
                 "text_encoders.qwen3_4b.transformer.model.layers.26.self_attn.q_proj"):
        assert f"{stem}.lora_down.weight" in keys, stem


def test_encodings_are_the_pipelines(family, pipe):
    """Stacked Qwen3 layers 9/18/27 of the chat-templated prompt, and the patchified latents
    normalised by the VAE's batch-norm statistics, as Flux2KleinPipeline computes them."""
    captions = ["a red circle", "a blue square on green"]
    ours = family.encode_text(family.tokenize(captions))["hidden_states"]
    with torch.no_grad():
        theirs = pipe._get_qwen3_prompt_embeds(pipe.text_encoder, pipe.tokenizer, captions,
                                               max_sequence_length=family.max_sequence_length)
    assert ours.shape == theirs.shape == (2, family.max_sequence_length, family.transformer.config.joint_attention_dim)
    assert torch.allclose(ours, theirs, atol=1e-6)
    pixels = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with torch.no_grad():
        latents = family.encode_images(pixels)
        expected = pipe._encode_vae_image(pixels, generator=None)
    assert latents.shape == (1, 32, 16, 16)
    assert torch.allclose(latents, expected, atol=1e-6)


def test_predict_targets_the_flow_at_the_pipelines_shift(family):
    import math

    from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

    latents = torch.randn(2, 32, 8, 12, generator=torch.Generator().manual_seed(0))
    text = family.encode_text(family.tokenize(["a", "b"]))
    with torch.no_grad():
        prediction, target, *_ = family.predict(latents, text, torch.Generator().manual_seed(3))
    assert prediction.shape == latents.shape
    noise = torch.randn(latents.shape, generator=torch.Generator().manual_seed(3))
    assert torch.allclose(target, noise - latents)
    # the median draw (logit-normal around 0.5) sits where the pipeline's mu for 8x12 tokens puts it
    unit = torch.full((1,), 0.5)
    mu = compute_empirical_mu(96, 50)
    family.training_times = lambda batch, generator: unit
    try:
        sigma = family.sample_sigmas(1, family.sequence_length(latents), torch.Generator())
    finally:
        del family.training_times
    assert math.isclose(sigma.item(), math.exp(mu) / (math.exp(mu) + 1), rel_tol=1e-6)


@pytest.mark.parametrize(("fmt", "preset"), [("diffusers", "all-linear"), ("kohya", "attn-mlp")])
def test_load_lora_weights_matches_the_hooked_model(family, pipe, tmp_path, fmt, preset):
    """The saved file loads in Flux2KleinPipeline with no adapter left out (the diffusers file on
    every Linear layer, the kohya one with q/k/v stacked on the original layers) and computes what
    the trainer computes."""
    from peft.tuners.lora import LoraLayer

    from modules.adapters.formats.files import format_warnings

    adapters = perturbed_adapters(family, ["transformer"], layer_preset=preset)
    try:
        path = tmp_path / f"flux2-{fmt}.safetensors"
        save_adapter_file(path, adapters, family, fmt, torch.float32, {})
        ours, count = prediction_with(family, family.transformer, 32), len(adapters)
        # diffusers loads it all (ComfyUI's FLUX.1 names miss some, test_consumer_keys says which)
        assert not [w for w in format_warnings(fmt, adapters, family) if "load_lora_weights" in w]
    finally:
        adapters.unhook()
    plain = prediction_with(family, family.transformer, 32)
    pipe.load_lora_weights(str(path))
    try:
        assert sum(isinstance(m, LoraLayer) for m in pipe.transformer.modules()) == count
        theirs = prediction_with(family, pipe.transformer, 32)
    finally:
        pipe.unload_lora_weights()
    assert (ours - plain).abs().max() > 1e-3
    assert (ours - theirs).abs().max() < 1e-5


def test_the_run_says_which_adapters_diffusers_drops(family):
    from modules.adapters.formats.files import format_warnings

    adapters = perturbed_adapters(family, ["transformer", "text_encoder"], layer_preset="all-linear")
    try:
        said = [w for w in format_warnings("kohya", adapters, family) if "diffusers' load_lora_weights" in w]
    finally:
        adapters.unhook()
    assert len(said) == 2, said
    assert any("model.parts.text_encoder.train" in w for w in said)
    assert any("modulation" in w and "will not load 4 " in w for w in said), said  # 3 modulations, final adaLN


def test_the_blocks_run_in_the_listed_order(family):
    from family_cross import blocks_run_in_listed_order

    transformer = family.transformer
    assert family.checkpoint_blocks("transformer") == [*transformer.transformer_blocks,
                                                       *transformer.single_transformer_blocks]
    latents = torch.randn(1, 32, 8, 8)
    text = family.encode_text(family.tokenize(["a"]))
    blocks_run_in_listed_order(family, "transformer", lambda: family.denoise(latents, torch.tensor([0.5]), text))
    blocks_run_in_listed_order(family, "text_encoder", lambda: family.encode_text(family.tokenize(["a"])))


def _transformer_to_original(state: dict) -> dict:
    """diffusers Flux2Transformer2DModel keys -> BFL's layout (the inverse of diffusers'
    convert_flux2_transformer_checkpoint_to_diffusers, written from its rename tables)."""
    top = {"x_embedder": "img_in", "context_embedder": "txt_in", "proj_out": "final_layer.linear",
           "time_guidance_embed.timestep_embedder.linear_1": "time_in.in_layer",
           "time_guidance_embed.timestep_embedder.linear_2": "time_in.out_layer",
           "time_guidance_embed.guidance_embedder.linear_1": "guidance_in.in_layer",  # dev only
           "time_guidance_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
           "double_stream_modulation_img.linear": "double_stream_modulation_img.lin",
           "double_stream_modulation_txt.linear": "double_stream_modulation_txt.lin",
           "single_stream_modulation.linear": "single_stream_modulation.lin"}
    double = {"attn.norm_q": "img_attn.norm.query_norm", "attn.norm_k": "img_attn.norm.key_norm",
              "attn.to_out.0": "img_attn.proj", "ff.linear_in": "img_mlp.0", "ff.linear_out": "img_mlp.2",
              "attn.norm_added_q": "txt_attn.norm.query_norm", "attn.norm_added_k": "txt_attn.norm.key_norm",
              "attn.to_add_out": "txt_attn.proj", "ff_context.linear_in": "txt_mlp.0",
              "ff_context.linear_out": "txt_mlp.2"}
    single = {"attn.to_qkv_mlp_proj": "linear1", "attn.to_out": "linear2", "attn.norm_q": "norm.query_norm",
              "attn.norm_k": "norm.key_norm"}
    out = {}
    for key, tensor in state.items():
        module, _, kind = key.rpartition(".")
        if module == "norm_out.linear":  # diffusers (scale, shift), BFL (shift, scale)
            out[f"final_layer.adaLN_modulation.1.{kind}"] = torch.cat(tensor.chunk(2)[::-1])
        elif module in top:
            out[f"{top[module]}.{kind}"] = tensor
        elif module.startswith(("transformer_blocks.", "single_transformer_blocks.")):
            stack, index, inner = module.split(".", 2)
            if inner in ("attn.to_k", "attn.to_v", "attn.add_k_proj", "attn.add_v_proj"):
                continue  # stacked with their q below
            is_double = stack == "transformer_blocks"
            prefix = f"{'double' if is_double else 'single'}_blocks.{index}"
            kind = "scale" if "norm" in inner else kind
            if inner in ("attn.to_q", "attn.add_q_proj"):
                names = (("attn.to_q", "attn.to_k", "attn.to_v") if inner == "attn.to_q"
                         else ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"))
                stream = "img" if inner == "attn.to_q" else "txt"
                out[f"{prefix}.{stream}_attn.qkv.{kind}"] = torch.cat([state[f"{module.rsplit('.', 1)[0]}.{n.split('.')[-1]}.{kind}"]
                                                                       for n in names])
            else:
                out[f"{prefix}.{(double if is_double else single)[inner]}.{kind}"] = tensor
        else:
            raise KeyError(key)
    return out


def test_the_single_transformer_file_loads_the_folders_tensors(tmp_path, tiny_flux2, shape_images, family):
    _single_file_loads_the_folders_tensors(tmp_path, tiny_flux2, shape_images, family)


def _single_file_loads_the_folders_tensors(tmp_path, tiny_flux2, shape_images, family):
    from safetensors.torch import load_file, save_file

    from modules.model.detect import detect_family
    from modules.model.flux2 import Flux2Family

    folder = load_file(str(next((tiny_flux2 / "transformer").glob("*.safetensors"))))
    original = {"model.diffusion_model." + k: v.contiguous() for k, v in _transformer_to_original(folder).items()}
    assert "model.diffusion_model.double_blocks.0.img_attn.qkv.weight" in original
    save_file(original, str(tmp_path / "flux2.safetensors"))
    assert detect_family(tmp_path / "flux2.safetensors") == "flux2"  # not FLUX.1, whose block names it shares
    assert detect_family(tiny_flux2) == "flux2"
    # as BFL ships FLUX.2: the transformer file; the text encoder and the VAE as folders
    config = train_config(tmp_path / "flux2.safetensors", shape_images, tmp_path, {"model": {
        "family": "flux2", "parts": {"text_encoder": {"path": str(tiny_flux2 / "text_encoder")},
                                     "vae": {"path": str(tiny_flux2 / "vae")}}}})
    from_file = Flux2Family(config)
    from_file.model_configs_dir = tiny_flux2  # the tiny model's part configs
    from_file.load()
    for part, module in family.parts.items():
        ours, theirs = from_file.parts[part].state_dict(), module.state_dict()
        assert set(ours) == set(theirs), part
        assert all(torch.equal(ours[k], theirs[k]) for k in ours), part


def test_sample_draws_an_image_from_the_live_modules(family):
    from modules.config.train_config import SamplePromptConfig

    prompt = SamplePromptConfig(prompt="a red circle", negative_prompt="blurry", steps=2, cfg=2.0, width=64,
                                height=64, seed=3)
    image = family.sample(prompt, torch.device("cpu"))
    assert image.size == (64, 64)
    assert image.getextrema() != ((0, 0), (0, 0), (0, 0))


@pytest.mark.parametrize("mode", ["float8", "nf4"])
def test_a_quantized_transformer_trains(tmp_path, tiny_flux2, one_image, mode):
    from family_cross import initializes_and_steps

    initializes_and_steps(tiny_flux2, one_image, tmp_path, "flux2", "transformer", mode, dora=False)


def test_the_shared_modulations_stay_dense(tmp_path, tiny_flux2, shape_images):
    from modules.model.flux2 import Flux2Family

    family = Flux2Family(train_config(tiny_flux2, shape_images, tmp_path, {"model": {
        "family": "flux2", "parts": {"transformer": {"weight_dtype": "float8"}}}}), {"transformer": "float8"})
    family.load()
    report = family.quantization_reports["transformer"]
    modulations = [n for n, m in family.transformer.named_modules()
                   if "stream_modulation" in n and isinstance(m, torch.nn.Linear)]
    assert len(modulations) == 3 and all(n in report.skipped for n in modulations)
    assert any(n.startswith("transformer_blocks.") for n in report.quantized)


def test_offloading_half_the_transformer_trains_the_same_adapter(fake_device, tmp_path, tiny_flux2, one_image):
    from family_cross import offloaded_training_matches

    offloaded_training_matches(tiny_flux2, one_image, tmp_path, "flux2", "transformer", fake_device)


def test_a_single_file_is_built_at_the_size_it_holds(tmp_path, shape_images):
    """klein 4B, 9B and dev transformer files pick their shipped config by the double- and single-block
    counts (9B builds the released 9.08 B parameters, dev 32.2 B, dev's Mistral language model 22.9 B);
    a dev file (guidance embedder) is this family's too."""
    from accelerate import init_empty_weights
    from diffusers import Flux2Transformer2DModel
    from safetensors.torch import save_file

    from modules.model.detect import detect_model
    from modules.model.flux2 import Flux2Family

    def file(name, double, single, *more):
        keys = [f"model.diffusion_model.double_blocks.{i}.img_attn.qkv.weight" for i in range(double)]
        keys += [f"model.diffusion_model.single_blocks.{i}.linear1.weight" for i in range(single)]
        keys += ["model.diffusion_model.single_stream_modulation.lin.weight", *more]
        save_file({key: torch.zeros(1) for key in keys}, str(tmp_path / name))
        return tmp_path / name

    folders = {}
    guidance = "model.diffusion_model.guidance_in.in_layer.weight"
    for name, double, single, *more in (("klein-4b.safetensors", 5, 20), ("klein-9b.safetensors", 8, 24),
                                        ("dev.safetensors", 8, 48, guidance)):
        family = Flux2Family(train_config(file(name, double, single, *more), shape_images, tmp_path, {"model": {
            "family": "flux2", "parts": {"text_encoder": {"path": str(tmp_path)}, "vae": {"path": str(tmp_path)}}}}))
        folders[name] = family.part_folder("transformer")
        assert detect_model(tmp_path / name).family == "flux2"
    assert [f.name for f in folders.values()] == ["transformer", "transformer_klein_9b", "transformer_dev"]
    for name, parameters in (("klein-9b.safetensors", 9_078_581_248), ("dev.safetensors", 32_223_281_152)):
        with init_empty_weights():
            model = Flux2Transformer2DModel.from_config(Flux2Transformer2DModel.load_config(str(folders[name])))
        assert sum(p.numel() for p in model.parameters()) == parameters, name
    # dev's shipped Mistral-Small-3.1 config: the language model the family loads (no vision tower, no lm_head)
    from modules.model.components.mistral3_text import Mistral3LanguageModel, Mistral3TextConfig

    with init_empty_weights():
        mistral = Mistral3LanguageModel(Mistral3TextConfig.from_pretrained(str(folders["dev.safetensors"].parent
                                                                               / "text_encoder_dev")))
    assert sum(p.numel() for p in mistral.parameters()) == 22_901_314_560


# --- FLUX.2 [dev]: Mistral-3 text encoder, guidance embedding, Flux2Pipeline ------------------------


@pytest.fixture(scope="session")
def tiny_flux2_dev(tiny_family_model):
    return tiny_family_model("flux2", variant="dev")  # the session's, shared with the preset test


@pytest.fixture(scope="module")
def dev_family(tmp_path_factory, tiny_flux2_dev, shape_images):
    return _loaded_family(tiny_flux2_dev, shape_images, tmp_path_factory.mktemp("flux2dev"))


@pytest.fixture(scope="module")
def dev_pipe(tiny_flux2_dev):
    from diffusers import Flux2Pipeline

    return Flux2Pipeline.from_pretrained(str(tiny_flux2_dev), local_files_only=True)


def test_dev_is_detected_and_reads_only_mistrals_language_model(dev_family, tiny_flux2_dev):
    from transformers import MistralModel

    from modules.model.detect import detect_model

    assert detect_model(tiny_flux2_dev).family == "flux2"
    assert dev_family.is_dev and isinstance(dev_family.parts["text_encoder"], MistralModel)
    assert dev_family.modelspec_architecture == "flux-2-dev/lora"
    # hidden_states[30] is what layer 29 outputs: the 31st layer is never read
    assert dev_family.unreachable_prefixes("text_encoder") == ("layers.30.",)


def test_dev_encodings_are_the_pipelines(dev_family, dev_pipe):
    """The system message and the caption in the chat template, Mistral layers 10/20/30 stacked, as
    Flux2Pipeline.encode_prompt computes them (from its own Mistral3ForConditionalGeneration)."""
    captions = ["a red circle", "a blue square on green"]
    tokens = dev_family.tokenize(captions)
    assert "[SYSTEM_PROMPT]You are an AI" in dev_family.tokenizer.decode(tokens["input_ids"][0])
    ours = dev_family.encode_text(tokens)["hidden_states"]
    with torch.no_grad():
        theirs, _ = dev_pipe.encode_prompt(captions, device="cpu", max_sequence_length=dev_family.max_sequence_length)
    assert ours.shape == theirs.shape == (2, 256, dev_family.transformer.config.joint_attention_dim)
    assert torch.allclose(ours, theirs, atol=1e-6)


def test_dev_guidance_reaches_the_transformer(dev_family, monkeypatch):
    from modules.model import flux

    before = prediction_with(dev_family, dev_family.transformer, 32)
    monkeypatch.setattr(flux, "TRAINING_GUIDANCE", 4.0)
    after = prediction_with(dev_family, dev_family.transformer, 32)
    assert (before - after).abs().max() > 1e-4


def test_dev_trains_the_transformer_and_mistral_and_the_loss_falls(tmp_path, tiny_flux2_dev, one_image):
    from safetensors import safe_open

    from modules.trainer.generic_trainer import GenericTrainer

    config = train_config(tiny_flux2_dev, one_image, tmp_path, {
        "model": {"family": "flux2", "parts": {"text_encoder": {"train": True}}},
        "adapter": {"layer_preset": "all-linear"},
        "schedule": {"epochs": 12, "batch_size": 1}, "optimizer": {"lr": 1.5e-2},
    })
    trainer = GenericTrainer(config)
    trainer.start()
    assert "text_encoder.layers.30.self_attn.q_proj" in trainer.adapters.left_out  # never read: no adapter
    before = fixed_loss(trainer, draws=8)
    trainer.train()  # the first step's guard checks every adapter, Mistral's too, learned
    after = fixed_loss(trainer, draws=8)
    path = trainer.end()
    assert after < before * 0.8, (before, after)
    with safe_open(str(path), "pt") as file:
        assert file.metadata()["modelspec.architecture"] == "flux-2-dev/lora"
        assert "text_encoders.mistral3_24b.transformer.model.layers.29.self_attn.q_proj.lora_down.weight" in file.keys()


def test_dev_load_lora_weights_matches_the_hooked_model(dev_family, dev_pipe, tmp_path):
    """A diffusers-format file of every transformer Linear (the guidance embedder's too) loads in
    Flux2Pipeline with no adapter left out and computes what the trainer computes."""
    from peft.tuners.lora import LoraLayer

    adapters = perturbed_adapters(dev_family, ["transformer"], layer_preset="all-linear")
    assert any("guidance_embedder" in name for name in adapters.module_name_of.values())
    try:
        path = tmp_path / "flux2-dev.safetensors"
        save_adapter_file(path, adapters, dev_family, "diffusers", torch.float32, {})
        ours, count = prediction_with(dev_family, dev_family.transformer, 32), len(adapters)
    finally:
        adapters.unhook()
    plain = prediction_with(dev_family, dev_family.transformer, 32)
    dev_pipe.load_lora_weights(str(path))
    try:
        assert sum(isinstance(m, LoraLayer) for m in dev_pipe.transformer.modules()) == count
        theirs = prediction_with(dev_family, dev_pipe.transformer, 32)
    finally:
        dev_pipe.unload_lora_weights()
    assert (ours - plain).abs().max() > 1e-3
    assert (ours - theirs).abs().max() < 1e-5


def test_the_single_dev_transformer_file_loads_the_folders_tensors(tmp_path, tiny_flux2_dev, shape_images,
                                                                   dev_family):
    """BFL's dev file (guidance_in too) converts with diffusers' FLUX.2 converter; Mistral3 from its folder."""
    _single_file_loads_the_folders_tensors(tmp_path, tiny_flux2_dev, shape_images, dev_family)


def test_a_dev_transformer_beside_a_qwen3_encoder_is_named(tmp_path, tiny_flux2_dev, tiny_flux2, shape_images):
    from modules.loading.diffusers_folder import ModelLoadError
    from modules.model.flux2 import Flux2Family

    family = Flux2Family(train_config(tiny_flux2_dev, shape_images, tmp_path, {"model": {
        "family": "flux2", "parts": {"text_encoder": {"path": str(tiny_flux2 / "text_encoder")}}}}))
    with pytest.raises(ModelLoadError, match=r"model\.parts\.text_encoder: the transformer is FLUX\.2 \[dev\]"):
        family.load()


def test_dev_samples_with_guidance_from_the_live_modules(dev_family):
    from modules.config.train_config import SamplePromptConfig

    def draw(cfg):
        prompt = SamplePromptConfig(prompt="a red circle", steps=2, cfg=cfg, width=64, height=64, seed=3)
        return torch.tensor(list(dev_family.sample(prompt, torch.device("cpu")).getdata()), dtype=torch.float32)

    low, high = draw(1.0), draw(8.0)
    assert low.std() > 0 and (low - high).abs().mean() > 0  # guidance_scale reaches the transformer


def test_make_tiny_model_builds_the_dev_variant(tmp_path, capsys):
    import json

    import launch

    assert launch.main(["make-tiny-model", "--family", "flux2", "--variant", "dev", "--out", str(tmp_path / "m")]) == 0
    assert json.loads((tmp_path / "m" / "model_index.json").read_text())["_class_name"] == "Flux2Pipeline"
    assert launch.main(["make-tiny-model", "--family", "sd15", "--variant", "dev", "--out", str(tmp_path / "x")]) == 2
    assert "--variant: sd15 has no variant 'dev' (its variants: none)" in capsys.readouterr().err


def test_a_skeleton_transformer_leaves_the_load_unchanged(family):
    loads_beside_a_skeleton_denoiser(family)  # what `launch.py cache` loads


def test_a_skeleton_dev_transformer_leaves_the_load_unchanged(dev_family):
    skeleton = loads_beside_a_skeleton_denoiser(dev_family)
    assert skeleton.is_dev and skeleton.embedding_slots == {}  # told from config files, not weights
