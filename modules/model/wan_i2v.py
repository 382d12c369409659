"""Wan 2.1 image-to-video 14B (Wan-AI/Wan2.1-I2V-14B-480P/720P): Wan 2.1's UMT5 encoder, VAE and
transformer blocks (wan.py), conditioned on a first frame as WanImageToVideoPipeline does
(diffusers 0.42, pipelines/wan/pipeline_wan_i2v.py), reproduced so training sees what sampling sees:

- the condition latents and mask on the transformer's channels, and sampling from a prompt image:
  wan_first_frame.py (shared with Wan 2.2 I2V A14B).
- the image embeddings: CLIP ViT-H/14's penultimate hidden states (CLIPVisionModel, 257 tokens of
  1280) of the first frame as CLIPImageProcessor prepares it, handed to the image cross-attention
  (`add_k_proj`/`add_v_proj`, `norm_added_k`) as `encoder_hidden_states_image`; drawn from the
  sample's pixels and cached with its latents like the condition.
- the text: always 512 tokens, because the transformer's attention splits image from text tokens by
  counting 512 text tokens from the end (`image_context_length = length - 512`).

Adapter keys are Wan 2.1's (keys/wan.py, which names the image cross-attention layers
`cross_attn.k_img` / `v_img`).

Single files: the transformer as Wan-AI's original release and ComfyUI's
wan2.1_i2v_480p_14B_*.safetensors / ..._720p_... hold it (Wan 2.1's 14B keys, bare or under
`model.diffusion_model.`, plus the image cross-attention `cross_attn.k_img` / `v_img` /
`norm_k_img` and the image embedder `img_emb.proj.*`), converted as wan_single_file.py converts a
Wan 2.1 file (diffusers' converter maps those keys too). Its image embedder tells it from a T2V file
and from a Wan 2.2 I2V A14B expert (36 channels, no image embedder) before any weight loads; the
header's width, blocks, input channels and image embedding width pick the config of
resources/model_configs/wan_i2v/transformer*/. The UMT5 and VAE files are Wan 2.1's
(`model.parts.<part>.path`); the CLIP vision tower (`model.parts.image_encoder.path`) from a diffusers
image_encoder/ folder (the 480p and 720p folders ship the same one) or ComfyUI's
clip_vision_h.safetensors, the file its Wan I2V workflows load with "Load CLIP Vision"
(components/clip_vision_file.py: its layout read from its keys, a tower other than ViT-H/14 named
before any weight loads).

Wan 2.1 FLF2V 14B (first-last-frame to video, Wan-AI/Wan2.1-FLF2V-14B-720P) is a variant: the I2V
transformer plus a position embedding over the CLIP tokens of two frames (`img_emb.emb_pos` in its
file, diffusers' `pos_embed_seq_len` 514 = 2 x 257), told by its config (a file's header picks
resources/model_configs/wan_i2v/transformer_flf2v/). As WanImageToVideoPipeline does with
`last_image`, it is conditioned on a clip's first and last frames: both kept in the condition video
(the frames between zero) and marked in the mask, and the image embeddings are both frames' CLIP
states, first then last on the token axis (the transformer views each sample's 2 x 257 tokens as
one sequence). A one-frame sample is its own first and last frame (condition as the I2V's, the
embeddings of the frame twice). Samples take the prompt's second image as the last frame. Its
released scheduler shifts by 16 (diffusers' scripts/convert_wan_to_diffusers.py: FLF2V flow_shift
16.0), which a single file gets here; a diffusers folder ships its own.
"""

from __future__ import annotations

import json
import re
from functools import cached_property

import torch

from modules.config.families.wan_i2v import DECLARATION
from modules.config.prompt_control_images import ExactPromptImages, exact_count_problems
from modules.errors import UserError
from modules.model.wan import MAX_TEXT_TOKENS, WanFamily
from modules.model.wan_first_frame import WanFirstFrame
from modules.model.wan_single_file import IMAGE_SIGNATURE
from modules.sampling.control_images import fitted_control_images

# the released FLF2V scheduler's shift (diffusers' scripts/convert_wan_to_diffusers.py), for a single file
FLF2V_FLOW_SHIFT = 16.0


def _unwrapped_clip_key(key: str) -> str:
    """A CLIPVisionModel weight's name in transformers 5, which dropped the `vision_model.` wrapper."""
    return key.removeprefix("vision_model.")


