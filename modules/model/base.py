"""ModelFamily: what the generic trainer needs to know about one model architecture.

A family file (sd15.py, ...) subclasses this once. It names its parts, loads them from a
diffusers folder, turns images into latents and captions into conditioning, computes the
training prediction and target, builds a sampling pipeline from the live modules, and maps
module names to the keys other tools use for adapters. The trainer knows no family by name.
"""

from __future__ import annotations

import hashlib
import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from modules.loading.diffusers_folder import component_folder, weights_fingerprint
from modules.quantization.base import is_linear
from modules.quantization.replace import DENSE_MODES, QuantizationReport
from modules.util.torch_utils import dtype_of

if TYPE_CHECKING:
    from PIL import Image

    from modules.config.train_config import SamplePromptConfig, TrainConfig


@dataclass(frozen=True)
class PartSpec:
    name: str  # the key under model.parts in the config
    subfolder: str  # its folder inside a diffusers model
    adapter_prefix: str | None  # kohya key prefix ("lora_unet"); None: never carries adapters
    default_train: bool = False


class ModelFamily(ABC):
    name: ClassVar[str]
    label: ClassVar[str]
    part_specs: ClassVar[tuple[PartSpec, ...]]
    bucket_quantum: ClassVar[int] = 64
    kohya_base_version: ClassVar[str]  # kohya's ss_base_model_version ("sd_v1", "sdxl_base_v1-0", ...)
    modelspec_architecture: ClassVar[str]  # modelspec.architecture of a LoRA file for this family
    # named layer selections: preset -> regexes searched in "part.module.name"; the module
    # must also be a kind the adapter supports (Linear; Conv2d only where a preset says so).
    layer_presets: ClassVar[dict[str, tuple[list[str], bool]]]
    # parameter count of each part of the full-size released model: what `info` and the auto
    # precision policy size a part by before any weights are on disk
    nominal_part_parameters: ClassVar[dict[str, int]]
    denoiser_part: ClassVar[str]  # the part every training step runs (what compile speeds up)

    def __init__(self, config: TrainConfig, weight_modes: dict[str, str] | None = None):
        self.config = config
        self.parts: dict[str, nn.Module] = {}
        # each part's storage mode with "auto" resolved (the trainer resolves it for the machine)
        self.weight_modes = dict(weight_modes or {})
        self.quantization_reports: dict[str, QuantizationReport] = {}

    @classmethod
    def default_parts(cls) -> dict[str, dict]:
        return {spec.name: {"train": spec.default_train} for spec in cls.part_specs}

    @classmethod
    def spec(cls, part: str) -> PartSpec:
        return next(s for s in cls.part_specs if s.name == part)

    # --- loading -----------------------------------------------------------------------------

    def part_folder(self, part: str):
        spec = self.spec(part)
        return component_folder(
            self.config.model.base, spec.subfolder, self.config.model.parts[part].path, f"model.parts.{part}.path"
        )

    @abstractmethod
    def load(self) -> None:
        """Load every part onto the CPU in its weight dtype, frozen and in eval mode."""

    def weight_mode(self, part: str) -> str:
        mode = self.weight_modes.get(part, self.config.model.parts[part].weight_dtype)
        if mode == "auto":
            raise ValueError(f"model.parts.{part}.weight_dtype: 'auto' must be resolved before loading")
        return mode

    def part_parameters(self) -> dict[str, int]:
        """Parameter count of each part, read from its checkpoint's headers (no weights are read);
        the family's nominal count where a header cannot say (pickled .bin files)."""
        from modules.loading.safetensors_stream import SafetensorsStream
        from modules.loading.streamed_load import checkpoint_files

        counts = {}
        for spec in self.part_specs:
            files = checkpoint_files(self.part_folder(spec.name), f"model.parts.{spec.name}")
            if all(path.suffix == ".safetensors" for path in files):
                streams = [SafetensorsStream(path) for path in files]
                counts[spec.name] = sum(torch.Size(stream.shape(key)).numel() for stream in streams
                                        for key in stream.keys() if not key.endswith(".scale_weight"))
            else:
                counts[spec.name] = self.nominal_part_parameters[spec.name]
        return counts

    def compute_dtype(self, part: str) -> torch.dtype:
        """The dtype a part computes in: its dense storage dtype, or the config's train_dtype when
        its weights are quantized (never read back from a parameter, which may be fp8 or uint8)."""
        return DENSE_MODES.get(self.weight_mode(part)) or dtype_of(self.config.train_dtype)

    def load_part(self, part: str, cls: type, rename: Callable[[str], str] | None = None,
                  ignore_unexpected: list[str] | None = None) -> nn.Module:
        """Stream a part from its folder into `cls`, quantized as its weight mode says."""
        from modules.loading.streamed_load import empty_model, load_streamed

        folder, where = self.part_folder(part), f"model.parts.{part}"
        part_config = self.config.model.parts[part]
        model, report = load_streamed(
            empty_model(cls, folder, where), folder, part=part, where=where, mode=self.weight_mode(part),
            compute_dtype=self.compute_dtype(part), quantize_skip=part_config.quantize_skip,
            nf4_double_quant=part_config.nf4_double_quant, rename=rename, ignore_unexpected=ignore_unexpected,
        )
        if report is not None:
            self.quantization_reports[part] = report
        return model

    def fingerprint(self, *parts: str) -> str:
        """Identity of the named parts' weights and dtypes, for cache keys."""
        facts = []
        for part in parts:
            folder = self.part_folder(part)
            facts.append([part, str(folder.resolve()), self.weight_mode(part), weights_fingerprint(folder)])
        return hashlib.sha256(json.dumps(facts).encode()).hexdigest()[:16]

    def to(self, device: torch.device) -> None:
        for module in self.parts.values():
            module.to(device)

    def checkpoint_blocks(self, part: str) -> list[nn.Module]:
        """The part's repeated blocks in execution order: the units gradient checkpointing
        recomputes and the layer offloader parks. Empty: the part cannot offload."""
        return []

    # --- data --------------------------------------------------------------------------------

    @abstractmethod
    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels: (B, 3, H, W) in [-1, 1] on the train device -> scaled latents."""

    @abstractmethod
    def tokenize(self, captions: list[str]) -> dict[str, torch.Tensor]:
        """Token tensors for a batch of captions, batch first."""

    @abstractmethod
    def encode_text(self, tokens: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Conditioning tensors, batch first (what the text cache stores per caption)."""

    @property
    @abstractmethod
    def text_parts(self) -> tuple[str, ...]:
        """Parts that encode_text runs; the text cache is used unless one of them trains."""

    @property
    @abstractmethod
    def image_parts(self) -> tuple[str, ...]:
        """Parts that encode_images runs."""

    # --- training ----------------------------------------------------------------------------

    @abstractmethod
    def predict(
        self, latents: torch.Tensor, text: dict[str, torch.Tensor], generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Noise the latents (noise and timesteps drawn from `generator`), run the denoiser,
        and return (prediction, target)."""

    # --- sampling ----------------------------------------------------------------------------

    @abstractmethod
    def sample(self, prompt: SamplePromptConfig, device: torch.device) -> Image.Image:
        """One image from the live modules (adapters active)."""

    # --- adapters ----------------------------------------------------------------------------

    def adapter_name(self, part: str, module_name: str) -> str:
        """The kohya/LyCORIS key stem for a module: lora_unet_down_blocks_0_..."""
        prefix = self.spec(part).adapter_prefix
        return f"{prefix}_{self.canonical_module_name(part, module_name).replace('.', '_')}"

    def canonical_module_name(self, part: str, module_name: str) -> str:
        """The module's name as other tools spell it (library versions may rename modules)."""
        return module_name

    def comfy_module_name(self, part: str, module_name: str) -> str:
        """The module's key stem in ComfyUI's own adapter layout (`diffusion_model.<its module
        path>`, `text_encoders.<its text encoder path>`). Families that have one override this."""
        raise NotImplementedError(f"{self.label} has no ComfyUI key layout")

    def adapter_targets(self, part: str, layer_filter: list[str], layer_preset: str) -> list[tuple[str, nn.Module]]:
        """(module name, module) of `part` chosen by the filter (or the preset when no filter)."""
        if layer_filter:
            patterns, with_conv = [re.compile(p) for p in layer_filter], True
        else:
            regexes, with_conv = self.layer_presets[layer_preset]
            patterns = [re.compile(p) for p in regexes]
        chosen = []
        for name, module in self.parts[part].named_modules():
            # a quantized Linear is a Linear to an adapter: it reads the base through the layer's forward
            is_conv = isinstance(module, nn.Conv2d) and module.groups == 1
            if not (is_linear(module) or (with_conv and is_conv)):
                continue
            qualified = f"{part}.{name}"
            if any(p.search(qualified) for p in patterns):
                chosen.append((name, module))
        return chosen
