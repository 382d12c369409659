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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from modules.loading.diffusers_folder import (
    ModelLoadError,
    component_folder,
    weights_fingerprint,
)
from modules.model.noise import draw_noise, draw_unit_times
from modules.quantization.base import is_linear
from modules.quantization.replace import DENSE_MODES, QuantizationReport
from modules.quantization.skip_rules import FAMILY_SKIP_ATTRIBUTE
from modules.util.torch_utils import dtype_of

if TYPE_CHECKING:
    from PIL import Image

    from modules.config.train_config import SamplePromptConfig, TrainConfig


@dataclass(frozen=True)
class OriginalLayer:
    """One layer of a family's original (non-diffusers) checkpoint layout that holds several
    diffusers modules stacked along its output rows, e.g. FLUX's `single_blocks.0.linear1` =
    to_q, to_k, to_v, proj_mlp. kohya files name adapters by such layers (`stem`)."""

    stem: str  # the kohya key stem: lora_unet_single_blocks_0_linear1
    members: tuple[str, ...]  # diffusers module names inside the part, in row order
    rows: tuple[int, ...]  # output rows of each member
    swap_halves: bool = False  # the original stores the two halves of the rows swapped (FLUX's final adaLN)


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
    flow_matching: ClassVar[bool] = False  # rectified-flow target (no SNR weighting; logit-normal times)
    # parts whose conditioning the family reads from the penultimate block (hidden_states[-2]):
    # the last block of checkpoint_blocks(part) never reaches the loss, so it gets no adapters
    penultimate_parts: ClassVar[tuple[str, ...]] = ()
    # per part: regexes (searched in the module name) of Linear layers that stay dense when the
    # part is quantized, beyond the model class's own lists and the defaults (skip_rules.py)
    quantize_skip_patterns: ClassVar[dict[str, tuple[str, ...]]] = {}
    # how a model on disk shows it is of this family (modules/model/detect.py): the diffusers
    # pipeline class of model_index.json; entries of the denoiser's config.json; for an
    # original-layout single file, (a regex some key matches, a regex no key matches or None)
    pipeline_classes: ClassVar[tuple[str, ...]] = ()
    denoiser_config: ClassVar[dict[str, object]] = {}
    single_file_signature: ClassVar[tuple[str, str | None] | None] = None
    # textual-inversion embeddings (modules/methods/embedding.py): per text part, the attribute that
    # holds its tokenizer and the part's key in an A1111/ComfyUI embedding file; empty: none taken
    embedding_slots: ClassVar[dict[str, tuple[str, str]]] = {}

    def __init__(self, config: TrainConfig, weight_modes: dict[str, str] | None = None):
        self.config = config
        self.parts: dict[str, nn.Module] = {}
        # each part's storage mode with "auto" resolved (the trainer resolves it for the machine)
        self.weight_modes = dict(weight_modes or {})
        self.quantization_reports: dict[str, QuantizationReport] = {}
        # where a single file's part configs come from; None: resources/model_configs/<family>/
        self.model_configs_dir: Path | None = None
        self._single_file_stream = None

    @classmethod
    def default_parts(cls) -> dict[str, dict]:
        return {spec.name: {"train": spec.default_train} for spec in cls.part_specs}

    @classmethod
    def spec(cls, part: str) -> PartSpec:
        return next(s for s in cls.part_specs if s.name == part)

    # --- loading -----------------------------------------------------------------------------

    def part_folder(self, part: str):
        """The part's diffusers folder; for a part read from a single file, the folder of its
        config.json (the weights come from the file)."""
        spec = self.spec(part)
        if self.from_single_file(part):
            folder = self.model_config_folder() / spec.subfolder
            if not (folder / "config.json").is_file():
                raise ModelLoadError(f"model.base: a single file, and {folder} has no config.json to build "
                                     f"{part} from (or set model.parts.{part}.path to a diffusers folder)")
            return folder
        return component_folder(
            self.config.model.base, spec.subfolder, self.config.model.parts[part].path, f"model.parts.{part}.path"
        )

    # --- single files ------------------------------------------------------------------------

    def single_file_part(self, part: str):
        """How `part` sits in a single-file checkpoint in the original layout: a
        modules.loading.single_file.SingleFilePart (key prefixes, diffusers' converter), or None
        where the family reads no single files."""
        return None

    @property
    def single_file(self) -> Path | None:
        """model.base when it is one checkpoint file rather than a diffusers folder."""
        from modules.loading.single_file import is_single_file

        return Path(self.config.model.base) if is_single_file(self.config.model.base) else None

    def from_single_file(self, part: str) -> bool:
        return self.single_file is not None and not self.config.model.parts[part].path

    def model_config_folder(self) -> Path:
        """The diffusers-layout configs (and tokenizers/scheduler where shipped) a single file's
        parts are built from: resources/model_configs/<family>/ unless model_configs_dir says."""
        if self.model_configs_dir is not None:
            return Path(self.model_configs_dir)
        return Path(__file__).resolve().parents[2] / "resources" / "model_configs" / self.name

    def single_file_stream(self):
        from modules.loading.single_file import open_single_file

        if self._single_file_stream is None:
            self._single_file_stream = open_single_file(self.single_file)
            self._check_single_file_parts()
        return self._single_file_stream

    def _check_single_file_parts(self) -> None:
        """Before any weights load: every part the file lacks must have its own `path`."""
        from modules.loading.single_file import part_keys

        stream, missing = self._single_file_stream, []
        if not any(self.single_file_part(spec.name) for spec in self.part_specs):
            raise ModelLoadError(f"model.base: {stream.path.name} is a file; {self.label} loads from a "
                                 "diffusers folder only")
        for spec in self.part_specs:
            layout = self.single_file_part(spec.name)
            if self.from_single_file(spec.name) and (layout is None or not part_keys(stream, layout)):
                missing.append(f"model.parts.{spec.name}.path: {stream.path.name} holds no {spec.name} weights; "
                               f"name a diffusers {spec.subfolder}/ folder (config.json and weights) here")
        if missing:
            raise ModelLoadError("; ".join(missing))

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
            if self.from_single_file(spec.name):
                from modules.loading.single_file import part_parameter_count

                layout = self.single_file_part(spec.name)
                counts[spec.name] = (part_parameter_count(self.single_file_stream(), layout) if layout
                                     else self.nominal_part_parameters[spec.name])
                continue
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
        model, sources = empty_model(cls, folder, where), None
        setattr(model, FAMILY_SKIP_ATTRIBUTE, self.quantize_skip_patterns.get(part, ()))
        if self.from_single_file(part):  # original-layout keys, converted to diffusers names
            from modules.loading.single_file import convert_part

            stream = self.single_file_stream()
            sources = [convert_part(stream, self.single_file_part(part), model, where)]
            folder = stream.path
        model, report = load_streamed(
            model, folder, part=part, where=where, mode=self.weight_mode(part),
            compute_dtype=self.compute_dtype(part), quantize_skip=part_config.quantize_skip,
            nf4_double_quant=part_config.nf4_double_quant, rename=rename, ignore_unexpected=ignore_unexpected,
            sources=sources,
        )
        if report is not None:
            self.quantization_reports[part] = report
        return model

    def fingerprint(self, *parts: str) -> str:
        """Identity of the named parts' weights and dtypes, for cache keys."""
        facts = []
        for part in parts:
            if self.from_single_file(part):
                file = self.single_file
                facts.append([part, str(file.resolve()), self.weight_mode(part),
                              [file.stat().st_size, file.stat().st_mtime_ns]])
                continue
            folder = self.part_folder(part)
            facts.append([part, str(folder.resolve()), self.weight_mode(part), weights_fingerprint(folder)])
        return hashlib.sha256(json.dumps(facts).encode()).hexdigest()[:16]

    def support_folder(self, name: str) -> Path:
        """A folder the model needs besides weights (tokenizer/, scheduler/): in the diffusers base
        folder; for a single file, in the family's config folder or beside a part's `path`."""
        base = self.config.model.base
        if self.single_file is None:
            candidates = [Path(base) / name] if base else []
        else:
            candidates = [self.model_config_folder() / name] + [
                Path(p.path).parent / name for p in self.config.model.parts.values() if p.path]
        for candidate in candidates:
            if candidate.is_dir():
                return candidate
        if self.single_file is None:
            raise ModelLoadError(f"model.base: {base} has no {name}/ folder")
        raise ModelLoadError(
            f"model.base: {self.single_file.name} is a single file and no {name}/ folder was found (looked in "
            f"{', '.join(str(c) for c in candidates)}); set a text encoder's model.parts.<part>.path to the "
            f"component folder of a diffusers model that has {name}/ beside it")

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

    def training_noise(self, latents: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """The step's noise, with the config's loss.noise_offset."""
        return draw_noise(latents, generator, self.config.loss.noise_offset)

    def training_times(self, batch: int, generator: torch.Generator) -> torch.Tensor:
        """`batch` draws in (0, 1) from loss.timesteps (default: uniform, logit-normal for flow
        matching); each family maps them onto its own timesteps or noise levels."""
        loss = self.config.loss
        distribution = loss.timesteps if loss.timesteps != "default" else (
            "logit_normal" if self.flow_matching else "uniform")
        return draw_unit_times(batch, generator, distribution, loss.logit_mean, loss.logit_std)

    @abstractmethod
    def predict(
        self, latents: torch.Tensor, text: dict[str, torch.Tensor], generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Noise the latents (noise and timesteps drawn from `generator` through training_noise and
        training_times), run the denoiser, and return a Prediction (prediction, target, the
        timesteps' SNR where the family has one)."""

    # --- sampling ----------------------------------------------------------------------------

    def sample(self, prompt: SamplePromptConfig, device: torch.device) -> Image.Image:
        """One image from the live modules (adapters active), each part computing in its compute
        dtype as in training (modules/sampling/part_dtypes.py)."""
        from modules.sampling.part_dtypes import parts_in_compute_dtypes

        with parts_in_compute_dtypes(self):
            return self.run_sampling_pipeline(prompt, device)

    @abstractmethod
    def run_sampling_pipeline(self, prompt: SamplePromptConfig, device: torch.device) -> Image.Image:
        """One image from the family's diffusers pipeline built on the live modules."""

    def sampling_dtype(self, part: str) -> torch.dtype:
        """The dtype a part's inputs are cast to while sampling: its compute dtype, unless the
        family's pipeline itself moves the part to another dtype for sampling."""
        return self.compute_dtype(part)

    def sampling_entry_modules(self, part: str) -> list[nn.Module]:
        """Where a sampling pipeline's tensors enter `part`: its forward, and for an image part also
        its direct children, because pipelines call `vae.decode`, which runs the decoder without
        the VAE's own forward."""
        module = self.parts[part]
        return [module, *module.children()] if part in self.image_parts else [module]

    # --- adapters ----------------------------------------------------------------------------

    def unreachable_prefixes(self, part: str) -> tuple[str, ...]:
        """Module-name prefixes inside `part` whose output never reaches the loss (adapters there
        would get no gradient): the last block of a part read at its penultimate block."""
        if part not in self.penultimate_parts:
            return ()
        last = self.checkpoint_blocks(part)[-1]
        return tuple(f"{name}." for name, module in self.parts[part].named_modules() if module is last)

    def adapter_name(self, part: str, module_name: str) -> str:
        """The kohya/LyCORIS key stem for a module: lora_unet_down_blocks_0_..."""
        prefix = self.spec(part).adapter_prefix
        return f"{prefix}_{self.canonical_module_name(part, module_name).replace('.', '_')}"

    def canonical_module_name(self, part: str, module_name: str) -> str:
        """The module's name as other tools spell it (library versions may rename modules)."""
        return module_name

    def comfyui_skips_diffusers_key(self, part: str, module_name: str) -> str | None:
        """Why ComfyUI's loader would not load this module's adapter from a diffusers-format file
        (its key map has no such name: "lora key not loaded"), or None."""
        return None

    def other_stems(self, part: str, module_name: str) -> tuple[str, ...]:
        """More key stems other tools write for the module (read when loading, never written),
        e.g. ComfyUI's own `text_encoders.clip_l.transformer...` paths."""
        return ()

    def original_layers(self, part: str) -> list[OriginalLayer] | None:
        """The part's layers in the original checkpoint layout, where kohya LoRA files for this
        family use those names (sd-scripts' FLUX files): None where kohya names are the diffusers
        module names (`adapter_name`)."""
        return None

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
