"""SD3 / SD3.5 adapter keys (the whole story: modules/model/sd3.py's docstring).

- kohya: the transformer's LoRA under the original MMDiT layers, as kohya's sd-scripts writes SD3
  files (networks/lora_sd3.py: prefix `lora_unet` on MMDiT's module names,
  `lora_unet_joint_blocks_0_x_block_attn_qkv`: q/k/v stacked into one LoRA, formats/fused.py);
  other algorithms per module under OneTrainer's `lora_transformer_<diffusers module>`. Text
  encoders: sd-scripts' `lora_te1_` (CLIP-L), `lora_te2_` (CLIP-G), `lora_te3_` (T5).
- ComfyUI reads both: comfy/lora.py `model_lora_keys_unet` maps `lora_unet_<its MMDiT weight
  name with _>` for every weight of the model, and for SD3 also `transformer.<diffusers module>`,
  `lora_transformer_<diffusers module with _>` (OneTrainer) through comfy/utils.py
  `mmdit_to_diffusers`; its own MMDiT layout fuses q/k/v as the kohya names do, so a `comfy` file
  is the kohya one (SD3Family.file_layout). Forge reads sd-scripts' names the same way.
- diffusers: `transformer.<module>`, `text_encoder.text_model...`, `text_encoder_2.text_model...`:
  the only layout `StableDiffusion3Pipeline.load_lora_weights` reads (its SD3LoraLoaderMixin has no
  converter), and it loads no T5 adapters.

The MMDiT names and which diffusers modules each holds follow diffusers'
`convert_sd3_transformer_checkpoint_to_diffusers` (loaders/single_file_utils.py, which also
swaps the (shift, scale) halves of the final and the context-pre-only adaLN layers).
"""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from modules.model.keys.layout import FusedLayer, KeyLayout, OriginalLayer, OriginalLayout


def _qkv(stem: str, attention: str, names: tuple[str, str, str]) -> FusedLayer:
    return FusedLayer(stem, tuple(f"{{block}}.{attention}.{n}" for n in names))


class MMDiTLayout(OriginalLayout):
    """The last joint block's context side only feeds the image side (`context_pre_only`): its
    adaLN is diffusers' AdaLayerNormContinuous, (scale, shift), where MMDiT stores (shift, scale)."""

    def layers(self, part_module: nn.Module) -> list[OriginalLayer]:
        last = len(part_module.transformer_blocks) - 1
        pre_only = f"{self.prefix}_joint_blocks_{last}_context_block_adaLN_modulation_1"
        pre_only_module = part_module.transformer_blocks[last].context_pre_only
        return [replace(layer, swap_halves=True) if layer.stem == pre_only and pre_only_module else layer
                for layer in super().layers(part_module)]


SD3_TRANSFORMER_LAYERS = MMDiTLayout(
    prefix="lora_unet",
    top=(
        FusedLayer("context_embedder", ("context_embedder",)),
        FusedLayer("t_embedder_mlp_0", ("time_text_embed.timestep_embedder.linear_1",)),
        FusedLayer("t_embedder_mlp_2", ("time_text_embed.timestep_embedder.linear_2",)),
        FusedLayer("y_embedder_mlp_0", ("time_text_embed.text_embedder.linear_1",)),
        FusedLayer("y_embedder_mlp_2", ("time_text_embed.text_embedder.linear_2",)),
        FusedLayer("final_layer_linear", ("proj_out",)),
        FusedLayer("final_layer_adaLN_modulation_1", ("norm_out.linear",), swap_halves=True),
    ),
    blocks={
        "transformer_blocks": (
            _qkv("joint_blocks_{i}_x_block_attn_qkv", "attn", ("to_q", "to_k", "to_v")),
            FusedLayer("joint_blocks_{i}_x_block_attn_proj", ("{block}.attn.to_out.0",)),
            _qkv("joint_blocks_{i}_x_block_attn2_qkv", "attn2", ("to_q", "to_k", "to_v")),
            FusedLayer("joint_blocks_{i}_x_block_attn2_proj", ("{block}.attn2.to_out.0",)),
            FusedLayer("joint_blocks_{i}_x_block_mlp_fc1", ("{block}.ff.net.0.proj",)),
            FusedLayer("joint_blocks_{i}_x_block_mlp_fc2", ("{block}.ff.net.2",)),
            FusedLayer("joint_blocks_{i}_x_block_adaLN_modulation_1", ("{block}.norm1.linear",)),
            _qkv("joint_blocks_{i}_context_block_attn_qkv", "attn", ("add_q_proj", "add_k_proj", "add_v_proj")),
            FusedLayer("joint_blocks_{i}_context_block_attn_proj", ("{block}.attn.to_add_out",)),
            FusedLayer("joint_blocks_{i}_context_block_mlp_fc1", ("{block}.ff_context.net.0.proj",)),
            FusedLayer("joint_blocks_{i}_context_block_mlp_fc2", ("{block}.ff_context.net.2",)),
            FusedLayer("joint_blocks_{i}_context_block_adaLN_modulation_1", ("{block}.norm1_context.linear",)),
        ),
    },
)

SD3_KEYS = KeyLayout(
    # ComfyUI's own MMDiT layout fuses q/k/v like sd-scripts' names, and ComfyUI maps
    # `lora_unet_<MMDiT name>` for every weight
    comfy_is_kohya=True,
    comfyui_skips={"text_encoder_3": (None, "it reads T5 adapters only under kohya's lora_te3_ names"),
                   # model_lora_keys_clip maps the CLIPs' text_projection only as lora_te1_/lora_te2_
                   # (and text_encoders.<weight>), no diffusers name
                   **{part: (r"(^|\.)text_projection$", "it reads CLIP text_projection adapters only under "
                                                         "kohya's lora_te1_/lora_te2_ names")
                      for part in ("text_encoder", "text_encoder_2")}},
    other_stem_prefixes={"text_encoder": "text_encoders.clip_l.transformer.",
                         "text_encoder_2": "text_encoders.clip_g.transformer.",
                         "text_encoder_3": "text_encoders.t5xxl.transformer."},
    original_layers={"transformer": SD3_TRANSFORMER_LAYERS},
)
