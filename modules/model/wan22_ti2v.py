"""Wan 2.2 TI2V 5B (Wan-AI/Wan2.2-TI2V-5B-Diffusers): one dense 5B WanTransformer3DModel that makes a
video from a prompt alone or from a prompt and a first image, over the Wan 2.2 VAE (48 latent
channels, 16x spatial: the frames 2x2-patchified, then 8x; 4x in time). Wan 2.1's family
(modules/model/wan.py: UMT5 embeddings, the per-channel latent normalisation, rectified flow with
the scheduler's shift, 5.0 here, the adapter key names) with what diffusers' pipelines do
differently for it (diffusers 0.42, pipelines/wan/):

- `expand_timesteps`: WanPipeline (and WanImageToVideoPipeline) hand the transformer one timestep
  per token, (B, F x h/2 x w/2) in the patches' order, not one per sample; training does the same.
- image-to-video (WanImageToVideoPipeline with `expand_timesteps`): the image's normalised latents
  replace the first latent frame, `(1 - mask) * condition + mask * latents` with the mask 0 on that
  frame, whose tokens get timestep 0; no CLIP image encoder and no extra input channels. The causal
  VAE encodes a clip's first frame alone, so a clip's own first latent frame is that condition:
  `model.image_to_video` trains that share of the clip steps this way (the first latent frame
  kept clean, the loss on the frames after it).
- samples play at 24 fps (the released `sample_fps`); a prompt's `control_images[0]` is the first
  frame of an image-to-video sample.

Told apart from Wan 2.1 before any weight loads by its model_index.json (`expand_timesteps` true),
for a transformer folder alone by its 48 input channels, for a transformer single file (Wan-AI's
original, ComfyUI's wan2.2_ti2v_5B_*; converted as Wan 2.1's) by its patch embedding's 48 input
channels in the header. The Wan 2.2 VAE's own file (Wan2.2_VAE.pth's original layout, as ComfyUI's
wan2.2_vae.safetensors holds it) is `model.parts.vae.path`, converted by wan_single_file.py; a Wan 2.1
VAE file there is named, from its header, before any weight loads.
"""

from __future__ import annotations

import torch

from modules.config.families.wan22_ti2v import DECLARATION
from modules.model.noise import Prediction
from modules.model.wan import WanFamily
from modules.model.wan_single_file import SIGNATURE, VAE22_SIGNATURE, VAE_PREFIXES, wan22_vae_to_diffusers
from modules.sampling.control_images import fitted_control_images
from modules.util.torch_utils import make_generator, shape_only


