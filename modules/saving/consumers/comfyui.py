"""ComfyUI's LoRA key map: every key stem its loader maps to a weight of its model, per family.

Reflects Comfy-Org/ComfyUI 0.3.64 (commit a125cd84, 2025-10-12) and pollockjj/ComfyUI, a fork
tracking upstream, at 0.8.0 merged with upstream of 2026-01-07 (commit 618b803d): the maps used
here are the same in both. Sources: comfy/lora.py (model_lora_keys_unet, model_lora_keys_clip),
comfy/utils.py (unet_to_diffusers, flux_to_diffusers, z_image_to_diffusers), comfy/model_base.py,
comfy/text_encoders/.

- denoiser: for every `diffusion_model.<X>.weight` of its model (original/ldm/BFL layout):
  `lora_unet_<X with _>` and `diffusion_model.<X>`; for a UNet also `lora_unet_<diffusers module
  with _>` (unet_to_diffusers) and `unet.<diffusers name>` (attention as `processor.to_q`); for
  FLUX also, per diffusers module <D>: `transformer.<D>`, `lycoris_<D with _>`,
  `lora_transformer_<D with _>`;
- CLIP-L (`clip_l.transformer.text_model.encoder.layers.<b>.<c>`, c one of q/k/v/out_proj,
  fc1/fc2): `lora_te_text_model_encoder_layers_<b>_<c with _>`, `lora_te1_...`,
  `text_encoder.text_model.encoder.layers.<b>.<c>`; CLIP-G (with CLIP-L): `lora_te2_...`,
  `text_encoder_2...`; their projections `lora_te1_text_projection` / `lora_te2_text_projection`;
  any text-encoder weight `<k>`: `text_encoders.<k>`;
- T5 next to CLIP-L only (FLUX): `lora_te2_<path with _>` and `lora_te3_...`;
- llama-style encoders (Qwen3, Mistral3, Qwen2.5-VL) only as `text_encoders.<name>.transformer.model.<k>`.
"""

from __future__ import annotations

import re

import torch

from modules.quantization.base import is_linear

NAME = "ComfyUI"
VERSION = "0.8.0 (pollockjj/ComfyUI 618b803d, upstream of 2026-01-07; same maps in Comfy-Org 0.3.64)"

CLIP_LAYERS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj", "mlp.fc1", "mlp.fc2")


def _layers(module, convs: bool = True) -> list[str]:
    """The weights' module names: Linear layers, dense or quantized (a fp8/nf4 run checks its file
    against the same model), and Conv2d ones."""
    return [n for n, m in module.named_modules() if is_linear(m) or (convs and isinstance(m, torch.nn.Conv2d))]


def flux_original_keys(transformer) -> list[str]:
    """BFL's FLUX.1 transformer weights (what ComfyUI's Flux model holds), by BFL's own names."""
    keys = ["img_in", "txt_in", "time_in.in_layer", "time_in.out_layer", "vector_in.in_layer",
            "vector_in.out_layer", "final_layer.linear", "final_layer.adaLN_modulation.1"]
    if transformer.config.guidance_embeds:
        keys += ["guidance_in.in_layer", "guidance_in.out_layer"]
    for i in range(len(transformer.transformer_blocks)):
        keys += [f"double_blocks.{i}.{side}_{layer}" for side in ("img", "txt")
                 for layer in ("attn.qkv", "attn.proj", "mlp.0", "mlp.2", "mod.lin")]
    for i in range(len(transformer.single_transformer_blocks)):
        keys += [f"single_blocks.{i}.{layer}" for layer in ("linear1", "linear2", "modulation.lin")]
    return keys


def _clip_keys(encoder, clip: str) -> list[str]:
    """ComfyUI's CLIP weights: a transformers CLIPTextModel's state dict (`text_model.` first; the
    projection of a CLIPTextModelWithProjection as `text_projection`) under `<clip>.transformer.`."""
    keys = [k.removesuffix(".weight") for k in encoder.state_dict() if k.endswith(".weight")]
    return [f"{clip}.transformer.{k if k.startswith(('text_model.', 'text_projection')) else 'text_model.' + k}"
            for k in keys]


