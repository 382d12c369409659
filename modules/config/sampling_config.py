"""Sample prompts (`sampling.*`): what the run samples at each sampling point, and what a "Sample
now" command (the run protocol's `sample` with a `prompt`) may ask for. Sizes, steps and the seed
are bounded (limits.py): a prompt sent while training is validated before it is queued, so a bad
one is refused with a warning naming the field and the run goes on."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from modules.config.limits import MAX_GUIDANCE, MAX_RESOLUTION, MAX_SAMPLE_STEPS, MAX_SEED
from modules.config.strict import StrictModel
from modules.config.video_config import MAX_FRAMES


class SamplePromptConfig(StrictModel):
    prompt: str = Field(..., description="What to sample.")
    negative_prompt: str = Field("", description="What to steer away from (with classifier-free guidance).")
    seed: int = Field(42, ge=0, le=MAX_SEED, description="The noise seed: the same seed gives comparable "
                      f"samples across steps (0 to {MAX_SEED}).")
    steps: int = Field(20, ge=1, le=MAX_SAMPLE_STEPS, description="Denoising steps.")
    cfg: float = Field(7.0, ge=0, le=MAX_GUIDANCE, description="Classifier-free guidance scale (1: none; "
                       "guidance-distilled families use it as their guidance input).")
    width: int = Field(512, ge=8, le=MAX_RESOLUTION, multiple_of=8, description="Sample width in pixels "
                       f"(a multiple of 8, at most {MAX_RESOLUTION}).")
    height: int = Field(512, ge=8, le=MAX_RESOLUTION, multiple_of=8, description="Sample height in pixels "
                        f"(a multiple of 8, at most {MAX_RESOLUTION}).")
    control_images: list[str] = Field(default_factory=list, description="Edit models: the control (reference) "
                                      "image files this sample starts from, resized to the sample's size.")
    frames: int = Field(1, ge=1, le=MAX_FRAMES, description="Video families: frames of the sample (Wan: 1 + 4n, "
                        "e.g. 33 or 81), written as .mp4 with a poster .png; 1: an image.")
    enabled: bool = Field(True, description="Sampled at each sampling point; off: kept in the list, skipped.")


class SamplingConfig(StrictModel):
    prompts: list[SamplePromptConfig] = Field(default_factory=list, description="The prompts sampled at each "
                                              "sampling point.")
    scheduler: Literal["ddim", "euler", "euler_a", "dpmpp_2m"] = Field(
        "ddim", description="The sampler (diffusers scheduler) used for samples (flow-matching families use "
        "their own).")
    vae_tiling: bool | Literal["auto"] = Field(
        "auto", description="Decode samples in overlapping tiles (diffusers' tiled VAE decode: 512 px tiles for "
        "SD/SDXL/FLUX-style VAEs, the class's own tiles for Wan/Qwen-Image): the decode holds a tile's activations "
        "instead of the whole image's (the pipeline's own VAE encodes, an image-to-video prompt's image, tile too), at a little more time and faint seams. auto: tiled only where the plan "
        "says the untiled decode sets the train device's peak over its budget and tiling lowers it.")