class WanI2VFamily(WanFirstFrame, WanFamily):
    declaration = DECLARATION  # name, label, parts: modules/config/families/wan_i2v.py
    pipeline_classes = ("WanImageToVideoPipeline",)
    # Wan 2.2's A14B I2V folders use the same pipeline class, with two experts and no image encoder
    pipeline_config = {"boundary_ratio": None}
    denoiser_config = {"_class_name": "WanTransformer3DModel", "in_channels": 36}
    single_file_signature = IMAGE_SIGNATURE  # Wan 2.1's blocks with the image embedder (`img_emb.`)
    single_file_part_signatures = {}  # a lone UMT5 or VAE file reads as Wan 2.1's (the same parts)
    kohya_base_version = "wan_2.1_i2v"
    modelspec_architecture = "wan-2.1-i2v-14b/lora"
    # the I2V 14B transformer (the T2V 14B's plus its image embedder and image cross-attention) and
    # CLIP ViT-H/14's vision tower (counted from resources/model_configs/wan_i2v/ on the meta device)
    nominal_part_parameters = {**WanFamily.nominal_part_parameters, "transformer": 16_394_878_784,
                               "image_encoder": 630_766_080}
    image_parts = ("vae", "image_encoder")
    pixel_conditioning = ("image_condition", "image_embeds")
    tiny_model_variants = ("i2v", "flf2v")  # Wan 2.1 I2V 14B's architecture, or FLF2V's (make_tiny_model's variant)

    @classmethod
    def tiny_model_options(cls, preset_name: str) -> dict:
        # an FLF2V preset trains (and its test runs) on the FLF2V transformer, two frames' image positions
        return {"variant": "flf2v"} if re.search(r"\bFLF2V\b", preset_name) else {}

    @classmethod
    def released_variant(cls, preset_name: str) -> str | None:
        # "flf2v": planned on resources/model_configs/wan_i2v/transformer_flf2v/; else WanFamily's ("14b",
        # which names no folder here: transformer/ is the I2V 14B's)
        return cls.tiny_model_options(preset_name).get("variant") or super().released_variant(preset_name)

    def single_file_part(self, part: str):
        if part == "image_encoder":
            from modules.model.components import clip_vision_file

            return clip_vision_file.single_file_part()
        return super().single_file_part(part)

    def check_part_file(self, part: str, stream, where: str) -> None:
        if part == "image_encoder":
            from modules.model.components.clip_vision_file import check_clip_vision_file

            check_clip_vision_file(stream, super().part_folder(part), where, self.label, "clip_vision_h.safetensors")
            return
        super().check_part_file(part, stream, where)

    @cached_property
    def image_frames(self) -> int:
        """The frames the transformer takes CLIP states of: 2 for FLF2V (`pos_embed_seq_len`), else 1."""
        config = json.loads((self.part_folder("transformer") / "config.json").read_text(encoding="utf-8"))
        return 2 if config.get("pos_embed_seq_len") else 1

    def fingerprint(self, *parts: str) -> str:
        # the pixel conditioning (cached under the image parts' identity) differs between I2V and FLF2V
        identity = super().fingerprint(*parts)
        return identity if self.image_frames == 1 or "image_encoder" not in parts else f"{identity}-flf2v"

    def load(self) -> None:
        from transformers import CLIPImageProcessorPil, CLIPVisionModel

        if self.single_file is not None:
            self.single_file_stream()  # the transformer file's parts and shape, before the image encoder loads
        self._check_prompt_images()
        for spec in self.part_specs:  # every part's own file checked (a ViT-L CLIP named) before any weight loads
            if self.from_single_file(spec.name):
                self.single_file_stream(spec.name)
        # the released folders hold it as transformers 4 saved it, under `vision_model.`; a single file
        # (ComfyUI's clip_vision_h) is converted to CLIPVisionModel's names (components/clip_vision_file.py)
        self.parts["image_encoder"] = self.load_part("image_encoder", CLIPVisionModel, rename=_unwrapped_clip_key)
        super().load()  # the other parts, then the scheduler and tokenizer
        if self.image_frames == 2 and self.from_single_file("transformer"):
            from diffusers import UniPCMultistepScheduler

            self.noise_scheduler = UniPCMultistepScheduler.from_config(self.noise_scheduler.config,
                                                                       flow_shift=FLF2V_FLOW_SHIFT)
        self.parts = {spec.name: self.parts[spec.name] for spec in self.part_specs}
        self.image_processor = CLIPImageProcessorPil.from_pretrained(str(self.support_folder("image_processor")),
                                                                  local_files_only=True)

    def exact_prompt_images(self) -> ExactPromptImages:
        """One image (I2V) or two (FLF2V: first and last frame), as the transformer's config says; the
        declaration allows both, the config alone being silent on which transformer it names."""
        takes = {1: "one image, its first frame (a second, the last frame, is for a Wan 2.1 FLF2V transformer)",
                 2: "two images, its first and last frames (a Wan 2.1 FLF2V transformer)"}[self.image_frames]
        return ExactPromptImages(self.image_frames, f"{self.label} with this transformer samples from {takes}")

    def _check_prompt_images(self) -> None:
        """Before any weight loads, for a load without the preflight (a family built in code, a sample
        command's): each sample prompt's images are what this transformer samples from; a prompt with
        none is left to the preflight. A transformer built on meta (the planner's, also the preflight's
        fit check on a GPU) samples nothing: the preflight names the prompts with all its other problems."""
        if "transformer" in self.skeleton_parts:
            return
        problems = exact_count_problems(self.config.sampling.prompts, self.exact_prompt_images(), none_too=False)
        if problems:
            raise UserError(problems[0])

    @property
    def max_sequence_length(self) -> int:
        return MAX_TEXT_TOKENS  # the transformer counts exactly 512 text tokens (see above)

    def checkpoint_blocks(self, part: str) -> list[torch.nn.Module]:
        if part == "image_encoder":
            return list(self.parts[part].encoder.layers)
        return super().checkpoint_blocks(part)

    # --- the first (and last) frame -----------------------------------------------------------

    def conditioning_frames(self, frames: int) -> list[int]:
        return [0, frames - 1] if self.image_frames == 2 and frames > 1 else [0]

    def encode_pixel_conditioning(self, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
        """WanFirstFrame's `image_condition` and `image_embeds` (B, tokens, width) of each first frame
        (FLF2V: (B, 2 x tokens, width), the first frame's then the last's)."""
        video = pixels if pixels.dim() == 5 else pixels.unsqueeze(2)
        frames = [video[:, :, 0], video[:, :, -1]][:self.image_frames]
        embeds = torch.cat([self.image_embeddings(frame) for frame in frames], dim=1)
        return {**super().encode_pixel_conditioning(pixels), "image_embeds": embeds}

    def image_embeddings(self, frames: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) frames in [-1, 1] -> CLIP's penultimate hidden states, as
        WanImageToVideoPipeline.encode_image computes them (its CLIPImageProcessor on the frames as
        8-bit pictures)."""
        encoder = self.parts["image_encoder"]
        if frames.device.type == "meta":  # the planner's fake step: only the shape counts
            side = encoder.config.image_size
            values = frames.new_empty(frames.shape[0], 3, side, side)
        else:
            from PIL import Image

            bytes_ = ((frames.detach().float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
            pictures = [Image.fromarray(frame.permute(1, 2, 0).cpu().numpy()) for frame in bytes_]
            values = self.image_processor(images=pictures, return_tensors="pt").pixel_values.to(frames.device)
        hidden = encoder(pixel_values=values.to(self.compute_dtype("image_encoder")), output_hidden_states=True)
        return hidden.hidden_states[-2]

    def pixel_conditioning_shapes(self, latent_shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        config = json.loads((self.part_folder("image_encoder") / "config.json").read_text(encoding="utf-8"))
        # CLIPVisionConfig's defaults where the config leaves them out; one class token before the patches
        tokens = (config.get("image_size", 224) // config.get("patch_size", 32)) ** 2 + 1
        return {**super().pixel_conditioning_shapes(latent_shape),
                "image_embeds": (self.image_frames * tokens, config.get("hidden_size", 768))}

    # --- training ----------------------------------------------------------------------------

    def transformer_input(self, video: torch.Tensor, text: dict[str, torch.Tensor],
                          dtype: torch.dtype) -> tuple[torch.Tensor, dict]:
        hidden, extra = super().transformer_input(video, text, dtype)
        embeds = text["image_embeds"]
        # FLF2V: each frame's tokens as one entry, (2B, tokens, width), as the pipeline hands them; the
        # transformer views them back to (B, 2 x tokens, width) before adding its position embedding
        embeds = embeds.reshape(-1, embeds.shape[1] // self.image_frames, embeds.shape[2])
        return hidden, {**extra, "encoder_hidden_states_image": embeds.to(dtype)}

    # --- sampling ----------------------------------------------------------------------------

    def pipeline_images(self, prompt, frames: int) -> dict:
        """The first frame; FLF2V's last frame too, the prompt's second image (a one-frame sample is
        its own last frame, as a still trains: see pipeline())."""
        if self.image_frames == 1:
            return super().pipeline_images(prompt, frames)
        if len(prompt.control_images) != 2:
            raise UserError(f"sampling: the prompt {prompt.prompt!r} has {len(prompt.control_images)} image(s); "
                            f"{self.label} with a Wan 2.1 FLF2V transformer samples from a first and a last frame "
                            "(sampling.prompts[].control_images: two)")
        first, last = fitted_control_images(prompt.control_images, prompt.width, prompt.height, 2, self.label)
        return {"image": first, "last_image": last} if frames > 1 else {"image": first}

    def pipeline(self):
        from diffusers import UniPCMultistepScheduler, WanImageToVideoPipeline

        pipe = WanImageToVideoPipeline(
            tokenizer=self.tokenizer, text_encoder=self.parts["text_encoder"], vae=self.parts["vae"],
            scheduler=UniPCMultistepScheduler.from_config(self.noise_scheduler.config),
            image_processor=self.image_processor, image_encoder=self.parts["image_encoder"],
            transformer=self.transformer)
        if self.image_frames == 2:
            # the pipeline has no one-frame FLF2V (it puts F - 2 frames between the two): a lone image is
            # its own last frame, its CLIP states twice, as a still trains (the condition is the I2V's)
            encode = pipe.encode_image
            pipe.encode_image = lambda image, device=None: encode(image if isinstance(image, list) else [image, image],
                                                                  device)
        pipe.set_progress_bar_config(disable=True)
        return pipe