def clip_stems(family, generic: bool) -> set[str]:
    """The CLIP encoders' stems; `generic`: with ComfyUI's `text_encoders.<weight>` names (Forge lacks them)."""
    clips = {"text_encoder": "clip_l", "text_encoder_2": "clip_g"} if family.name in ("sdxl", "sd3") else {"text_encoder": "clip_l"}
    stems = set()
    for part, clip in clips.items():
        keys = _clip_keys(family.parts[part], clip)
        if generic:
            stems |= {f"text_encoders.{k}" for k in keys}
        if f"{clip}.transformer.text_projection" in keys:  # model_lora_keys_clip's own projection names
            stems |= {"lora_te1_text_projection"} if clip == "clip_l" else {"lora_te2_text_projection",
                                                                            "lora_prior_te_text_projection"}
        for key in keys:
            match = re.fullmatch(rf"{clip}\.transformer\.text_model\.encoder\.layers\.(\d+)\.(.+)", key)
            if match and match.group(2) in CLIP_LAYERS:
                block, layer = match.groups()
                flat = f"text_model_encoder_layers_{block}_{layer.replace('.', '_')}"
                if clip == "clip_l":
                    stems |= {f"lora_te_{flat}", f"lora_te1_{flat}", f"text_encoder.text_model.encoder.layers.{block}.{layer}"}
                else:
                    stems |= {f"lora_te2_{flat}", f"text_encoder_2.text_model.encoder.layers.{block}.{layer}"}
    return stems


def t5_stems(family, prefixes) -> set[str]:
    keys = [k.removesuffix(".weight") for k in family.parts["text_encoder_2"].state_dict() if k.endswith(".weight")]
    return {f"lora_{p}_{k.replace('.', '_')}" for p in prefixes for k in keys}


def unet_diffusers_stems(family) -> set[str]:
    """ComfyUI's `unet.<diffusers name>` keys (without the `unet.`), attention projections spelled `processor.to_q`."""
    out = set()
    for name in _layers(family.unet):
        key = name.replace(".to_", ".processor.to_")
        out.add(key[:-2] if key.endswith(".to_out.0") else key)
    return out


def sd_flux_stems(family) -> set[str]:
    """SD1.5, SDXL, FLUX.1: kohya/comfy names (the map tests/test_consumer_keys.py checks files against)."""
    stems = set()
    if family.name == "flux":
        denoiser = flux_original_keys(family.transformer)
        for name in _layers(family.transformer, convs=False):
            stems |= {f"transformer.{name}", f"lycoris_{name.replace('.', '_')}",
                      f"lora_transformer_{name.replace('.', '_')}"}
    else:
        from modules.model.components.ldm_unet_keys import ldm_unet_module_name  # checked against diffusers elsewhere

        to_ldm = family.comfy_module_name if family.name == "sdxl" else (
            lambda part, name: "diffusion_model." + ldm_unet_module_name(family.unet, name))
        layers = _layers(family.unet)
        denoiser = [to_ldm("unet", n).removeprefix("diffusion_model.") for n in layers]
        stems |= {f"lora_unet_{n.replace('.', '_')}" for n in layers}  # unet_to_diffusers: diffusers names too
    stems |= {f"lora_unet_{x.replace('.', '_')}" for x in denoiser} | {f"diffusion_model.{x}" for x in denoiser}
    stems |= clip_stems(family, generic=True)
    if family.name == "flux":
        stems |= t5_stems(family, ("te2", "te3"))
    return stems


def _sd_flux_all(family) -> set[str]:
    """sd_flux_stems plus a diffusers file's UNet keys (`unet.<name>`), which ComfyUI reads too."""
    return sd_flux_stems(family) | ({f"unet.{s}" for s in unet_diffusers_stems(family)} if family.name != "flux" else set())


# --- Z-Image -----------------------------------------------------------------------------------
# ComfyUI's Z-Image model is Lumina2's NextDiT (comfy/ldm/lumina/model.py): per block one fused
# `attention.qkv` and `attention.out`, `feed_forward.w1/w2/w3`, `adaLN_modulation.0`; then
# `x_embedder`, `final_layer.linear`, `final_layer.adaLN_modulation.1`, `t_embedder.mlp.0/2`,
# `cap_embedder.1`. comfy/utils.py `z_image_to_diffusers` maps each diffusers weight onto those,
# q/k/v at row offsets 0, dim, 2*dim of qkv. model_lora_keys_unet keys LoRAs by
# `lora_unet_<own name with _>` and `diffusion_model.<own name>` (any model) and, for Lumina2, by
# `diffusion_model.<D>`, `transformer.<D>`, `lycoris_<D with _>` and `<D>` for each diffusers name
# D. The Qwen3 encoder (SD1ClipModel "qwen3_4b") only as `text_encoders.qwen3_4b.transformer.model.<k>`.


