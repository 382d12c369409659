"""Qwen-Image-Edit-Plus (Qwen/Qwen-Image-Edit-2509 and -2511): Qwen-Image-Edit (qwen_image_edit.py)
with several control images, as QwenImageEditPlusPipeline (diffusers 0.42,
pipeline_qwenimage_edit_plus.py) conditions on them:

- the VL encoder sees each control as "Picture N: <|vision_start|><|image_pad|><|vision_end|>" before
  the caption, in the same system template (its first 64 tokens dropped), each resized to the
  pipeline's condition size: ~384 x 384 pixels at the image's aspect (`CONDITION_IMAGE_SIZE`, sides
  rounded to 32), whatever size the VAE sees it at;
- each control's latents join the sequence after the target's, in order, with its own `img_shapes`
  entry; 2511's transformer config sets `zero_cond_t` (the controls' tokens modulated at timestep 0),
  which the transformer applies itself from those shapes.

The VAE sees each control at its target's bucket (the pipeline: ~1 MP at its own aspect, which a
1024 px bucket matches). Every sample of a run carries the same number of controls (a batch stacks
them), at most 3 (Qwen's model cards: 1 to 3 images).
"""

from __future__ import annotations

from modules.config.families.qwen_image_edit_plus import DECLARATION
from modules.model.qwen_image_edit import IMAGE_BLOCK, QwenImageEditFamily


def condition_size(width: int, height: int) -> tuple[int, int]:
    """(width, height) the pipeline shows a control of this aspect to the VL encoder at."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import CONDITION_IMAGE_SIZE, calculate_dimensions

    return calculate_dimensions(CONDITION_IMAGE_SIZE, width / height)


class QwenImageEditPlusFamily(QwenImageEditFamily):
    declaration = DECLARATION
    pipeline_classes = ("QwenImageEditPlusPipeline",)
    modelspec_architecture = "qwen-image-edit-plus/lora"
    tiny_model_variants = ("2509", "2511")  # 2511: the transformer's zero_cond_t

    def image_prompt(self, count: int) -> str:
        return "".join(f"Picture {index}: {IMAGE_BLOCK}" for index in range(1, count + 1))

    def vl_images(self, images: list) -> list:
        from PIL import Image

        # VaeImageProcessor.resize of a PIL image: a plain resize (no crop), Lanczos
        return [image.resize(self.vl_size(*image.size), Image.Resampling.LANCZOS) for image in images]

    def vl_size(self, width: int, height: int) -> tuple[int, int]:
        return condition_size(width, height)

    def pipeline(self):
        """QwenImageEditPlusPipeline on the live modules (for its helpers; no processor)."""
        from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageEditPlusPipeline

        return self._edit_pipeline(QwenImageEditPlusPipeline, FlowMatchEulerDiscreteScheduler)
