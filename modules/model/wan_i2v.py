"""Wan 2.1 image-to-video 14B (Wan-AI/Wan2.1-I2V-14B-480P/720P): Wan 2.1's UMT5 encoder, VAE and
transformer blocks (wan.py), conditioned on a first frame as WanImageToVideoPipeline does
(diffusers 0.42, pipelines/wan/pipeline_wan_i2v.py), reproduced so training sees what sampling sees:

- the condition latents: the VAE's mean of the video [first frame, zeros for every other frame],
  normalised like the clip's latents, after a 4-channel mask that is 1 on the first latent frame
  and 0 on the others; the transformer (in_channels 36) takes [noisy latents (16), mask (4),
  condition latents (16)] on the channel axis. A one-frame sample is its own condition.
- the image embeddings: CLIP ViT-H/14's penultimate hidden states (CLIPVisionModel, 257 tokens of
  1280) of the first frame as CLIPImageProcessor prepares it, handed to the image cross-attention
  (`add_k_proj`/`add_v_proj`, `norm_added_k`) as `encoder_hidden_states_image`.
- the text: always 512 tokens, because the transformer's attention splits image from text tokens by
  counting 512 text tokens from the end (`image_context_length = length - 512`).

In training each clip's first frame (after the same crop and mirror as the clip) is its condition:
both tensors are drawn from the sample's pixels (ModelFamily.pixel_conditioning) and cached with its
latents. A sample prompt starts from `sampling.prompts[].control_images[0]`, fitted to the sample's
size as training crops a clip to its bucket. Adapter keys are Wan 2.1's (keys/wan.py, which names
the image cross-attention layers `cross_attn.k_img` / `v_img`); single files are not read for I2V.
"""

from __future__ import annotations

import torch

from modules.config.families.wan_i2v import DECLARATION
from modules.errors import UserError
from modules.model.wan import MAX_TEXT_TOKENS, WanFamily, latent_normalisation
from modules.sampling.control_images import fitted_control_images
from modules.util.torch_utils import make_generator

MASK_CHANNELS = 4  # the VAE's 4x in time: the first frame's mask is repeated over its 4 frame slots


def _unwrapped_clip_key(key: str) -> str:
    """A CLIPVisionModel weight's name in transformers 5, which dropped the `vision_model.` wrapper."""
    return key.removeprefix("vision_model.")


