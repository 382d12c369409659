"""TrainConfig: everything a training run needs, as one validated pydantic tree.

A preset or config file is a partial JSON overlay on these defaults (see loading.py). Field
names are the dotted paths the GUI binds to and the CLI's `--set` takes, so renaming one is a
breaking change that needs a migration (migrations.py).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from modules.config.adapter_configs import (  # noqa: F401  (re-exported: the config's names live here)
    ADAPTERS,
    DEFAULT_ADAPTER_TYPE,
    AdapterConfig,
    AdapterConfigBase,
    AdapterPartConfig,
    default_adapter_config,
    valid_regexes,
)
from modules.config.distributed_config import DistributedConfig, check_distributed  # noqa: F401  (re-exported)
from modules.config.embedding_config import EmbeddingConfig, check_embeddings
from modules.config.control_config import ControlConfig
from modules.config.errors import located_error
from modules.config.limits import (AUTO_BATCH_SIZES, MAX_BACKUPS, MAX_BATCH, MAX_CACHE_MB, MAX_EPOCHS, MAX_GRAD_NORM,  # noqa: I001
                                    MAX_LEARNING_RATE, MAX_LOSS_WEIGHT, MAX_REPEATS, MAX_RESOLUTION,
                                    MAX_SAMPLES_PER_EPOCH, MAX_SEED, MAX_STEPS, MAX_TAGS, single_message)
from modules.config.method_configs import METHODS, MethodConfigBase
from modules.config.optimizer_configs import OPTIMIZERS, OptimizerConfigBase
from modules.config.sampling_config import SamplePromptConfig, SamplingConfig  # noqa: F401  (re-exported)
from modules.config.strict import StrictModel
from modules.config.video_config import VideoConfig
from modules.quantization.weight_modes import LayerOptions, is_weight_mode, weight_mode_names
from modules.util.did_you_mean import did_you_mean

CURRENT_VERSION = 2

# The config's tagged sections (modules/config/tagged.py), by their key: the loader and the GUI
# retype them when their `type` changes.
DEFAULT_WORKSPACE = "workspace"
# torch's device types (c10/core/DeviceType.h), for checking a device string without importing torch;
# with torch loaded, torch.device() decides (it also knows a backend registered at runtime)
TORCH_DEVICE_TYPES = frozenset({"cpu", "cuda", "mps", "xpu", "xla", "meta", "hip", "hpu", "mtia", "ipu", "ve",
                                "lazy", "vulkan", "maia", "privateuseone"})
TAGGED_SECTIONS = {union.section: union for union in (METHODS, ADAPTERS, OPTIMIZERS)}

DType = Literal["float32", "bfloat16", "float16"]


def weight_dtype_choices() -> list[str]:
    """How a part's base weights can be stored: the registered weight modes (the dense ones are
    also the compute dtype; the quantized ones compute in `train_dtype`), and auto, which picks by
    free memory (modules/quantization/policy.py). Read at validation and schema time, so a mode
    registered at runtime (modules/quantization/weight_modes.py) is offered and accepted."""
    return [*weight_mode_names(), "auto"]


def _weight_dtype_schema(schema: dict) -> None:
    schema["enum"] = weight_dtype_choices()  # the JSON schema and the GUI list the registry's modes


class ModelPartConfig(StrictModel):
    path: str | None = Field(None, description="Load this part from here instead of the base model.")
    train: bool = Field(False, description="Train this part (its adapter, or its weights in a fine-tune).")
    learning_rate: float | None = Field(None, gt=0, le=MAX_LEARNING_RATE, description="None: the optimizer's lr.")
    weight_dtype: str = Field(
        "float32", json_schema_extra=_weight_dtype_schema,
        description="Storage of the base weights: dense float32/bfloat16/float16, or quantized "
        "float8 (e4m3 + scale), int8 (torchao weight-only), w8a8_int8/w8a8_fp8 (8-bit weights and "
        "activations), nf4 (bitsandbytes 4-bit), or auto (what fits this machine).")
    nf4_double_quant: bool = Field(True, description="nf4: quantize the block scales too (saves ~0.4 bit/weight).")
    quantize_skip: list[str] = Field(
        default_factory=list,
        description="Regexes searched in 'part.module.name': matching Linear layers stay dense "
        "(added to the model's own keep-in-high-precision lists).")

    gradient_checkpointing: bool | Literal["auto"] = Field(
        False, description="Recompute each block's activations in the backward pass instead of keeping them "
        "(non-reentrant checkpointing per block): less memory, about a third more compute. auto: on only where "
        "the plan says the run does not fit the train device without it.")
    offload_fraction: Annotated[float, Field(ge=0, le=1)] | Literal["auto"] = Field(
        0.0, description="Share (0..1) of the bytes of the part's blocks parked on temp_device (at least that, "
        "spread over the stack) and brought to the train device block by block; auto: the smallest share that "
        "fits the train device.")
    offload_prefetch: int = Field(
        1, ge=1, le=8, description="With offload_fraction: parked blocks brought ahead of the one that runs. "
        "Each holds one more parked block on the train device; more hides transfers slower than a block's compute.")
    activation_offloading: bool = Field(
        False, description="With gradient_checkpointing: keep each block's saved input on temp_device "
        "until the backward pass needs it.")

    @field_validator("weight_dtype")
    @classmethod
    def _registered_weight_mode(cls, value: str) -> str:
        if value != "auto" and not is_weight_mode(value):
            raise ValueError(f"unknown weight mode {value!r}{did_you_mean(value, weight_dtype_choices())} "
                             f"(known: {', '.join(weight_dtype_choices())})")
        return value

    _fraction_in_range = field_validator("offload_fraction", mode="wrap")(
        single_message("must be between 0 and 1, or 'auto'"))

    def layer_options(self) -> LayerOptions:
        """What the weight mode's layer factory reads of this part (one object passed down the
        loader, so no mode's option is a keyword of every layer between here and the factory)."""
        return LayerOptions(nf4_double_quant=self.nf4_double_quant)

    @model_validator(mode="after")
    def _activation_offloading_needs_checkpointing(self) -> "ModelPartConfig":
        if self.activation_offloading and not self.gradient_checkpointing:
            raise located_error("offloads the inputs that gradient checkpointing keeps; turn on "
                                "gradient_checkpointing for this part", "activation_offloading")
        return self

    @field_validator("quantize_skip")
    @classmethod
    def _valid_skip_regexes(cls, patterns: list[str]) -> list[str]:
        return valid_regexes(patterns)


