"""Wan 2.2 image-to-video A14B (Wan-AI/Wan2.2-I2V-A14B-Diffusers): Wan 2.2 A14B's two experts, each a
36-channel WanTransformer3DModel of Wan 2.1 14B's width with no image cross-attention, split at the
pipeline's `boundary_ratio` (0.9 as released) as wan22.py splits them (per-sample routing, sigmas
drawn in the trained experts' range, an untrained expert resting on the temp device, one adapter
file per expert), conditioned on a first frame as wan_first_frame.py builds it: the mask and the
condition latents on the transformer's channels. There is no CLIP image encoder: the released
folder ships WanImageToVideoPipeline with `image_encoder` and `image_processor` null, and the
pipeline (diffusers 0.42, pipelines/wan/pipeline_wan_i2v.py) computes image embeddings only for a
transformer with an `image_dim` (Wan 2.1 I2V), so none reach these experts; `expand_timesteps` is
false (Wan 2.2 TI2V's per-token timesteps are not this model's). Sampling runs that pipeline with
both experts and no image encoder, from `sampling.prompts[].control_images[0]`.

Told from Wan 2.1 I2V (the same pipeline class) by model_index.json's `transformer_2` and
`boundary_ratio` before any weight loads, and from Wan 2.2 T2V A14B by the pipeline class. Adapter
keys are Wan 2.2 A14B's (keys/wan22.py); single files as for wan22 (ComfyUI's
wan2.2_i2v_high_noise_14B_*.safetensors as model.base, the low-noise file as
`model.parts.transformer_2.path`: 36-channel Wan 2.1 14B-layout transformers), told from Wan 2.1
T2V files by the 36 channels and from Wan 2.1 I2V 14B files by their lack of an image embedder.
"""

from __future__ import annotations

from modules.config.families.wan22_i2v import DECLARATION
from modules.model.wan22 import HIGH_NOISE, LOW_NOISE, Wan22Family
from modules.model.wan_first_frame import WanFirstFrame
from modules.model.wan_single_file import SIGNATURE


class Wan22I2VFamily(WanFirstFrame, Wan22Family):
    declaration = DECLARATION  # name, label, parts: modules/config/families/wan22_i2v.py
    pipeline_classes = ("WanImageToVideoPipeline",)
    low_noise_file_example = "wan2.2_i2v_low_noise_14B_fp16.safetensors"
    # each expert's file: Wan 2.1's keys without its image embedder, the patch embedding taking 36 channels
    # (so it is not taken for a Wan 2.1 T2V file, nor a Wan 2.1 I2V one, which has `img_emb.`)
    single_file_signature = SIGNATURE
    single_file_shape = (r"^(model\.diffusion_model\.)?patch_embedding\.weight$", 1, 36)
    kohya_base_version = "wan_2.2_i2v_a14b"
    modelspec_architecture = "wan-2.2-i2v-a14b/lora"
    # two experts of Wan 2.1 14B's shape with 36 input channels (resources/model_configs/wan22_i2v/,
    # counted on the meta device)
    nominal_part_parameters = {**Wan22Family.nominal_part_parameters, "transformer": 14_288_901_184,
                               "transformer_2": 14_288_901_184}

    def pipeline(self):
        from diffusers import UniPCMultistepScheduler, WanImageToVideoPipeline

        pipe = WanImageToVideoPipeline(
            tokenizer=self.tokenizer, text_encoder=self.parts["text_encoder"], vae=self.parts["vae"],
            scheduler=UniPCMultistepScheduler.from_config(self.noise_scheduler.config),
            image_processor=None, image_encoder=None, transformer=self.parts[HIGH_NOISE],
            transformer_2=self.parts[LOW_NOISE], boundary_ratio=self.boundary_ratio)
        pipe.set_progress_bar_config(disable=True)
        return pipe