def z_image_to_diffusers(transformer) -> dict[str, tuple[str, int | None]]:
    """diffusers module -> (ComfyUI module, row offset in it or None for the whole weight)."""
    dim, out = transformer.config.dim, {}
    for stack in ("noise_refiner", "context_refiner", "layers"):
        for i, block in enumerate(getattr(transformer, stack)):
            b = f"{stack}.{i}"
            out |= {f"{b}.attention.to_{p}": (f"{b}.attention.qkv", j * dim) for j, p in enumerate("qkv")}
            out[f"{b}.attention.to_out.0"] = (f"{b}.attention.out", None)
            out |= {f"{b}.feed_forward.{w}": (f"{b}.feed_forward.{w}", None) for w in ("w1", "w2", "w3")}
            if hasattr(block, "adaLN_modulation"):
                out[f"{b}.adaLN_modulation.0"] = (f"{b}.adaLN_modulation.0", None)
    out |= {"all_x_embedder.2-1": ("x_embedder", None), "all_final_layer.2-1.linear": ("final_layer.linear", None),
            "all_final_layer.2-1.adaLN_modulation.1": ("final_layer.adaLN_modulation.1", None),
            "t_embedder.mlp.0": ("t_embedder.mlp.0", None), "t_embedder.mlp.2": ("t_embedder.mlp.2", None),
            "cap_embedder.1": ("cap_embedder.1", None)}
    return out


def z_image_map(family) -> dict[str, tuple[str, int | None]]:
    """LoRA key stem -> (the ComfyUI weight it patches, row offset); text encoder: -> (stem, None)."""
    to_comfy = z_image_to_diffusers(family.transformer)
    stems = {}
    for own, _ in set(to_comfy.values()):
        stems[f"lora_unet_{own.replace('.', '_')}"] = stems[f"diffusion_model.{own}"] = (own, None)
    for name, target in to_comfy.items():
        for stem in (f"diffusion_model.{name}", f"transformer.{name}", f"lycoris_{name.replace('.', '_')}", name):
            stems[stem] = target
    for stem in text_encoder_stems(family.parts["text_encoder"], "qwen3_4b"):
        stems[stem] = (stem, None)
    return stems


# --- FLUX.2 and Qwen-Image --------------------------------------------------------------------
# ComfyUI's FLUX.2 model is a Flux model (comfy/model_base.py `class Flux2(Flux)`) with
# `global_modulation`: its own weights are BFL's (below); the Flux branch of model_lora_keys_unet
# adds `transformer.<D>`, `lycoris_<D with _>`, `lora_transformer_<D with _>` for each FLUX.1
# diffusers name D of flux_to_diffusers; a key whose target weight the FLUX.2 model lacks patches
# nothing. Its text encoder: "qwen3_4b"/"qwen3_8b" (klein) or "mistral3_24b" ([dev]). Qwen-Image
# (comfy/ldm/qwen_image/model.py) has diffusers' module names; model_lora_keys_unet maps
# `lora_unet_<k with _>`, `diffusion_model.<k>`, `<k>`, `transformer.<k>`, `lycoris_<k with _>`;
# its Qwen2.5-VL encoder is "qwen25_7b".


def flux2_original_keys(transformer) -> list[str]:
    keys = ["img_in", "txt_in", "time_in.in_layer", "time_in.out_layer", "final_layer.linear",
            "final_layer.adaLN_modulation.1", "double_stream_modulation_img.lin", "double_stream_modulation_txt.lin",
            "single_stream_modulation.lin"]
    if transformer.config.guidance_embeds:
        keys += ["guidance_in.in_layer", "guidance_in.out_layer"]
    for i in range(len(transformer.transformer_blocks)):
        keys += [f"double_blocks.{i}.{side}_{layer}" for side in ("img", "txt")
                 for layer in ("attn.qkv", "attn.proj", "mlp.0", "mlp.2")]
    for i in range(len(transformer.single_transformer_blocks)):
        keys += [f"single_blocks.{i}.{layer}" for layer in ("linear1", "linear2")]
    return keys