class WanI2VFamily(WanFamily):
    declaration = DECLARATION  # name, label, parts: modules/config/families/wan_i2v.py
    pipeline_classes = ("WanImageToVideoPipeline",)
    # Wan 2.2's A14B I2V folders use the same pipeline class, with two experts and no image encoder
    pipeline_config = {"boundary_ratio": None}
    denoiser_config = {"_class_name": "WanTransformer3DModel", "in_channels": 36}
    single_file_signature = None  # a Wan I2V single file is not read (use the Diffusers folder)
    single_file_part_signatures = {}
    kohya_base_version = "wan_2.1_i2v"
    modelspec_architecture = "wan-2.1-i2v-14b/lora"
    # the I2V 14B transformer (the T2V 14B's plus its image embedder and image cross-attention) and
    # CLIP ViT-H/14's vision tower (counted from resources/model_configs/wan_i2v/ on the meta device)
    nominal_part_parameters = {**WanFamily.nominal_part_parameters, "transformer": 16_394_878_784,
                               "image_encoder": 630_766_080}
    image_parts = ("vae", "image_encoder")
    pixel_conditioning = ("image_condition", "image_embeds")
    one_frame_note = ("each trains as a one-frame video conditioned on itself (the first frame's look and its caption, "
                      "no motion); give the concept clips (video.frames 1 + 4n) to train motion")

    def load(self) -> None:
        from transformers import CLIPImageProcessorPil, CLIPVisionModel

        # the released folders hold it as transformers 4 saved it, under `vision_model.`
        self.parts["image_encoder"] = self.load_part("image_encoder", CLIPVisionModel, rename=_unwrapped_clip_key)
        super().load()  # the other parts, then the scheduler and tokenizer
        self.parts = {spec.name: self.parts[spec.name] for spec in self.part_specs}
        self.image_processor = CLIPImageProcessorPil.from_pretrained(str(self.support_folder("image_processor")),
                                                                  local_files_only=True)

    @property
    def max_sequence_length(self) -> int:
        return MAX_TEXT_TOKENS  # the transformer counts exactly 512 text tokens (see above)

    def checkpoint_blocks(self, part: str) -> list[torch.nn.Module]:
        if part == "image_encoder":
            return list(self.parts[part].encoder.layers)
        return super().checkpoint_blocks(part)

    # --- the first frame -------------------------------------------------------------------------

    def encode_pixel_conditioning(self, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
        """(B, 3, F, H, W) clips (or (B, 3, H, W) stills, one-frame clips) -> `image_condition`
        (B, 4 + C, 1 + n, H/8, W/8), the mask then the condition latents (4-D for stills, like their
        latents), and `image_embeds` (B, tokens, width) of each first frame."""
        video = pixels if pixels.dim() == 5 else pixels.unsqueeze(2)
        first = video[:, :, :1]
        condition = torch.cat([first, first.new_zeros(*first.shape[:2], video.shape[2] - 1, *first.shape[3:])], dim=2)
        vae = self.parts["vae"]
        latents = vae.encode(condition.to(self.compute_dtype("vae"))).latent_dist.mean  # (the pipeline's "argmax")
        mean, std = latent_normalisation(vae, latents)
        latents = (latents - mean) / std
        mask = latents.new_zeros(latents.shape[0], MASK_CHANNELS, *latents.shape[2:])
        mask[:, :, 0] = 1
        image_condition = torch.cat([mask, latents], dim=1)
        return {"image_condition": image_condition if pixels.dim() == 5 else image_condition.squeeze(2),
                "image_embeds": self.image_embeddings(first[:, :, 0])}

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
        import json

        config = json.loads((self.part_folder("image_encoder") / "config.json").read_text(encoding="utf-8"))
        # CLIPVisionConfig's defaults where the config leaves them out; one class token before the patches
        tokens = (config.get("image_size", 224) // config.get("patch_size", 32)) ** 2 + 1
        return {"image_condition": (MASK_CHANNELS + latent_shape[0], *latent_shape[1:]),
                "image_embeds": (tokens, config.get("hidden_size", 768))}

    # --- training ----------------------------------------------------------------------------

    def denoise(self, noisy: torch.Tensor, sigmas: torch.Tensor, text: dict[str, torch.Tensor]) -> torch.Tensor:
        """The velocity for (B, C, H, W) one-frame or (B, C, F, H, W) latents, given the samples'
        first-frame conditioning (`image_condition`, `image_embeds`) beside the text's."""
        if "image_condition" not in text or "image_embeds" not in text:
            raise ValueError(f"{self.label} denoises only with each sample's first-frame conditioning "
                             "(image_condition, image_embeds: encode_pixel_conditioning)")
        dtype = self.compute_dtype("transformer")
        video = noisy if noisy.dim() == 5 else noisy.unsqueeze(2)
        condition = text["image_condition"]
        condition = condition if condition.dim() == 5 else condition.unsqueeze(2)
        hidden = torch.cat([video, condition.to(video.device, video.dtype)], dim=1)
        timestep = sigmas.float() * self.noise_scheduler.config.num_train_timesteps
        out = self.transformer(hidden_states=hidden.to(dtype), timestep=timestep,
                               encoder_hidden_states=text["hidden_states"].to(dtype),
                               encoder_hidden_states_image=text["image_embeds"].to(dtype), return_dict=False)[0]
        return out if noisy.dim() == 5 else out.squeeze(2)

    # --- sampling ----------------------------------------------------------------------------

    def pipeline(self):
        from diffusers import UniPCMultistepScheduler, WanImageToVideoPipeline

        pipe = WanImageToVideoPipeline(
            tokenizer=self.tokenizer, text_encoder=self.parts["text_encoder"], vae=self.parts["vae"],
            scheduler=UniPCMultistepScheduler.from_config(self.noise_scheduler.config),
            image_processor=self.image_processor, image_encoder=self.parts["image_encoder"],
            transformer=self.transformer)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def prompt_image(self, prompt):
        """The sample's first frame: its prompt's control image fitted to the sample's size."""
        if not prompt.control_images:
            raise UserError(f"sampling: the prompt {prompt.prompt!r} has no image; {self.label} samples a video from "
                            "one (sampling.prompts[].control_images)")
        return fitted_control_images(prompt.control_images, prompt.width, prompt.height, 1, self.label)[0]

    def sample_frames(self, prompt, device, frames: int = 1) -> list:
        """The prompt's video from its image as PIL frames (the pipeline rounds `frames` to 1 + 4n)."""
        negative = {}
        if prompt.cfg > 1:
            negative = {"negative_prompt_embeds": self._prompt_embeds(prompt.negative_prompt or "", device)}
        return self.pipeline()(
            image=self.prompt_image(prompt), prompt_embeds=self._prompt_embeds(prompt.prompt, device),
            guidance_scale=prompt.cfg, num_inference_steps=prompt.steps, width=prompt.width, height=prompt.height,
            num_frames=frames, generator=make_generator(device, prompt.seed),
            max_sequence_length=self.max_sequence_length, output_type="pil", **negative,
        ).frames[0]
