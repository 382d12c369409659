"""Wan 2.1 single files as people download them: the transformer in the original Wan-AI layout
(`blocks.N.self_attn.q`, `head.modulation`, ...; ComfyUI's repackaged files are the same keys, bare
or under `model.diffusion_model.`, fp16/bf16 or "scaled fp8"), the VAE in its original layout
(`encoder.downsamples.N`, `decoder.upsamples.N`, `conv1`/`conv2`: ComfyUI's wan_2.1_vae) and the
UMT5-XXL encoder in transformers' names (ComfyUI's umt5_xxl_*: `shared.`, `encoder.block.N`).

The transformer is converted by diffusers' own `convert_wan_transformer_to_diffusers` (what
`WanTransformer3DModel.from_single_file` runs; its renames hold at any width). diffusers' VAE
converter spells out the released VAE's decoder indices (three resnets and an upsampler per
stage), so the VAE conversion here reads the stage length from the model it loads into and agrees
with diffusers' on the released VAE (tests/test_wan_single_file.py). The UMT5 file needs no
renames. Every part then streams through the family's weight mode like a folder does
(ModelFamily.load_part), keep-in-fp32 and skip lists included.

Which released transformer a file holds (1.3B or 14B; the I2V 14B with its image embedder, a Wan 2.2
expert, the TI2V 5B) is read from its header (the width of `patch_embedding`, its input channels, the
block count and the image embedder's width) before any weight loads; the part is built from the
matching config of resources/model_configs/<family>/. The Wan 2.2 VAE's file (the TI2V 5B's, nested
stages, 48 latent channels) converts by wan22_vae_to_diffusers; either Wan VAE's file where the
other is wanted is named from its header (check_vae_file).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

_BLOCK_ATTENTION = r"^(model\.diffusion_model\.)?blocks\.\d+\.(self_attn|cross_attn)\."
# Cosmos-Predict2's DiT (Anima's) names its blocks' attention so too: its adaLN modulation tells it apart
_COSMOS = r"\.adaln_modulation_self_attn\."
# Wan 2.1 I2V 14B's CLIP image embedder (`img_emb.proj`: LayerNorm, Linear, GELU, Linear, LayerNorm) and its
# blocks' image cross-attention (`cross_attn.k_img` / `v_img` / `norm_k_img`); Wan 2.2 I2V A14B has neither
IMAGE_KEYS = r"^(model\.diffusion_model\.)?(img_emb\.|blocks\.\d+\.cross_attn\.(k_img|v_img|norm_k_img)\.)"
# a key only a Wan transformer file has (its blocks' self/cross attention under the original names), and
# the keys it lacks: a text-to-video (or Wan 2.2) transformer has no image embedder
SIGNATURE = (_BLOCK_ATTENTION, f"{_COSMOS}|{IMAGE_KEYS}")
# a Wan 2.1 I2V 14B transformer file: the Wan blocks with the image embedder
IMAGE_SIGNATURE = (r"^(model\.diffusion_model\.)?img_emb\.proj\.", _COSMOS)
# the Wan 2.1 VAE file's flat decoder list of resnets (the Wan 2.2 VAE nests them per stage:
# VAE22_SIGNATURE); UMT5's relative attention bias in blocks past the first (T5 has it in block 0 only)
PART_SIGNATURES = {"vae": r"^decoder\.upsamples\.\d+\.residual\.0\.gamma$",
                   "text_encoder": r"^encoder\.block\.[1-9]\d*\.layer\.0\.SelfAttention\.relative_attention_bias\."}
# the Wan 2.2 VAE's (Wan2.2_VAE.pth, ComfyUI's wan2.2_vae): each stage a residual block holding its resnets
# and its resample in one list, `encoder.downsamples.S.downsamples.J`, `decoder.upsamples.S.upsamples.J`
VAE22_SIGNATURE = r"^(encoder\.downsamples|decoder\.upsamples)\.\d+\.(down|up)samples\.\d+\.residual\.0\.gamma$"

TRANSFORMER_PREFIXES = ("model.diffusion_model.", "blocks.", "head.", "patch_embedding.", "text_embedding.",
                        "time_embedding.", "time_projection.", "img_emb.")
VAE_PREFIXES = ("encoder.conv1.", "encoder.downsamples.", "encoder.middle.", "encoder.head.", "decoder.", "conv1.",
                "conv2.")
TEXT_ENCODER_PREFIXES = ("shared.", "encoder.block.", "encoder.final_layer_norm.", "encoder.embed_tokens.")

# the original VAE's residual blocks are Sequentials (norm, act, conv, norm, act, dropout, conv)
_RESIDUAL = ((".residual.0.", ".norm1."), (".residual.2.", ".conv1."), (".residual.3.", ".norm2."),
             (".residual.6.", ".conv2."), (".shortcut.", ".conv_shortcut."))
_VAE_NAMES = ((r"^(encoder|decoder)\.conv1\.", r"\1.conv_in."), (r"^(encoder|decoder)\.head\.0\.", r"\1.norm_out."),
              (r"^(encoder|decoder)\.head\.2\.", r"\1.conv_out."), (r"^(encoder|decoder)\.middle\.0\.", r"\1.mid_block.resnets.0."),
              (r"^(encoder|decoder)\.middle\.1\.", r"\1.mid_block.attentions.0."),
              (r"^(encoder|decoder)\.middle\.2\.", r"\1.mid_block.resnets.1."),
              (r"^encoder\.downsamples\.", "encoder.down_blocks."), (r"^conv1\.", "quant_conv."),
              (r"^conv2\.", "post_quant_conv."))


def wan_vae_to_diffusers(state: dict, model) -> dict:
    """Original-layout Wan 2.1 VAE keys -> AutoencoderKLWan's. The decoder's flat `upsamples` list
    holds, per stage, its resnets and then its upsampler; diffusers groups them per up block."""
    per_stage = len(model.decoder.up_blocks[0].resnets) + 1
    out = {}
    for key, tensor in state.items():
        new = key
        for pattern, replacement in _VAE_NAMES:
            new = re.sub(pattern, replacement, new)
        if match := re.match(r"^decoder\.upsamples\.(\d+)\.(.*)$", new):
            stage, index = divmod(int(match.group(1)), per_stage)
            inner = f"resnets.{index}" if index < per_stage - 1 else "upsamplers.0"
            new = f"decoder.up_blocks.{stage}.{inner}.{match.group(2)}"
        for old, renamed in _RESIDUAL:
            new = new.replace(old, renamed)
        out[new] = tensor
    return out


# a Wan 2.2 stage's list entry J: a resnet (`residual`, `shortcut`) or, last, the stage's resample
_STAGE22 = re.compile(r"^(encoder|decoder)\.(down|up)samples\.(\d+)\.(?:down|up)samples\.(\d+)\."
                      r"(residual|shortcut|resample|time_conv)\.")


def wan22_vae_to_diffusers(state: dict, model=None) -> dict:
    """Original-layout Wan 2.2 VAE keys -> AutoencoderKLWan's with `is_residual` (the renames of
    diffusers' scripts/convert_wan_to_diffusers.py `convert_vae_22`; diffusers 0.42's single-file
    loader has no Wan 2.2 VAE converter): a stage's entry J is `resnets.J`, its resample the block's
    `downsampler` / `upsampler`; the shortcut's AvgDown3D / DupUp3D hold no weights. The rest is
    named as in the Wan 2.1 VAE."""
    out = {}
    for key, tensor in state.items():
        if match := _STAGE22.match(key):
            coder, direction, stage, index, kind = match.groups()
            inner = f"resnets.{index}.{kind}." if kind in ("residual", "shortcut") else f"{direction}sampler.{kind}."
            new = f"{coder}.{direction}_blocks.{stage}.{inner}{key[match.end():]}"
        else:
            new = key
            for pattern, replacement in _VAE_NAMES:
                new = re.sub(pattern, replacement, new)
        for old, renamed in _RESIDUAL:
            new = new.replace(old, renamed)
        out[new] = tensor
    return out


def vae_kind(residual: bool, latent_channels: int) -> str:
    known = {(False, 16): "the Wan 2.1 VAE (16 latent channels)",
             (True, 48): "the Wan 2.2 VAE (48 latent channels, residual stages)"}
    return known.get((residual, latent_channels),
                     f"a Wan VAE of {latent_channels} latent channels{', residual stages' if residual else ''}")


def check_vae_file(stream, folder: Path, where: str, label: str) -> None:
    """ModelLoadError at `where` when the VAE in the single file `stream` is not the one the config of
    `folder` builds: its layout (Wan 2.2's nested stages or Wan 2.1's flat lists) and its latent
    channels (`conv2`, the post-quant conv, is z_dim x z_dim), read from the header."""
    from modules.loading.diffusers_folder import ModelLoadError

    keys = stream.keys()
    residual = any(re.match(VAE22_SIGNATURE, k) for k in keys)
    channels = stream.shape("conv2.weight")[0] if "conv2.weight" in keys else 0
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    wanted = (bool(config.get("is_residual")), config.get("z_dim", 16))
    if channels and (residual, channels) != wanted:
        raise ModelLoadError(f"{where}: {stream.path.name} holds {vae_kind(residual, channels)}; {label} decodes with "
                             f"{vae_kind(*wanted)}: name that VAE's single file or its diffusers vae/ folder here")


def _with_flf2v_positions(state: dict) -> dict:
    """diffusers 0.42's single-file converter passes FLF2V's `img_emb.emb_pos` through unrenamed; its
    scripts/convert_wan_to_diffusers.py names it `condition_embedder.image_embedder.pos_embed`."""
    if "img_emb.emb_pos" in state:
        state["condition_embedder.image_embedder.pos_embed"] = state.pop("img_emb.emb_pos")
    return state


def single_file_part(part: str):
    """Where `part` sits in a Wan single file (the transformer's, the VAE's or the UMT5 file)."""
    from diffusers.loaders import single_file_utils as convert

    from modules.loading.single_file import SingleFilePart

    return {
        "transformer": SingleFilePart(TRANSFORMER_PREFIXES, lambda sd, model: _with_flf2v_positions(
            convert.convert_wan_transformer_to_diffusers(sd))),
        "vae": SingleFilePart(VAE_PREFIXES, wan_vae_to_diffusers),
        "text_encoder": SingleFilePart(TEXT_ENCODER_PREFIXES, lambda sd, model: sd),
    }.get(part)


def transformer_shape(keys, shape_of) -> tuple[int, int, int, int, int]:
    """(width, block count, input channels, image embedding width, image positions) of the transformer
    in a file, from its header: the patch embedding is (width, channels, 1, 2, 2), 16 channels for
    text-to-video, 36 for image-to-video; Wan 2.1 I2V's image embedder's first Linear `img_emb.proj.1`
    is (image width, image width), 1280 for CLIP ViT-H/14 (0: no image embedder, as in Wan 2.2 I2V's
    experts); Wan 2.1 FLF2V's `img_emb.emb_pos` (1, positions, image width) positions the CLIP tokens
    of its first and last frames, 2 x 257 (0: none, the I2V's)."""
    def key(pattern):
        return next((k for k in keys if re.match(r"^(model\.diffusion_model\.)?" + pattern + "$", k)), None)

    patch, image, positions = key(r"patch_embedding\.weight"), key(r"img_emb\.proj\.1\.weight"), key(r"img_emb\.emb_pos")
    blocks = {int(m.group(1)) for k in keys if (m := re.match(r"^(?:model\.diffusion_model\.)?blocks\.(\d+)\.", k))}
    width, channels = shape_of(patch)[:2] if patch else (0, 0)
    return (width, max(blocks, default=-1) + 1, channels, (shape_of(image)[1] if image else 0),
            (shape_of(positions)[1] if positions else 0))


def transformer_config_folder(folder: Path, width: int, blocks: int, channels: int, image_width: int = 0,
                              image_positions: int = 0, where: str = "model.base") -> Path:
    """The config folder beside `folder` (transformer/, transformer_14b/, transformer_flf2v/, ...) whose
    architecture has this width, block count, input channels, image embedding width (`image_dim`;
    0: none) and image positions (`pos_embed_seq_len`; 0: none) (`folder` itself first);
    ModelLoadError at `where` naming what the file holds when none has (a file without a patch
    embedding: `folder`, and the load names what is missing)."""
    from modules.loading.diffusers_folder import ModelLoadError

    if not width:
        return folder
    candidates = [folder, *sorted(folder.parent.glob("transformer*/"))]
    for candidate in candidates:
        config_path = candidate / "config.json"
        if not config_path.is_file():
            continue
        config = json.loads(config_path.read_text(encoding="utf-8"))
        shape = (config.get("num_attention_heads", 0) * config.get("attention_head_dim", 0), config.get("num_layers"),
                 config.get("in_channels"), config.get("image_dim") or 0, config.get("pos_embed_seq_len") or 0)
        if shape == (width, blocks, channels, image_width, image_positions):
            return candidate
    kind = {16: "text-to-video", 36: "image-to-video"}.get(channels, f"{channels} input channels")
    if image_width:
        kind += f", with an image embedder {image_width} wide"
    if image_positions:
        kind += f" over {image_positions} positions (first and last frames: FLF2V)"
    raise ModelLoadError(f"{where}: the file holds a Wan transformer {width} wide with {blocks} blocks "
                         f"({kind}); no config in {folder.parent}/transformer*/ has that architecture: set "
                         f"model.parts.{folder.name}.path to a diffusers {folder.name}/ folder of the model")