def flux1_diffusers_names(double: int, single: int) -> dict[str, str]:
    """comfy/utils.py flux_to_diffusers: FLUX.1 diffusers module -> the original weight it patches."""
    out = {"proj_out": "final_layer.linear", "x_embedder": "img_in", "context_embedder": "txt_in",
           "norm_out.linear": "final_layer.adaLN_modulation.1"}
    for source, target in (("time_in", "timestep_embedder"), ("vector_in", "text_embedder"),
                           ("guidance_in", "guidance_embedder")):
        out |= {f"time_text_embed.{target}.linear_1": f"{source}.in_layer",
                f"time_text_embed.{target}.linear_2": f"{source}.out_layer"}
    for i in range(double):
        b, o = f"transformer_blocks.{i}", f"double_blocks.{i}"
        out |= {f"{b}.attn.{p}": f"{o}.img_attn.qkv" for p in ("to_q", "to_k", "to_v")}
        out |= {f"{b}.attn.{p}": f"{o}.txt_attn.qkv" for p in ("add_q_proj", "add_k_proj", "add_v_proj")}
        out |= {f"{b}.attn.to_out.0": f"{o}.img_attn.proj", f"{b}.attn.to_add_out": f"{o}.txt_attn.proj",
                f"{b}.norm1.linear": f"{o}.img_mod.lin", f"{b}.norm1_context.linear": f"{o}.txt_mod.lin",
                f"{b}.ff.net.0.proj": f"{o}.img_mlp.0", f"{b}.ff.net.2": f"{o}.img_mlp.2",
                f"{b}.ff_context.net.0.proj": f"{o}.txt_mlp.0", f"{b}.ff_context.net.2": f"{o}.txt_mlp.2"}
    for i in range(single):
        b, o = f"single_transformer_blocks.{i}", f"single_blocks.{i}"
        out |= {f"{b}.attn.{p}": f"{o}.linear1" for p in ("to_q", "to_k", "to_v")}
        out |= {f"{b}.proj_mlp": f"{o}.linear1", f"{b}.norm.linear": f"{o}.modulation.lin", f"{b}.proj_out": f"{o}.linear2"}
    return out


def text_encoder_stems(encoder, name: str) -> set[str]:
    return {f"text_encoders.{name}.transformer.model.{k.removesuffix('.weight')}"
            for k in encoder.state_dict() if k.endswith(".weight")}


def flux2_stems(family) -> set[str]:
    transformer = family.transformer
    own = flux2_original_keys(transformer)
    stems = {f"lora_unet_{k.replace('.', '_')}" for k in own} | {f"diffusion_model.{k}" for k in own}
    for name, target in flux1_diffusers_names(len(transformer.transformer_blocks),
                                              len(transformer.single_transformer_blocks)).items():
        if target in own:
            stems |= {f"transformer.{name}", f"lycoris_{name.replace('.', '_')}",
                      f"lora_transformer_{name.replace('.', '_')}"}
    encoder = family.parts["text_encoder"]
    width = encoder.config.hidden_size
    name = "mistral3_24b" if family.is_dev else ("qwen3_8b" if width == 4096 else "qwen3_4b")
    return stems | text_encoder_stems(encoder, name)


def qwen_image_stems(family) -> set[str]:
    stems = set()
    for key in family.transformer.state_dict():
        if key.endswith(".weight"):
            k = key.removesuffix(".weight")
            stems |= {f"lora_unet_{k.replace('.', '_')}", f"diffusion_model.{k}", k, f"transformer.{k}",
                      f"lycoris_{k.replace('.', '_')}"}
    return stems | text_encoder_stems(family.parts["text_encoder"], "qwen25_7b")