class ModelConfig(StrictModel):
    family: str = Field("sd15", description="The model family (architecture): sd15, sdxl, flux, z_image, ...; "
                        "it decides the parts, the layer presets and how the model is loaded.")
    base: str = Field("", description="A diffusers model folder, or one .safetensors file in the original "
                      "(single-file) layout; parts a single file lacks come from model.parts.<part>.path.")
    prediction_type: Literal["auto", "epsilon", "v_prediction"] = Field(
        "auto", description="What the denoiser predicts (DDPM families): auto reads it from the model's scheduler "
        "config; v_prediction for SD 2.x-style v models.")
    parts: dict[str, ModelPartConfig] = Field(default_factory=dict, description="Per model part (unet, "
                                              "text_encoder, ...): training, precision, offloading.")
    image_to_video: float = Field(0.0, ge=0, le=1, description="Image-to-video families (Wan 2.2 TI2V): the "
                                  "share of steps on clips trained as image-to-video (each clip's first frame "
                                  "given clean, as its pipeline's prompt image, the loss on the frames after "
                                  "it); 0: text-to-video only, 1: image-to-video only.")

    @model_validator(mode="before")
    @classmethod
    def _fill_family_parts(cls, data: Any) -> Any:
        """Overlay the given parts on the family's defaults, so `{"unet": {"learning_rate": 1e-4}}`
        keeps the family's `train: true` for the unet. Unknown part names are reported."""
        if not isinstance(data, dict):
            return data
        from modules.config.families import family_names, get_family_declaration

        family = data.get("family", "sd15")
        if family not in family_names():
            return data  # the field validator reports the bad family
        defaults = get_family_declaration(family).default_parts()
        given = data.get("parts")
        if given is None:
            given = {}
        if not isinstance(given, dict):
            return data  # reported as "must be an object"
        unknown = sorted(set(given) - set(defaults))
        if unknown:
            raise located_error(
                f"unknown part for family {family!r}{did_you_mean(unknown[0], defaults)} (parts: {', '.join(defaults)})",
                "parts", unknown[0]
            )
        parts = {}
        for name, default in defaults.items():
            override = given.get(name)
            if override is None:
                override = {}
            parts[name] = {**default, **override} if isinstance(override, dict) else override
        return {**data, "parts": parts}

    @field_validator("family")
    @classmethod
    def _known_family(cls, value: str) -> str:
        from modules.config.families import family_names

        if value not in family_names():
            raise ValueError(f"unknown family {value!r}{did_you_mean(value, family_names())} "
                             f"(known: {', '.join(family_names())})")
        return value


