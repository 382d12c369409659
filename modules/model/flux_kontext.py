"""FLUX.1 Kontext [dev]: FLUX.1's transformer, text encoders and VAE (flux.py), conditioned on a
reference (control) image as FluxKontextPipeline does: the control's latents are packed into 2x2
patches like the target's and concatenated after them along the sequence, with the target's
position ids except the first axis, 1 instead of 0; the transformer's output is cut back to the
target's tokens, so the loss is on the target alone and the reference only conditions.

A family of its own (not a FLUX.1 option): its name in the config is what tells the data pipeline
to carry control images (`control_images` in its declaration) and detection to read
FluxKontextPipeline folders, so nothing else asks which FLUX.1 it is. Adapter keys, single files
and the consumers are FLUX.1's: Kontext LoRAs are FLUX.1 LoRAs (ComfyUI, Forge and
FluxKontextPipeline.load_lora_weights read the same names).

Sampling: `sampling.prompts[].control_images[0]` is resized to cover the sample's size and
centre-cropped, as training brings each control to its target's bucket, and handed to the pipeline
at that size (`_auto_resize` off: the pipeline would otherwise pick one of Kontext's preferred
~1 MP resolutions); `max_area` is the sample's own, or the pipeline scales every sample to 1 MP.
"""

from __future__ import annotations


import torch

from modules.config.families.flux_kontext import DECLARATION
from modules.model.flux import FluxFamily, image_ids, pack_latents, unpack_latents
from modules.sampling.control_images import fitted_control_images
from modules.util.torch_utils import make_generator

REFERENCE_AXIS = 1.0  # the first position id of every reference token (FluxKontextPipeline.prepare_latents)


def reference_ids(height: int, width: int, device, dtype) -> torch.Tensor:
    """(H/2 * W/2, 3) position ids of a reference image's packed patches: (1, row, column)."""
    ids = image_ids(height, width, device, dtype)
    ids[:, 0] = REFERENCE_AXIS
    return ids


class FluxKontextFamily(FluxFamily):
    declaration = DECLARATION
    pipeline_classes = ("FluxKontextPipeline",)
    single_file_signature = None  # a Kontext file holds FLUX.1's tensors: name the family (model.family)
    modelspec_architecture = "flux-1-kontext-dev/lora"

    released_configs_of = "flux"  # FLUX.1's parts

    def denoise(self, noisy: torch.Tensor, sigmas: torch.Tensor, text: dict[str, torch.Tensor]) -> torch.Tensor:
        """The velocity for (B, C, H, W) latents; `text["control_latents"]` (B, N, C, h, w), when the
        samples have control images, joins the sequence after the target's tokens."""
        controls = text.get("control_latents")
        if controls is None:  # no reference: Kontext generates from the text alone
            return super().denoise(noisy, sigmas, text)
        height, width = noisy.shape[-2:]
        dtype = self.compute_dtype("transformer")
        target = pack_latents(noisy)
        tokens, ids = [target], [image_ids(height, width, noisy.device, dtype)]
        for index in range(controls.shape[1]):
            control = controls[:, index].to(noisy.device, noisy.dtype)
            tokens.append(pack_latents(control))
            ids.append(reference_ids(*control.shape[-2:], noisy.device, dtype))
        out = self.run_transformer(torch.cat(tokens, dim=1), torch.cat(ids, dim=0), sigmas, text)
        return unpack_latents(out[:, :target.shape[1]], height, width)

    # --- sampling ----------------------------------------------------------------------------

    def pipeline(self):
        from diffusers import FlowMatchEulerDiscreteScheduler, FluxKontextPipeline

        pipe = FluxKontextPipeline(
            scheduler=FlowMatchEulerDiscreteScheduler.from_config(self.noise_scheduler.config),
            vae=self.parts["vae"], text_encoder=self.parts["text_encoder"], tokenizer=self.tokenizer,
            text_encoder_2=self.parts["text_encoder_2"], tokenizer_2=self.tokenizer_2, transformer=self.transformer,
        )
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def run_sampling_pipeline(self, prompt, device):
        references = {}
        if prompt.control_images:
            references = {"image": fitted_control_images(prompt.control_images, prompt.width, prompt.height,
                                                         self.control_images, self.label)[0], "_auto_resize": False}
        return self.pipeline()(
            prompt=prompt.prompt, num_inference_steps=prompt.steps, guidance_scale=prompt.cfg,
            width=prompt.width, height=prompt.height, generator=make_generator(device, prompt.seed),
            max_sequence_length=self.max_sequence_length, max_area=prompt.width * prompt.height, **references,
        ).images[0]