# --- Wan 2.1 (and Wan 2.2 TI2V 5B, the same WanModel with 48 latent channels) -------------------
# ComfyUI's Wan model (comfy/ldm/wan/model.py WanModel) keeps the original Wan names: per block
# `self_attn.q/k/v/o`, `cross_attn.q/k/v/o` (and `k_img`/`v_img` for I2V), `ffn.0`, `ffn.2`; then
# `text_embedding.0/2`, `time_embedding.0/2`, `time_projection.1`, `head.head`, `img_emb.proj.1/3`.
# model_lora_keys_unet maps only `lora_unet_<X with _>` and `diffusion_model.<X>` for them (no Wan
# branch, no diffusers names). The UMT5 encoder (SD1ClipModel "umt5xxl", comfy/text_encoders/wan.py,
# transformers' T5 module names in comfy/text_encoders/t5.py): `text_encoders.umt5xxl.transformer.<k>`.


def wan_original_keys(transformer) -> list[str]:
    """ComfyUI's WanModel weights by its own (the original Wan) names, for a diffusers transformer's shape."""
    keys = ["patch_embedding", "text_embedding.0", "text_embedding.2", "time_embedding.0", "time_embedding.2",
            "time_projection.1", "head.head"]
    if transformer.condition_embedder.image_embedder is not None:
        keys += ["img_emb.proj.1", "img_emb.proj.3"]
    for i, block in enumerate(transformer.blocks):
        keys += [f"blocks.{i}.{attn}.{p}" for attn in ("self_attn", "cross_attn") for p in ("q", "k", "v", "o")]
        keys += [f"blocks.{i}.ffn.0", f"blocks.{i}.ffn.2"]
        if block.attn2.add_k_proj is not None:
            keys += [f"blocks.{i}.cross_attn.k_img", f"blocks.{i}.cross_attn.v_img"]
    return keys


def wan_stems(family) -> set[str]:
    own = wan_original_keys(family.transformer)
    stems = {f"lora_unet_{k.replace('.', '_')}" for k in own} | {f"diffusion_model.{k}" for k in own}
    encoder = family.parts["text_encoder"]
    return stems | {f"text_encoders.umt5xxl.transformer.{k.removesuffix('.weight')}"
                    for k in encoder.state_dict() if k.endswith(".weight")}


# --- Anima -------------------------------------------------------------------------------------
# ComfyUI's Anima (comfy/ldm/anima/model.py, `Anima(MiniTrainDIT)`; comfy/supported_models.py
# `Anima`, image_model "anima") is the Cosmos-Predict2 DiT under its original names (per block
# `self_attn.q_proj/k_proj/v_proj/output_proj`, `cross_attn.*`, `mlp.layer1/layer2`,
# `adaln_modulation_{self_attn,cross_attn,mlp}.1/.2`; `x_embedder.proj.1`, `t_embedder.1.linear_1/2`,
# `final_layer.linear`, `final_layer.adaln_modulation.1/.2`) with the LLM adapter inside it as
# `llm_adapter.<AnimaTextConditioner's own names>`. model_lora_keys_unet has no Anima branch: only
# `lora_unet_<X with _>` and `diffusion_model.<X>` for them. Its Qwen3 0.6B encoder (comfy/text_encoders/
# anima.py, SD1ClipModel "qwen3_06b"): `text_encoders.qwen3_06b.transformer.model.<k>`.


def anima_stems(family) -> set[str]:
    from modules.model.keys.anima import anima_original_module_name

    transformer = family.transformer
    own = [anima_original_module_name(transformer, name) for name in _layers(transformer, convs=False)]
    own += [f"llm_adapter.{k.removesuffix('.weight')}" for k in family.parts["text_conditioner"].state_dict()
            if k.endswith(".weight")]
    stems = {f"lora_unet_{k.replace('.', '_')}" for k in own} | {f"diffusion_model.{k}" for k in own}
    return stems | text_encoder_stems(family.parts["text_encoder"], "qwen3_06b")