def token_timesteps(timesteps: torch.Tensor, latents_shape, patch_size, clean_first_frame: bool) -> torch.Tensor:
    """(B,) timesteps -> (B, F x h/ph x w/pw), one per transformer token (frame-major, as the
    transformer flattens its patches); the first frame's tokens 0 when it is the clean condition
    (WanImageToVideoPipeline's `first_frame_mask[0][0][:, ::2, ::2] * t`)."""
    _, _, frames, height, width = latents_shape
    _, patch_h, patch_w = patch_size
    mask = torch.ones(frames, height // patch_h, width // patch_w, device=timesteps.device)
    if clean_first_frame:
        mask[0] = 0
    return (mask.flatten().unsqueeze(0) * timesteps.float().view(-1, 1)).contiguous()


class Wan22TI2VFamily(WanFamily):
    declaration = DECLARATION  # name, label, parts, layer presets: modules/config/families/wan22_ti2v.py
    pipeline_config = {"expand_timesteps": True}  # what WanPipeline's index says for this model
    denoiser_config = {"_class_name": "WanTransformer3DModel", "in_channels": 48}
    # its transformer file has Wan 2.1's key names; its patch embedding takes the 48 latent channels
    single_file_signature = SIGNATURE
    single_file_shape = (r"^(model\.diffusion_model\.)?patch_embedding\.weight$", 1, 48)
    # its own VAE's file (a lone UMT5 file reads as Wan 2.1's: the UMT5 is the same)
    single_file_part_signatures = {"vae": VAE22_SIGNATURE}
    kohya_base_version = "wan_2.2_ti2v_5b"
    modelspec_architecture = "wan-2.2-ti2v-5b/lora"
    # counted from resources/model_configs/wan22_ti2v/ on the meta device (SOURCES.md)
    nominal_part_parameters = {"text_encoder": 5_680_910_336, "transformer": 4_999_787_712, "vae": 704_688_668}
    pipeline_options = {"expand_timesteps": True}
    video_fps = 24.0  # Wan 2.2's frame rate (its 121-frame clips are 5 s)

    def single_file_part(self, part: str):
        # the transformer file (Wan-AI's, ComfyUI's wan2.2_ti2v_5B_*) and a UMT5 file as for Wan 2.1; the
        # Wan 2.2 VAE's file (Wan2.2_VAE.pth's keys, ComfyUI's wan2.2_vae) in its own layout
        if part == "vae":
            from modules.loading.single_file import SingleFilePart

            return SingleFilePart(VAE_PREFIXES, wan22_vae_to_diffusers)
        return super().single_file_part(part)

    # --- training ----------------------------------------------------------------------------

    def denoise(self, noisy: torch.Tensor, sigmas: torch.Tensor, text: dict[str, torch.Tensor],
                clean_first_frame: bool = False) -> torch.Tensor:
        """The velocity (noise - latents) for (B, C, H, W) one-frame or (B, C, F, H, W) latents, with
        the timesteps expanded per token as the pipeline hands them; `clean_first_frame`: the first
        latent frame is the clean condition (timestep 0)."""
        dtype = self.compute_dtype("transformer")
        video = noisy if noisy.dim() == 5 else noisy.unsqueeze(2)
        timesteps = sigmas.float() * self.noise_scheduler.config.num_train_timesteps
        timestep = token_timesteps(timesteps, video.shape, self.transformer.config.patch_size, clean_first_frame)
        out = self.transformer(hidden_states=video.to(dtype), timestep=timestep,
                               encoder_hidden_states=text["hidden_states"].to(dtype), return_dict=False)[0]
        return out if noisy.dim() == 5 else out.squeeze(2)

    def step_is_image_to_video(self, latents: torch.Tensor, generator: torch.Generator) -> bool:
        """Whether this step's clips train image-to-video: `model.image_to_video` of the steps on clips
        of more than one latent frame (a still image has no frame after its first)."""
        share = self.config.model.image_to_video
        if latents.dim() != 5 or latents.shape[2] < 2 or share == 0:
            return False
        if share == 1:
            return True
        draw = torch.rand(1, generator=generator, device=generator.device)
        if shape_only(draw):  # the planner's step on fake or meta tensors (modules/plan/): both kinds cost the same
            return share >= 0.5
        return bool(draw.item() < share)

    def predict(self, latents, text, generator):
        if not self.step_is_image_to_video(latents, generator):
            return super().predict(latents, text, generator)
        noise = self.training_noise(latents, generator)
        sigmas = self.sample_sigmas(latents.shape[0], self.sequence_length(latents), generator).to(latents.device)
        expanded = sigmas.view(-1, 1, 1, 1, 1).to(latents.dtype)
        noisy = ((1 - expanded) * latents + expanded * noise)[:, :, 1:]
        noisy = torch.cat([latents[:, :, :1], noisy], dim=2)  # the condition frame stays clean
        prediction = self.denoise(noisy, sigmas, text, clean_first_frame=True)
        return Prediction(prediction[:, :, 1:], (noise - latents)[:, :, 1:])

    # --- sampling ----------------------------------------------------------------------------

    def sample_frames(self, prompt, device, frames: int = 1) -> list:
        """The prompt's video as PIL frames: from the text alone (WanPipeline), or from its
        `control_images[0]` as the first frame (WanImageToVideoPipeline), both with expand_timesteps."""
        if not prompt.control_images:
            return super().sample_frames(prompt, device, frames)
        from diffusers import UniPCMultistepScheduler, WanImageToVideoPipeline

        image = fitted_control_images(prompt.control_images, prompt.width, prompt.height, self.prompt_images[1],
                                      self.label)[0]
        pipe = WanImageToVideoPipeline(
            tokenizer=self.tokenizer, text_encoder=self.parts["text_encoder"], vae=self.parts["vae"],
            scheduler=UniPCMultistepScheduler.from_config(self.noise_scheduler.config), transformer=self.transformer,
            **self.pipeline_options)
        pipe.set_progress_bar_config(disable=True)
        negative = {}
        if prompt.cfg > 1:
            negative = {"negative_prompt_embeds": self._prompt_embeds(prompt.negative_prompt or "", device)}
        return pipe(
            image=image, prompt_embeds=self._prompt_embeds(prompt.prompt, device), guidance_scale=prompt.cfg,
            num_inference_steps=prompt.steps, width=prompt.width, height=prompt.height, num_frames=frames,
            generator=make_generator(device, prompt.seed), max_sequence_length=self.max_sequence_length,
            output_type="pil", **negative,
        ).frames[0]
