"""Wan's first-frame image-to-video conditioning, as WanImageToVideoPipeline (diffusers 0.42,
pipelines/wan/pipeline_wan_i2v.py, without `expand_timesteps`) builds it, for the Wan families that
take it (Wan 2.1 I2V 14B: wan_i2v.py; Wan 2.2 I2V A14B: wan22_i2v.py):

- the condition latents: the VAE's mean of the video [first frame, zeros for every other frame]
  (the pipeline's "argmax"), normalised like the clip's latents, after a 4-channel mask that is 1
  on the first latent frame and 0 on the others (the VAE's 4x in time: the first frame's mask is
  repeated over its 4 frame slots); the transformer (in_channels 36) takes [noisy latents (16),
  mask (4), condition latents (16)] on the channel axis. A one-frame sample is its own condition.
- sampling: the pipeline from `sampling.prompts[].control_images[0]`, fitted to the sample's size
  as training crops a clip to its bucket.

A family conditioned on more frames (Wan 2.1 FLF2V, wan_i2v.py: the last too, as the pipeline's
`last_image`) names them in `conditioning_frames`: they are kept in the condition video and marked
in the mask as the pipeline marks them (the last latent frame's mask holds its 4 pixel frames on the
4 channels, so a last frame is 1 on the fourth), and adds its images in `pipeline_images`.

In training each clip's first frame (after the same crop and mirror as the clip) is its condition,
drawn from the sample's pixels (ModelFamily.pixel_conditioning) and cached with its latents. A
family with CLIP image embeddings besides (Wan 2.1 I2V) adds them to what this draws.
"""

from __future__ import annotations

import torch

from modules.errors import UserError
from modules.model.wan import latent_normalisation
from modules.sampling.control_images import fitted_control_images
from modules.util.torch_utils import make_generator

MASK_CHANNELS = 4  # the VAE's 4x in time: the first frame's mask is repeated over its 4 frame slots


def frame_mask(frames: int, kept: list[int], latents: torch.Tensor) -> torch.Tensor:
    """(B, 4, 1 + n, h, w): 1 where a pixel frame of `kept` sits, as the pipeline lays its mask out: the
    first frame's value repeated over its 4 slots, then each latent frame's 4 pixel frames on channels."""
    per_frame = latents.new_zeros(frames)
    per_frame[kept] = 1
    slots = torch.cat([per_frame[:1].repeat(MASK_CHANNELS), per_frame[1:]]).view(-1, MASK_CHANNELS)  # (1 + n, 4)
    return slots.t()[None, :, :, None, None].expand(latents.shape[0], -1, -1, *latents.shape[3:]).clone()


class WanFirstFrame:
    """Mixed in before a WanFamily subclass."""

    pixel_conditioning = ("image_condition",)
    one_frame_note = ("each trains as a one-frame video conditioned on itself (the first frame's look and its caption, "
                      "no motion); give the concept clips (video.frames 1 + 4n) to train motion")

    def conditioning_frames(self, frames: int) -> list[int]:
        """The indices of a clip's frames the model is conditioned on (Wan 2.1 FLF2V: the last too)."""
        return [0]

    def encode_pixel_conditioning(self, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
        """(B, 3, F, H, W) clips (or (B, 3, H, W) stills, one-frame clips) -> `image_condition`
        (B, 4 + C, 1 + n, H/8, W/8): the mask then the condition latents (4-D for stills, like
        their latents)."""
        video = pixels if pixels.dim() == 5 else pixels.unsqueeze(2)
        kept = self.conditioning_frames(video.shape[2])
        condition = torch.zeros_like(video)
        condition[:, :, kept] = video[:, :, kept]
        vae = self.parts["vae"]
        latents = vae.encode(condition.to(self.compute_dtype("vae"))).latent_dist.mean  # (the pipeline's "argmax")
        mean, std = latent_normalisation(vae, latents)
        latents = (latents - mean) / std
        image_condition = torch.cat([frame_mask(video.shape[2], kept, latents), latents], dim=1)
        return {"image_condition": image_condition if pixels.dim() == 5 else image_condition.squeeze(2)}

    def pixel_conditioning_shapes(self, latent_shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        return {"image_condition": (MASK_CHANNELS + latent_shape[0], *latent_shape[1:])}

    def transformer_input(self, video: torch.Tensor, text: dict[str, torch.Tensor],
                          dtype: torch.dtype) -> tuple[torch.Tensor, dict]:
        """[noisy latents, mask, condition latents] on channels (WanFamily.run_transformer's input)."""
        missing = [name for name in self.pixel_conditioning if name not in text]
        if missing:
            raise ValueError(f"{self.label} denoises only with each sample's first-frame conditioning "
                             f"({', '.join(self.pixel_conditioning)}: encode_pixel_conditioning)")
        condition = text["image_condition"]
        condition = condition if condition.dim() == 5 else condition.unsqueeze(2)
        return torch.cat([video, condition.to(video.device, video.dtype)], dim=1).to(dtype), {}

    # --- sampling ----------------------------------------------------------------------------

    def prompt_image(self, prompt):
        """The sample's first frame: its prompt's control image fitted to the sample's size."""
        if not prompt.control_images:
            raise UserError(f"sampling: the prompt {prompt.prompt!r} has no image; {self.label} samples a video from "
                            "one (sampling.prompts[].control_images)")
        return fitted_control_images(prompt.control_images, prompt.width, prompt.height, 1, self.label)[0]

    def pipeline_images(self, prompt, frames: int) -> dict:
        """The pipeline's image inputs for the prompt (Wan 2.1 FLF2V: its last frame too)."""
        return {"image": self.prompt_image(prompt)}

    def sample_frames(self, prompt, device, frames: int = 1) -> list:
        """The prompt's video from its image as PIL frames (the pipeline rounds `frames` to 1 + 4n)."""
        negative = {}
        if prompt.cfg > 1:
            negative = {"negative_prompt_embeds": self._prompt_embeds(prompt.negative_prompt or "", device)}
        return self.pipeline()(
            **self.pipeline_images(prompt, frames), prompt_embeds=self._prompt_embeds(prompt.prompt, device),
            guidance_scale=prompt.cfg, num_inference_steps=prompt.steps, width=prompt.width, height=prompt.height,
            num_frames=frames, generator=make_generator(device, prompt.seed),
            max_sequence_length=self.max_sequence_length, output_type="pil", **negative,
        ).frames[0]