class LossConfig(StrictModel):
    type: Literal["mse", "huber", "l1"] = Field("mse", description="Loss between prediction and target: mse "
                                                "(squared), huber (squared near 0, linear beyond huber_delta), l1.")
    huber_delta: float = Field(1.0, gt=0, le=1000, description="huber: where the loss turns from squared to linear.")
    min_snr_gamma: float | None = Field(None, gt=0, le=1000, description="Min-SNR weighting (e.g. 5); epsilon and "
                                        "v-prediction families only.")
    debiased_estimation: bool = Field(False, description="Weight each sample by 1/sqrt(SNR); epsilon and "
                                      "v-prediction families only.")
    noise_offset: float = Field(0.0, ge=0, le=1, description="Add this much per-channel constant noise (e.g. 0.05).")
    timesteps: Literal["default", "uniform", "logit_normal"] = Field(
        "default", description="How training timesteps are drawn; default: uniform for DDPM families, "
        "logit-normal for flow-matching ones.")
    logit_mean: float = Field(0.0, ge=-10, le=10,
        description="logit_normal timesteps: the mean of the normal before the sigmoid.")
    logit_std: float = Field(1.0, gt=0, le=10, description="logit_normal timesteps: the spread of the normal "
                             "before the sigmoid.")
    flow_shift: float | None = Field(None, gt=0, le=100, description="Flow-matching families: shift the drawn "
                                     "noise levels by this instead of the model's own (dynamic) shift.")


class EmaConfig(StrictModel):
    enabled: bool = Field(False, description="Keep an exponential moving average of the trained weights; "
                          "samples and saves use it.")
    decay: float = Field(0.999, gt=0, lt=1, description="Share of the old average kept at each update "
                         "(0.999: averages over ~1000 updates).")
    update_every: int = Field(1, ge=1, le=MAX_STEPS, description="Optimizer steps between EMA updates.")
    device: Literal["train", "cpu"] = Field("train", description="Where the averaged copy lives.")


class LrSchedulerConfig(StrictModel):
    type: Literal["constant", "linear", "cosine", "cosine_with_restarts", "polynomial"] = Field(
        "constant", description="How the learning rate changes over the run (after the warmup).")
    warmup_steps: int = Field(0, ge=0, le=MAX_STEPS,
        description="Optimizer steps over which the lr rises linearly from 0.")
    cycles: int = Field(1, ge=1, le=MAX_EPOCHS, description="cosine_with_restarts: how many cosine cycles.")
    power: float = Field(1.0, gt=0, le=100, description="polynomial: the decay's exponent (1 = linear).")
    min_factor: float = Field(0.0, ge=0, le=1, description="The lr never decays below this share of itself.")
    scale_by_batch_size: bool = Field(False, description="Multiply the learning rates by batch_size x "
                                      "gradient_accumulation (the effective batch), as kohya's scale_lr does.")