# --- Chroma and SD3 -----------------------------------------------------------------------------
# ComfyUI's Chroma (comfy/model_base.py `class Chroma(Flux)`, comfy/ldm/chroma/model.py) has
# FLUX's blocks without their modulation layers (`img_in`, `txt_in`, double blocks' `img_attn.qkv`
# / `.proj`, `img_mlp.0` / `.2` and the txt ones, single blocks' `linear1` / `linear2`,
# `final_layer.linear`) and the `distilled_guidance_layer` (`in_proj`, `layers.N.in_layer` /
# `.out_layer`, `out_proj`); the Flux branch of model_lora_keys_unet adds flux_to_diffusers' names,
# of which those whose target Chroma lacks patch nothing. ComfyUI's SD3 is MMDiT
# (comfy/ldm/modules/diffusionmodules/mmdit.py); the SD3 branch maps, for each diffusers weight of
# comfy/utils.py mmdit_to_diffusers, `transformer.<D>`, `base_model.model.<D>`,
# `lora_transformer_<D with _>` and `lycoris_<D with _>`. model_lora_keys_clip: a lone T5 (Chroma)
# is `lora_te1_`, T5 after CLIP-L and CLIP-G (SD3) `lora_te3_`; every encoder weight also
# `text_encoders.<its ComfyUI name>` (`t5xxl.transformer.<k>`, `clip_l.transformer...`). Read in both
# versions named above (0.8.0 builds Chroma's blocks from Flux's with modulation=False: same names).


def chroma_original_keys(transformer) -> list[str]:
    approximator = "distilled_guidance_layer"
    keys = ["img_in", "txt_in", "final_layer.linear", f"{approximator}.in_proj", f"{approximator}.out_proj"]
    keys += [f"{approximator}.layers.{i}.{layer}" for i in range(len(transformer.distilled_guidance_layer.layers))
             for layer in ("in_layer", "out_layer")]
    for i in range(len(transformer.transformer_blocks)):
        keys += [f"double_blocks.{i}.{side}_{layer}" for side in ("img", "txt")
                 for layer in ("attn.qkv", "attn.proj", "mlp.0", "mlp.2")]
    for i in range(len(transformer.single_transformer_blocks)):
        keys += [f"single_blocks.{i}.{layer}" for layer in ("linear1", "linear2")]
    return keys


def t5_encoder_stems(encoder, index: int) -> set[str]:
    """model_lora_keys_clip's T5 names: `lora_te<index>_<k with _>` and `text_encoders.t5xxl.transformer.<k>`."""
    keys = [k.removesuffix(".weight") for k in encoder.state_dict() if k.endswith(".weight")]
    return ({f"lora_te{index}_{k.replace('.', '_')}" for k in keys}
            | {f"text_encoders.t5xxl.transformer.{k}" for k in keys})


def chroma_stems(family) -> set[str]:
    transformer = family.transformer
    own = chroma_original_keys(transformer)
    stems = {f"lora_unet_{k.replace('.', '_')}" for k in own} | {f"diffusion_model.{k}" for k in own}
    for name, target in flux1_diffusers_names(len(transformer.transformer_blocks),
                                              len(transformer.single_transformer_blocks)).items():
        if target in own:
            stems |= {f"transformer.{name}", f"lycoris_{name.replace('.', '_')}",
                      f"lora_transformer_{name.replace('.', '_')}"}
    return stems | t5_encoder_stems(family.parts["text_encoder"], 1)


# comfy/utils.py MMDIT_MAP_BLOCK and MMDIT_MAP_BASIC (weights only): diffusers module -> MMDiT module
MMDIT_BLOCK = {"norm1_context.linear": "context_block.adaLN_modulation.1", "attn.to_add_out": "context_block.attn.proj",
               "ff_context.net.0.proj": "context_block.mlp.fc1", "ff_context.net.2": "context_block.mlp.fc2",
               "norm1.linear": "x_block.adaLN_modulation.1", "attn.to_out.0": "x_block.attn.proj",
               "attn2.to_out.0": "x_block.attn2.proj", "ff.net.0.proj": "x_block.mlp.fc1", "ff.net.2": "x_block.mlp.fc2",
               **{f"attn.{p}": "x_block.attn.qkv" for p in ("to_q", "to_k", "to_v")},
               **{f"attn.{p}": "context_block.attn.qkv" for p in ("add_q_proj", "add_k_proj", "add_v_proj")},
               **{f"attn2.{p}": "x_block.attn2.qkv" for p in ("to_q", "to_k", "to_v")}}
