"""ModelFamily: what the generic trainer needs to know about one model architecture.

A family file (sd15.py, ...) subclasses this once. It names its parts, loads them from a
diffusers folder, turns images into latents and captions into conditioning, computes the
training prediction and target, builds a sampling pipeline from the live modules, and declares
the keys other tools use for adapters (`key_layout`, modules/model/keys/). The trainer knows no
family by name. The generic halves live beside this file: part_loading.py (folders, single
files, the streamed load) and adapter_keys.py (key names from the layout); the pieces families
share in components/ (CLIP, VAE, DDPM, flow matching, UNet); tiny random models in tiny/.
"""

from __future__ import annotations

import importlib
import re
from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Collection

import torch
from torch import nn

from modules.config.family_declaration import CLASS_ATTRIBUTES, FamilyDeclaration, PartSpec  # noqa: F401  (PartSpec re-exported)
from modules.config.prompt_control_images import ExactPromptImages
from modules.model.adapter_keys import AdapterKeyNames
from modules.model.noise import draw_noise, draw_unit_times
from modules.model.part_loading import PartLoading
from modules.quantization.replace import QuantizationReport

if TYPE_CHECKING:
    from PIL import Image

    from modules.config.train_config import SamplePromptConfig, TrainConfig


class ModelFamily(PartLoading, AdapterKeyNames, ABC):
    # a built-in family's name, label, parts, layer presets and bucket size come from its torch-free
    # declaration (modules/config/families/<name>.py), copied onto the class by __init_subclass__;
    # a family defined without one (a plugin's, a test's toy) sets these attributes itself
    declaration: ClassVar[FamilyDeclaration | None] = None
    name: ClassVar[str]
    label: ClassVar[str]
    part_specs: ClassVar[tuple[PartSpec, ...]]
    bucket_quantum: ClassVar[int] = 64
    # a video family: its VAE's frames per latent frame (samples hold 1 + n x this); None: still images only
    temporal_quantum: ClassVar[int | None] = None
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
    # its sampling pipeline runs the unconditional pass in one batch with the conditional one (2 samples
    # per denoiser call) when a prompt's cfg is above this; None: separate passes, or no such pass
    # (the plan's sampling phase, modules/plan/phase_pass.py)
    batched_guidance_above: ClassVar[float | None] = None
    # whether its samples read a prompt's negative_prompt (a guidance-distilled model's pipeline has none)
    negative_prompt: ClassVar[bool] = True
    # the most control (reference) images one sample may carry (an edit model: they reach the
    # denoiser as conditioning["control_latents"], (B, N, C, h, w)); 0: none taken
    control_images: ClassVar[int] = 0
    # (fewest, most) control images a sample prompt takes where that differs (an image-to-video
    # model's prompt image); None: (0, control_images). Read through prompt_images.
    prompt_control_images: ClassVar[tuple[int, int] | None] = None
    # the control images per training sample a plan assumes where no concept shows how many (a preset)
    planned_control_images: ClassVar[int] = 0
    # whether it trains image-to-video from each clip's own first frame (model.image_to_video)
    image_to_video: ClassVar[bool] = False
    # whether its text conditioning depends on the control images too (a VL text encoder that sees
    # them): then `tokenize(captions, controls=...)` takes each caption's control images (PIL, at
    # the sample's bucket) and the text cache keys on them (modules/data/pairs.py); a text encoded in
    # the step (not cached) is handed them the same way (Batch.text_controls)
    text_sees_controls: ClassVar[bool] = False
    # conditioning the family draws from each sample's own pixels besides its latents (an
    # image-to-video model's first frame): the keys encode_pixel_conditioning returns; empty: none
    pixel_conditioning: ClassVar[tuple[str, ...]] = ()
    # encode_text tensors padded to a fixed window whose padding the denoiser masks out, so it
    # changes nothing (the family's tests must show it): name -> (its mask's name, its token axis
    # in one caption's tensor). The text cache stores only each caption's real tokens and the
    # batches put them back in the window, zeros at the padding (modules/data/text_padding.py);
    # empty: stored whole
    masked_text_padding: ClassVar[dict[str, tuple[str, int]]] = {}
    # what a one-frame sample (a still image, a one-frame clip) trains, where the run should say it
    # once per concept (modules/data/data_notes.py); None: nothing to say
    one_frame_note: ClassVar[str | None] = None
    # parts whose conditioning the family reads from the penultimate block (hidden_states[-2]),
    # with the module name of their block list (its tail: see numbered_blocks): the last block
    # never reaches the loss, so it gets no adapters (unreachable_prefixes)
    penultimate_blocks: ClassVar[dict[str, str]] = {}
    # per part: regexes (searched in the module name) of Linear layers that stay dense when the
    # part is quantized, beyond the model class's own lists and the defaults (skip_rules.py)
    quantize_skip_patterns: ClassVar[dict[str, tuple[str, ...]]] = {}
    # how a model on disk shows it is of this family (modules/model/detect.py): the diffusers
    # pipeline class of model_index.json; entries of the denoiser's config.json; for an
    # original-layout single file, (a regex some key matches, a regex no key matches or None)
    pipeline_classes: ClassVar[tuple[str, ...]] = ()
    # entries of model_index.json that must hold too, where several families share a pipeline class
    # (WanPipeline: Wan 2.1, and Wan 2.2 TI2V with `expand_timesteps`; an entry at None also matches
    # an index without it); each one held makes the claim surer (claims_model_index)
    pipeline_config: ClassVar[dict[str, object]] = {}
    denoiser_config: ClassVar[dict[str, object]] = {}
    single_file_signature: ClassVar[tuple[str, str | None] | None] = None

    @property
    def prompt_images(self) -> tuple[int, int]:
        """(fewest, most) images a sample prompt's control_images may hold (as its declaration's)."""
        return self.prompt_control_images or (0, self.control_images)

    def exact_prompt_images(self) -> ExactPromptImages | None:
        """How many images each sample prompt takes with this model's files, where they narrow
        `prompt_images` (Wan 2.1 I2V: one, or two with its FLF2V transformer), read from config files
        before any weight loads: the preflight checks the prompts against it. None: the range is the model's."""
        return None

    @classmethod
    def claims_model_index(cls, index: dict) -> int:
        """How surely a diffusers folder's model_index.json is this family's: 0 not at all, 1 by its
        pipeline class, one more per `pipeline_config` entry it holds (all must); a family whose
        rule is not a list of entries (Wan 2.2 A14B: a second transformer and a boundary, whatever
        its value) overrides this. detect.py takes the surest claim."""
        if index.get("_class_name") not in cls.pipeline_classes:
            return 0
        if not all(index.get(key) == value for key, value in cls.pipeline_config.items()):
            return 0
        return 1 + len(cls.pipeline_config)
    # a file that holds one part alone, as some tools ship a VAE or text encoder: part -> a regex
    # only that part's keys match (detect.py names such a file given as model.base)
    single_file_part_signatures: ClassVar[dict[str, str]] = {}
    # (a regex of a key, a dimension, its size) the file's header must show too, where two families'
    # files share their key names (Wan 2.1 and the TI2V 5B's 48-channel patch embedding); a family
    # whose shape holds is chosen before one that names none
    single_file_shape: ClassVar[tuple[str, int, int] | None] = None
    # families whose single files are this family's too (Wan 2.2 A14B: each expert's file is a Wan 2.1
    # 14B transformer file, detected as `wan`): a file detected as theirs is no mismatch (a folder is)
    single_files_of: ClassVar[tuple[str, ...]] = ()
    # textual-inversion embeddings (modules/methods/embedding.py): per text part, the attribute that
    # holds its tokenizer and the part's key in an A1111/ComfyUI embedding file (ComfyUI's
    # `embedding_key`: clip_l, clip_g, t5xxl, qwen3_4b, qwen3_8b, qwen25_7b); empty: none taken. A family
    # whose key depends on the model's size sets its own in load() (FLUX.2: klein 4B or 9B)
    embedding_slots: ClassVar[dict[str, tuple[str, str]]] = {}
    # per part, the modules its encoding, training step and sampling never run (a language model's
    # head whose logits nobody reads): a token table tied to one stays on the host all the same
    # (modules/offload/host_tables.py; running one there is an error naming it)
    never_run: ClassVar[dict[str, tuple[str, ...]]] = {}

    # data parallel: (first, total) while a rank trains samples first.. of a global batch of total;
    # the training draws are then made for the global batch and sliced (modules/trainer/distributed.py)
    draw_share: tuple[int, int] | None = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        declaration = cls.__dict__.get("declaration")
        if declaration is None:
            return
        for attribute in CLASS_ATTRIBUTES:
            setattr(cls, attribute, getattr(declaration, attribute))
        if cls.flow_matching != declaration.flow_matching:  # the training mixin decides the target
            raise TypeError(f"{cls.__name__}: its training mixin has flow_matching={cls.flow_matching}, its "
                            f"declaration {declaration.flow_matching}")

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

    @classmethod
    def make_tiny_model(cls, out: str | Path, **overrides) -> Path:
        """A random model of this architecture in diffusers layout, built offline for tests, the
        demo and benchmarks: modules/model/tiny/<name>.py's make_tiny_model."""
        return importlib.import_module(f"modules.model.tiny.{cls.name}").make_tiny_model(out, **overrides)

    # the models of a family of several that make_tiny_model builds (its `variant` option); the first is the default
    tiny_model_variants: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def tiny_model_options(cls, preset_name: str) -> dict:
        """make_tiny_model options for the tiny stand-in of the model a built-in preset is made for
        (a family of several models: FLUX.2's [dev] presets need the dev architecture)."""
        return {}

    @classmethod
    def released_variant(cls, preset_name: str) -> str | None:
        """The variant of the family's released architecture a built-in preset is sized for (the
        planner's `variant`: config folders `<subfolder>_<variant>`), read from the preset's name;
        by default the tiny stand-in's (FLUX.2's "dev")."""
        return cls.tiny_model_options(preset_name).get("variant")

    @abstractmethod
    def load(self) -> None:
        """Load every part onto the CPU in its weight dtype, frozen and in eval mode."""


    def checkpoint_blocks(self, part: str) -> list[nn.Module]:
        """The part's repeated blocks in execution order: the units gradient checkpointing
        recomputes and the layer offloader parks. Empty: the part cannot offload."""
        return []

    def resting_parts(self) -> tuple[str, ...]:
        """Parts the training step never runs that sampling does (Wan 2.2's untrained expert): they
        stay on the temp device while training, and are streamed block by block onto the train
        device only while samples are made (modules/trainer/resting_parts.py)."""
        return ()

    @classmethod
    def adapter_files(cls, trained_parts: list[str]) -> list[tuple[str, dict[str, str]]]:
        """How the trained adapters split into saved files: per file, the suffix its name takes after
        the output's stem and {part: the part its adapters are written as}. One file by default,
        each part under its own names; Wan 2.2 writes one file per expert, each as a lone Wan
        transformer, because each expert is loaded as a model of its own. Known from the config
        alone (output.if_exists checks every file before the model loads)."""
        return [("", {part: part for part in trained_parts})]

    @classmethod
    def init_from_files(cls, path: Path, trained_parts: list[str]) -> list[tuple[Path, dict[str, str]]] | None:
        """Where `adapter.init_from` `path` is a file of one of several parts (as `adapter_files` writes
        them: Wan 2.2's one expert under a lone transformer's names): per start file, {trained part:
        the part its adapters are written as}. None: the file holds the run's adapters under their
        own names (the default). Known from the config and the files' headers (a remote run sends
        each start file)."""
        return None

    def diffusers_load_options(self, suffix: str) -> dict:
        """The `load_lora_weights` options that load the saved file of `adapter_files`' `suffix` into
        the right component of the family's diffusers pipeline (Wan 2.2's low-noise file:
        `load_into_transformer_2`)."""
        return {}

    def trained_parts_not_run(self) -> set[str]:
        """Trained parts no `predict` has run yet (Wan 2.2's expert whose timesteps no sample drew):
        the first-step guard does not hold their adapters to having learned."""
        return set()

    def zero_gated_prefixes(self, part: str) -> tuple[str, ...]:
        """Module-name prefixes inside the loaded `part` whose output a gate that is exactly zero in its
        weights multiplies (FIBO-2's cross-attention on a model whose gates start at zero): their
        gradients are zero until the gate moves, in the first step, so the first-step guard does not
        hold them to having learned in it. Asked before training (the first step moves the gate)."""
        return ()

    # --- data --------------------------------------------------------------------------------

    @abstractmethod
    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels: (B, 3, H, W) in [-1, 1] on the train device -> scaled latents."""

    def encode_pixel_conditioning(self, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
        """The `pixel_conditioning` tensors of the samples whose pixels encode_images takes, batch first:
        cached with each sample's latents (its mirrored image's too) and handed to the denoiser with
        its text conditioning."""
        return {}

    def pixel_conditioning_shapes(self, latent_shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        """Each `pixel_conditioning` tensor's shape for one sample whose latents have `latent_shape`,
        from the parts' configs alone: what the preflight sizes the cache by before any encoder loads."""
        return {}

    @abstractmethod
    def tokenize(self, captions: list[str]) -> dict[str, torch.Tensor]:
        """Token tensors for a batch of captions, batch first."""

    @abstractmethod
    def encode_text(self, tokens: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Conditioning tensors, batch first (what the text cache stores per caption)."""

    def planning_conditioning(self, batch: int, device: torch.device) -> dict[str, torch.Tensor]:
        """What encode_text returns for `batch` captions, as uninitialised tensors of its keys, shapes
        and dtypes on `device`, from the parts' configs alone (no tokenizer, no weight): what the
        planner (modules/plan/) feeds the denoiser. tests/test_plan_conditioning.py checks it against
        encode_text on each tiny model."""
        raise NotImplementedError(f"{self.label} does not say what its text conditioning looks like")

    def planning_tokens(self, batch: int, device: torch.device) -> dict[str, torch.Tensor] | None:
        """What tokenize returns for `batch` captions, as ids of its keys, shapes and dtypes on
        `device`, from the parts' configs alone (no tokenizer): what the planner runs encode_text on
        where the text encoders run in the training step (an embedding, a trained encoder, varying
        captions). None: this family's encode_text cannot run on shapes alone (it selects tokens by
        their mask); the plan then feeds planning_conditioning and says the encoders are not counted.
        tests/test_plan_conditioning.py checks it against tokenize on each tiny model."""
        return None

    def planning_tokens_with_controls(self, batch: int, device: torch.device, controls: int, width: int,
                                      height: int) -> dict[str, torch.Tensor] | None:
        """planning_tokens for samples that carry `controls` control images at width x height. The same
        where the text encoder does not see them; else None (not counted) unless the family says how
        its encoder's pass over them is planned (text_sees_controls)."""
        return None if controls and self.text_sees_controls else self.planning_tokens(batch, device)

    def planning_conditioning_with_controls(self, batch: int, device: torch.device, controls: int,
                                            width: int, height: int) -> dict[str, torch.Tensor]:
        """planning_conditioning for samples that carry `controls` control images at width x height: what
        encode_text returns for them. The same by default; a family whose text encoder sees the controls
        (text_sees_controls) adds their tokens."""
        return self.planning_conditioning(batch, device)

    def planning_length(self, released: int) -> int:
        """The text window encode_text pads to: the tokenizer's where one is loaded, else the
        released model's `released`."""
        try:
            return self.max_sequence_length
        except AttributeError:  # no tokenizer: planning a model folder without one
            return released

    @staticmethod
    def planning_ids(batch: int, length: int, device: torch.device) -> torch.Tensor:
        """Token ids (all 0: a real token of every vocabulary) of `batch` captions padded to `length`."""
        return torch.zeros(batch, length, dtype=torch.long, device=device)

    def latent_geometry(self) -> tuple[int, int] | None:
        """(latent channels, pixels per latent cell along a side) of the image part, from its config
        alone (no weight read): what the preflight sizes a video cache by before the VAE loads.
        None: not known without encoding (the cache is then sized once it is built)."""
        return None

    def caption_windows(self) -> list[tuple[object, int]]:
        """(tokenizer, token count) of each window the family cuts every caption to, when the cut loses
        text the model sees nowhere else (the data warns of captions longer than it); loaded tokenizers.
        Empty: not checked (the chat-template families, whose window also holds the template)."""
        return []

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
        return draw_noise(latents, generator, self.config.loss.noise_offset, self.draw_share)

    def training_times(self, batch: int, generator: torch.Generator) -> torch.Tensor:
        """`batch` draws in (0, 1) from loss.timesteps (default: uniform, logit-normal for flow
        matching); each family maps them onto its own timesteps or noise levels."""
        loss = self.config.loss
        distribution = loss.timesteps if loss.timesteps != "default" else (
            "logit_normal" if self.flow_matching else "uniform")
        return draw_unit_times(batch, generator, distribution, loss.logit_mean, loss.logit_std, self.draw_share)

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

        with parts_in_compute_dtypes(self), self.sample_decoding():
            return self.run_sampling_pipeline(prompt, device)

    def sample_decoding(self):
        """The VAE decode as `sampling.vae_tiling` says: tiled where it is true (auto is resolved
        before the run loads, trainer/planned_autos.py; one left unresolved decodes whole)."""
        from modules.sampling.vae_tiling import tiled_decoding, tiling_vaes

        return tiled_decoding(tiling_vaes(self.parts, self.image_parts), self.config.sampling.vae_tiling is True)

    def written_out_prompt(self, text: str | None) -> str | None:
        """A sample prompt with each multi-vector embedding placeholder written out as its tokens,
        for the families whose pipeline does not do it (TextualInversionLoaderMixin's
        maybe_convert_prompt, which SD1.5's, SDXL's and FLUX.1's pipelines run, would do it twice)."""
        from modules.model.components.embedding_tokens import write_out_added_tokens

        if not text or not self.embedding_slots:
            return text
        return write_out_added_tokens(text, getattr(self, next(iter(self.embedding_slots.values()))[0]))

    def embedding_probe_captions(self, placeholder: str) -> list[str]:
        """Captions that show whether an embedding's placeholder survives what the family does to a
        caption before it tokenizes it (the embedding method refuses one that does not): the
        placeholder alone; a family that rewrites some captions adds one of each form it rewrites."""
        return [placeholder]

    @abstractmethod
    def run_sampling_pipeline(self, prompt: SamplePromptConfig, device: torch.device) -> Image.Image:
        """One image from the family's diffusers pipeline built on the live modules."""

    # a video family's sample frame rate (what its sample .mp4 plays at)
    video_fps: ClassVar[float] = 16.0

    def sample_video(self, prompt: SamplePromptConfig, device: torch.device) -> list[Image.Image]:
        """A video family's `prompt.frames` frames from the live modules, as sample() computes them."""
        from modules.sampling.part_dtypes import parts_in_compute_dtypes

        with parts_in_compute_dtypes(self), self.sample_decoding():
            return self.run_video_pipeline(prompt, device)

    def run_video_pipeline(self, prompt: SamplePromptConfig, device: torch.device) -> list[Image.Image]:
        raise NotImplementedError(f"{self.label} samples still images only")

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

    def unreachable_prefixes(self, part: str, names: Collection[str] | None = None) -> tuple[str, ...]:
        """Module-name prefixes inside `part` whose output never reaches the loss (adapters there
        would get no gradient): the last block of a part read at its penultimate block. Found from
        the part's module names: the loaded part's, or `names` (a checkpoint's, before loading)."""
        if part not in self.penultimate_blocks:
            return ()
        blocks, count = numbered_blocks(self._module_names(part, names), self.penultimate_blocks[part])
        return (f"{blocks}.{count - 1}.",) if count else ()

    def _module_names(self, part: str, names: Collection[str] | None) -> Collection[str]:
        return names if names is not None else [name for name, _ in self.parts[part].named_modules()]


def numbered_blocks(names: Collection[str], blocks: str) -> tuple[str, int]:
    """The block list `blocks` among module names (`blocks.0.`, `blocks.1.`, ...; under any outer
    module, as checkpoints of one class may name it with or without its wrapper, e.g. CLIP's
    `text_model.`): its full name and its block count; ("", 0) where there is none."""
    pattern = re.compile(rf"^((?:.*\.)?{re.escape(blocks)})\.(\d+)(?:\.|$)")
    counts: dict[str, int] = {}
    for match in filter(None, map(pattern.match, names)):
        counts[match.group(1)] = max(counts.get(match.group(1), 0), int(match.group(2)) + 1)
    return max(counts.items(), key=lambda item: item[1], default=("", 0))