class CaptionConfig(StrictModel):
    """How a concept's captions are varied while training (kohya / OneTrainer caption options)."""

    prefix: str = Field("", description="Put before every caption (e.g. a trigger word and ', ').")
    suffix: str = Field("", description="Put after every caption.")
    separator: str = Field(",", min_length=1, description="What splits a caption into tags.")
    shuffle_tags: bool = Field(False, description="Shuffle the tags each time an image is trained.")
    keep_tags: int = Field(0, ge=0, le=MAX_TAGS, description="The first N tags stay first and are never dropped.")
    tag_dropout: float = Field(0.0, ge=0, lt=1, description="Drop each other tag with this probability.")
    caption_dropout: float = Field(0.0, ge=0, le=1, description="Train with an empty caption this often.")

    @property
    def varies(self) -> bool:
        return self.shuffle_tags or self.tag_dropout > 0 or self.caption_dropout > 0


class ConceptConfig(StrictModel):
    name: str = Field("", description="A name for this concept (shown in logs; optional).")
    path: str = Field(..., description="Folder of png/jpg/webp images.")
    caption_source: Literal["txt", "file", "filename"] = Field(
        "txt",
        description="txt: a .txt beside each image; file: one caption file for the folder; "
        "filename: the image's file name.",
    )
    caption_file: str = Field("caption.txt", description="For caption_source 'file', relative to the folder.")
    repeats: int = Field(1, ge=1, le=MAX_REPEATS, description=f"Each image is seen this many times per epoch "
                         f"(at most {MAX_REPEATS}).")
    enabled: bool = Field(True, description="Off: the concept stays in the config but is not used.")
    include_subfolders: bool = Field(False, description="Also take the images in the folder's subfolders.")
    validation: bool = Field(False, description="Not trained on: its images measure the validation loss "
                             "(schedule.validate_every).")
    loss_weight: float = Field(1.0, gt=0, le=MAX_LOSS_WEIGHT,
        description="Multiplies the loss of this concept's images.")
    samples_per_epoch: int | None = Field(None, ge=1, le=MAX_SAMPLES_PER_EPOCH,
        description="Balance concepts by count: this many of "
                                          "its images per epoch (cycling, reshuffled each epoch) instead of repeats.")
    captions: CaptionConfig = Field(default_factory=CaptionConfig, description="Caption options: prefix, "
                                    "suffix, tag shuffle and dropout.")
    masked_loss: bool = Field(False, description="Weight the loss by `<image>-masklabel.png` beside each image "
                              "(white: full weight).")
    unmasked_weight: float = Field(0.1, ge=0, le=1, description="masked_loss: the weight of the black area.")
    video: VideoConfig = Field(default_factory=VideoConfig, description="Video options: frames per sample, "
                               "frame stride or fps, how clips are cut into windows.")
    controls: ControlConfig = Field(default_factory=ControlConfig, description="Control (reference) images per "
                                    "sample, for edit models (docs/data.md#paired-samples).")


_CADENCE_TEXT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(steps?|epochs?|minutes?)\s*$")


class Cadence(StrictModel):
    """How often an action runs; 0 means never. Also accepts "250 steps", "2 epochs", "30 minutes"."""

    value: float = Field(0, ge=0, le=MAX_STEPS, description="How many units between two runs of the action; 0: never.")
    unit: Literal["steps", "epochs", "minutes"] = Field("steps", description="What value counts.")

    @model_validator(mode="before")
    @classmethod
    def _from_text(cls, data: Any) -> Any:
        if isinstance(data, (int, float)) and not isinstance(data, bool):
            return {"value": data, "unit": "steps"}  # a bare number counts steps; 0: never
        if isinstance(data, str):
            match = _CADENCE_TEXT.match(data)
            if not match:
                raise ValueError(f"{data!r} is not like '250 steps', '2 epochs' or '30 minutes'")
            unit = match.group(2)
            return {"value": float(match.group(1)), "unit": unit if unit.endswith("s") else unit + "s"}
        return data