MMDIT_BASIC = {"context_embedder": "context_embedder", "time_text_embed.timestep_embedder.linear_1": "t_embedder.mlp.0",
               "time_text_embed.timestep_embedder.linear_2": "t_embedder.mlp.2", "pos_embed.proj": "x_embedder.proj",
               "time_text_embed.text_embedder.linear_1": "y_embedder.mlp.0",
               "time_text_embed.text_embedder.linear_2": "y_embedder.mlp.2",
               "norm_out.linear": "final_layer.adaLN_modulation.1", "proj_out": "final_layer.linear"}


def mmdit_to_diffusers(transformer) -> dict[str, str]:
    """diffusers module -> the MMDiT weight it patches, for the modules this transformer has."""
    mapping = dict(MMDIT_BASIC)
    for i in range(len(transformer.transformer_blocks)):
        mapping |= {f"transformer_blocks.{i}.{d}": f"joint_blocks.{i}.{m}" for d, m in MMDIT_BLOCK.items()}
    present = set(_layers(transformer))
    return {d: m for d, m in mapping.items() if d in present}


def sd3_stems(family) -> set[str]:
    to_mmdit = mmdit_to_diffusers(family.transformer)
    own = set(to_mmdit.values())
    stems = {f"lora_unet_{k.replace('.', '_')}" for k in own} | {f"diffusion_model.{k}" for k in own}
    for name in to_mmdit:
        stems |= {f"transformer.{name}", f"base_model.model.{name}", f"lora_transformer_{name.replace('.', '_')}",
                  f"lycoris_{name.replace('.', '_')}"}
    return stems | clip_stems(family, generic=True) | t5_encoder_stems(family.parts["text_encoder_3"], 3)


# --- Krea-2 -------------------------------------------------------------------------------------
# ComfyUI's Krea 2 model (comfy/ldm/krea2/model.py SingleStreamDiT) keeps the original Krea 2 names
# (`blocks.<i>.attn.wq/wk/wv/gate/wo`, `blocks.<i>.mlp.gate/up/down`, `txtfusion.<layerwise|refiner>_blocks`,
# `txtfusion.projector`, `first`, `tmlp.0/2`, `tproj.1`, `txtmlp.1/3`, `last.linear`): the generic loop
# of model_lora_keys_unet maps `lora_unet_<X with _>` and `diffusion_model.<X>` for them; its Krea2
# branch adds, per diffusers name D of comfy/utils.py krea2_to_diffusers (those Linear layers),
# `D`, `diffusion_model.D`, `transformer.D` and `lycoris_<D with _>`. Its Qwen3-VL encoder
# (comfy/text_encoders/krea2.py) is "qwen3vl_4b", its language model `model`. Read in
# comfyanonymous/ComfyUI of 2026 (comfy/ldm/krea2/model.py at 08381b1a), newer than the versions above.


def krea2_stems(family) -> set[str]:
    from modules.model.keys.krea2 import krea2_original_module_name

    transformer = family.transformer
    stems = set()
    for name in _layers(transformer, convs=False):
        own = krea2_original_module_name(transformer, name)
        stems |= {f"lora_unet_{own.replace('.', '_')}", f"diffusion_model.{own}", name, f"diffusion_model.{name}",
                  f"transformer.{name}", f"lycoris_{name.replace('.', '_')}"}
    return stems | text_encoder_stems(family.parts["text_encoder"], "qwen3vl_4b")


# the families whose ComfyUI map is rebuilt here; others: not checked
MAPS = {"sd15": _sd_flux_all, "sdxl": _sd_flux_all, "flux": _sd_flux_all,
        "z_image": lambda family: set(z_image_map(family)), "flux2": flux2_stems, "qwen_image": qwen_image_stems,
        "wan": wan_stems, "wan_i2v": wan_stems, "wan22_ti2v": wan_stems, "chroma": chroma_stems, "sd3": sd3_stems,
        # Wan 2.2 A14B (T2V and I2V): each expert's file is loaded onto one of ComfyUI's WanModels (both of
        # Wan 2.1 14B's shape)
        "wan22": wan_stems, "wan22_i2v": wan_stems, "krea2": krea2_stems, "anima": anima_stems}


def stems(family) -> set[str] | None:
    """Every key stem ComfyUI applies to a weight of this family's model, or None: not rebuilt for it."""
    build = MAPS.get(family.name)
    return build(family) if build else None
