"""What a model family is, as the config and the GUI need to know it before any model code is
imported: its name and label, its parts, its layer presets, its bucket size and its training
target. One torch-free file per family declares this (modules/config/families/<name>.py); the
family's implementation (modules/model/<name>.py, torch and diffusers) points at its declaration
and takes these attributes from it, so the two never disagree and `TrainConfig()` or the GUI's
window need no torch (issue 30, defect 11)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PartSpec:
    name: str  # the key under model.parts in the config
    subfolder: str  # its folder inside a diffusers model
    adapter_prefix: str | None  # kohya key prefix ("lora_unet"); None: never carries adapters
    default_train: bool = False


# what a ModelFamily subclass takes from its declaration (flow_matching comes from its training
# mixin, which must agree with the declaration)
CLASS_ATTRIBUTES = ("name", "label", "part_specs", "denoiser_part", "layer_presets", "bucket_quantum",
                    "negative_prompt", "control_images", "prompt_control_images", "planned_control_images",
                    "image_to_video")


@dataclass(frozen=True)
class FamilyDeclaration:
    name: str  # model.family
    label: str  # what the GUI shows
    part_specs: tuple[PartSpec, ...]
    denoiser_part: str  # the part every training step runs (what compile speeds up)
    # named layer selections: preset -> (regexes searched in "part.module.name", convolutions too);
    # the module must also be a kind the adapter supports (Linear; Conv2d only where a preset says so)
    layer_presets: dict[str, tuple[list[str], bool]]
    implementation: str  # "module:Class" of its ModelFamily subclass, imported on first need
    bucket_quantum: int = 64  # image sides are multiples of this (VAE downscale x patch size)
    flow_matching: bool = False  # rectified-flow target (no SNR weighting; logit-normal times)
    # whether its samples read a prompt's negative_prompt (a guidance-distilled model's pipeline has none)
    negative_prompt: bool = True
    # the most control (reference) images one sample may carry (an edit model's); 0: none taken
    control_images: int = 0
    # (fewest, most) control images a sample prompt takes where that differs from the training
    # samples' (an image-to-video model starts every sample from a prompt image but trains on the
    # clips' own first frames); None: (0, control_images)
    prompt_control_images: tuple[int, int] | None = None
    # the control images per training sample the planner assumes where no concept shows how many (a
    # preset has no concepts): an edit model's usual count; 0 where references are optional
    planned_control_images: int = 0
    # whether it trains image-to-video from a clip's own first frame (model.image_to_video)
    image_to_video: bool = False

    @property
    def prompt_images(self) -> tuple[int, int]:
        """(fewest, most) images a sample prompt's control_images may hold."""
        return self.prompt_control_images or (0, self.control_images)

    def default_parts(self) -> dict[str, dict]:
        return {spec.name: {"train": spec.default_train} for spec in self.part_specs}

    @classmethod
    def of_class(cls, family_class) -> FamilyDeclaration:
        """The declaration of a family class defined without one (a plugin's or a test's toy family
        registered at runtime): read from its class attributes."""
        declared = getattr(family_class, "declaration", None)
        if isinstance(declared, FamilyDeclaration):
            return declared
        return cls(name=family_class.name, label=family_class.label, part_specs=tuple(family_class.part_specs),
                   denoiser_part=family_class.denoiser_part, layer_presets=dict(family_class.layer_presets),
                   implementation=f"{family_class.__module__}:{family_class.__qualname__}",
                   bucket_quantum=family_class.bucket_quantum, flow_matching=family_class.flow_matching,
                   negative_prompt=family_class.negative_prompt,
                   control_images=getattr(family_class, "control_images", 0),
                   prompt_control_images=getattr(family_class, "prompt_control_images", None),
                   planned_control_images=getattr(family_class, "planned_control_images", 0),
                   image_to_video=getattr(family_class, "image_to_video", False))