class ScheduleConfig(StrictModel):
    epochs: int = Field(10, ge=1, le=MAX_EPOCHS, description="Passes over the data set.")
    max_steps: int | None = Field(None, ge=1, le=MAX_STEPS,
        description="Optimizer steps; ends the run before the epochs do.")
    batch_size: Annotated[int, Field(ge=1, le=MAX_BATCH)] | Literal["auto"] = Field(
        1, description=f"Images per forward pass (same bucket). auto: the largest of {AUTO_BATCH_SIZES} that the plan "
        "fits on the train device (1 where no device budget is known, as on the CPU).")
    gradient_accumulation: int = Field(1, ge=1, le=MAX_BATCH, description="Batches whose gradients add up before one "
                                       "optimizer step (effective batch = batch_size x this).")

    _batch_size_in_range = field_validator("batch_size", mode="wrap")(
        single_message(f"must be a whole number from 1 to {MAX_BATCH}, or 'auto'"))
    max_grad_norm: float | None = Field(1.0, gt=0, le=MAX_GRAD_NORM,
        description="Clip the gradients' total norm to this "
                                        "(a fused fine-tune: each parameter's own norm); None: no clipping.")
    sample_every: Cadence = Field(default_factory=Cadence, description="Sample the prompts this often "
                                  "(0: never).")
    backup_every: Cadence = Field(default_factory=Cadence, description="Write a backup (adapter, optimizer, "
                                  "position: to resume) this often (0: only when stopped).")
    save_every: Cadence = Field(default_factory=Cadence, description="Save the adapter into workspace/save "
                                "this often (0: only at the end).")
    validate_every: Cadence = Field(default_factory=Cadence, description="Validation loss on the validation "
                                    "concepts, at the same timesteps and noise every time.")


Resolution = Annotated[int, Field(ge=8, le=MAX_RESOLUTION)]


class DataConfig(StrictModel):
    resolution: Resolution | list[Resolution] = Field(
        512, description=f"Training resolution (8 to {MAX_RESOLUTION} pixels), or several: each image then "
        "trains at each of them.")
    aspect_buckets: bool = Field(True, description="Train each image at the size of its aspect ratio "
                                 "(buckets) instead of a centre-cropped square.")
    flip: bool = Field(False, description="Train each image mirrored half of the time (both versions are "
                       "encoded and cached).")
    cache_latents: bool = Field(True, description="Encode each image once and reuse its latents; off: encode "
                                "each time it is trained (needed for crop_jitter and color_jitter).")
    crop_jitter: bool = Field(False, description="Crop at a random position instead of the centre.")
    color_jitter: float = Field(0.0, ge=0, le=0.5, description="Move brightness, contrast and saturation by "
                                "up to this much each time an image is trained.")
    cache_memory_mb: float = Field(
        256, ge=0, le=MAX_CACHE_MB,
            description="Cached latents and text kept in RAM (the most recently used, up to this many "
        "MB); the rest is read from the cache folder as batches need it, so RAM does not grow with the number "
        "of images. 0: read every batch from disk.")
    prefetch_batches: int = Field(
        2, ge=0, le=64, description="Batches assembled ahead on a background thread (cache reads, crops, "
        "stacking) while the current step runs. 0: assemble each batch between steps.")

    @model_validator(mode="after")
    def _jitter_needs_fresh_latents(self) -> "DataConfig":
        for name in ("crop_jitter", "color_jitter"):
            if getattr(self, name) and self.cache_latents:
                raise located_error("changes the image each time it is trained, so its latents cannot be "
                                    "cached: set data.cache_latents to false", name)
        return self

    _resolution_in_range = field_validator("resolution", mode="wrap")(
        single_message(f"must be a whole number of pixels from 8 to {MAX_RESOLUTION}, or a list of them"))

    @field_validator("resolution")
    @classmethod
    def _at_least_one(cls, value: int | list[int]) -> int | list[int]:
        if isinstance(value, list) and not value:
            raise ValueError("give at least one resolution")
        return value

    @property
    def resolutions(self) -> list[int]:
        return sorted(set(self.resolution)) if isinstance(self.resolution, list) else [self.resolution]


class OutputConfig(StrictModel):
    path: str = Field("", description="The adapter file the run saves at its end; empty: "
                      "<workspace_dir>/output/<name>.safetensors, where name is the workspace folder's name, "
                      "or, for the default folder `workspace`, the family and what is trained (sdxl-lora, "
                      "flux-fine_tune), so a file copied out of its workspace still says what it is.")
    if_exists: Literal["version", "refuse", "overwrite"] = Field(
        "version", description="When output.path already holds a file this run did not write (a --resume "
        "may replace its own): version saves beside it as name-2.safetensors, name-3, ...; refuse stops "
        "before training; overwrite replaces it at the end.")
    format: Literal["kohya", "comfy", "diffusers"] = Field(
        "kohya", description="Key layout of the saved adapter: kohya (lora_unet_..., LyCORIS names for "
        "loha/lokr/oft; A1111, Forge, ComfyUI, diffusers for LoRA), comfy (ComfyUI's own "
        "diffusion_model. keys; FLUX: the kohya layout, which ComfyUI reads completely), "
        "diffusers (peft lora_A/lora_B keys, scale folded in; "
        "lora, DoRA on the output axis, loha, lokr).")
    dtype: DType = Field("float16", description="Dtype of the saved adapter's tensors.")


class BackupConfig(StrictModel):
    rolling_count: int = Field(3, ge=1, le=MAX_BACKUPS, description="Older backups beyond this many are deleted.")
    resume: bool = Field(False, description="Continue from the newest backup in the workspace (a run "
                         "setting, never saved into presets).")


class TrainConfig(StrictModel):
    version: int = CURRENT_VERSION
    model: ModelConfig = Field(default_factory=ModelConfig)
    method: Annotated[MethodConfigBase, METHODS] = Field(
        default_factory=METHODS.default_config, description="What the run trains: an adapter (adapter), the "
        "parts' own weights (fine_tune), or only the embeddings (embedding).")
    adapter: Annotated[AdapterConfigBase, ADAPTERS] = Field(
        default_factory=ADAPTERS.default_config, description="The adapter a run with method.type adapter "
        "trains: its algorithm (type) and that algorithm's options.")
    embeddings: list[EmbeddingConfig] = Field(default_factory=list, description="Textual-inversion embeddings: "
                                              "new tokens for the text encoders, trained alone (method.type "
                                              "embedding) or alongside the adapter or fine-tune, or used frozen.")
    optimizer: Annotated[OptimizerConfigBase, OPTIMIZERS] = Field(default_factory=OPTIMIZERS.default_config)
    lr_scheduler: LrSchedulerConfig = Field(default_factory=LrSchedulerConfig)
    ema: EmaConfig = Field(default_factory=EmaConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    concepts: list[ConceptConfig] = Field(default_factory=list)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    output: OutputConfig = Field(default_factory=OutputConfig)
    backup: BackupConfig = Field(default_factory=BackupConfig)
    workspace_dir: str = Field(DEFAULT_WORKSPACE, description="Where the run keeps its cache, samples, backups, "
                               "saves and logs.")
    cache_dir: str | None = Field(None, description="None: <workspace_dir>/cache.")
    train_device: str = Field("auto", description="auto, cpu, cuda, cuda:1, ... (any torch device; with "
                              "distributed.gpus > 1, auto or cuda means each process's own GPU)")
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    temp_device: str = Field("cpu", description="Where offloaded layers and activations wait (any torch device).")
    train_dtype: DType = Field("float32", description="Autocast dtype for the forward pass.")
    tf32: bool = Field(True, description="On CUDA, float32 matrix products use TF32 tensor cores (a 10-bit "
                       "mantissa, several times faster); off: full float32 precision.")
    seed: int = Field(42, ge=0, le=MAX_SEED, description="Seed of everything random in the run (noise, "
                      f"timesteps, order, caption shuffles; 0 to {MAX_SEED}).")
    tensorboard: bool = Field(True, description="Write TensorBoard logs (loss, lr, samples) to "
                              "<workspace_dir>/tensorboard.")
    compile: bool = Field(False, description="torch.compile the denoiser; turned off, with a warning saying "
                          "why, for weight modes whose training graph does not compile.")

    @property
    def output_path(self) -> Path:
        """`output.path`, or the workspace's own default when it is empty."""
        if self.output.path:
            return Path(self.output.path).expanduser()
        workspace = Path(self.workspace_dir).expanduser()
        name = workspace.resolve().name
        if name in ("", DEFAULT_WORKSPACE):  # "workspace.safetensors" would say nothing about the file
            traits = METHODS.traits(self.method.type)
            name = f"{self.model.family}-{self.adapter.type if traits.uses_adapter else self.method.type}"
        return workspace / "output" / f"{name}.safetensors"

    @model_validator(mode="after")
    def _offloaded_trained_parts_recompute(self) -> "TrainConfig":
        # A trained part's backward pass needs each block's weights again. With checkpointing the
        # block is recomputed (its layers brought back) right before its backward; without it the
        # layers would have left long before.
        for name, part in self.model.parts.items():
            if part.train and part.offload_fraction != 0 and not part.gradient_checkpointing:
                raise located_error("layer offloading of a trained part needs gradient_checkpointing: true "
                                    "(the backward pass recomputes each block while its layers are on the "
                                    "train device)", "model", "parts", name, "offload_fraction")
        return self

    @model_validator(mode="after")
    def _distributed_fits(self) -> "TrainConfig":
        check_distributed(self)  # distributed_config.py: what several processes and FSDP sharding support
        return self

    @model_validator(mode="after")
    def _embeddings_fit(self) -> "TrainConfig":
        problems = check_embeddings(self.embeddings, self.method.type,
                                    METHODS.traits(self.method.type).trains_embeddings)
        if problems:
            text, at = problems[0]
            raise located_error(text, *at)
        return self

    @model_validator(mode="after")
    def _method_fits_config(self) -> "TrainConfig":
        self.method.check_config(self)  # a method's own rules about the rest of the config
        return self

    @field_validator("version")
    @classmethod
    def _current_version(cls, value: int) -> int:
        # Older versions are migrated before validation; reaching here with one is a bug or a
        # file from a newer trainer.
        if value != CURRENT_VERSION:
            raise ValueError(f"must be {CURRENT_VERSION} after migration (got {value})")
        return value

    @field_validator("train_device", "temp_device")
    @classmethod
    def _valid_device(cls, value: str) -> str:
        if value == "auto":
            return value
        if "torch" not in sys.modules:  # the GUI and config checks run without torch (issue 30, defect 11)
            kind, _, index = value.partition(":")
            if kind in TORCH_DEVICE_TYPES and (not index or index.isdigit()):
                return value
            raise ValueError(f"{value!r} is not a torch device (cpu, cuda, cuda:1, ...)")
        import torch

        try:
            torch.device(value)
        except (RuntimeError, ValueError):
            raise ValueError(f"{value!r} is not a torch device (cpu, cuda, cuda:1, ...)") from None
        return value
