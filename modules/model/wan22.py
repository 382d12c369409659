"""Wan 2.2 A14B text-to-video (Wan-AI/Wan2.2-T2V-A14B-Diffusers): Wan 2.1's UMT5 encoder and VAE with
two 14B WanTransformer3DModels of Wan 2.1 14B's shape, the high-noise expert (`transformer`) and the
low-noise expert (`transformer_2`). WanPipeline (diffusers 0.42) runs `transformer` for the scheduler's
timesteps t >= boundary_ratio x num_train_timesteps and `transformer_2` below (boundary_ratio from
model_index.json: 0.875 in the released folder). Training follows that split on the same timesteps
(sigma x 1000 after the scheduler's flow_shift, as the pipeline's scheduler sees them):

- the sigmas are drawn only in the trained experts' range: the training-time distribution
  (loss.timesteps) squeezed into it in the unshifted draw, then shifted, so a low-noise run
  draws sigma < boundary and a high-noise run sigma >= boundary;
- with both experts trained each sample goes to the expert that owns its timestep (per sample,
  not per step: a batch whose samples straddle the boundary runs each expert on its own samples,
  so every sample is denoised by the expert the pipeline would use for it);
- an expert that does not train is never run in a step: it rests on the temp device and is
  streamed onto the train device only while samples are made (`resting_parts`), and the planner
  counts it there (modules/plan/run_plan.py);
- each trained expert's adapter is saved to a file of its own, `<stem>-high_noise.safetensors` and
  `<stem>-low_noise.safetensors`, written under a lone Wan transformer's names (ComfyUI and
  musubi-tuner load one LoRA per expert model; diffusers loads the low-noise file with
  `load_lora_weights(..., load_into_transformer_2=True)`). A backup holds both (the low-noise
  expert's adapters by the prefix `lora_unet2_`).

Single files as ComfyUI ships them (wan2.2_t2v_high_noise_14B_*.safetensors and ..._low_noise_...: each
expert a Wan 2.1 14B transformer file, bare or under `model.diffusion_model.`): model.base is the
high-noise expert's file and `model.parts.transformer_2.path` the low-noise expert's (UMT5 and VAE from
`model.parts.<part>.path` as for Wan 2.1); each is converted as wan_single_file.py converts a Wan 2.1
file and built from the released config of its expert (resources/model_configs/<family>/transformer*/,
by the header's width, blocks and input channels), and the boundary ratio and scheduler come from
that config folder. A base file with no low-noise path, or an expert's file of another shape, is
named before any weight loads.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from modules.config.families.wan22 import DECLARATION
from modules.model.keys.wan22 import WAN22_KEYS
from modules.model.wan import WanFamily

HIGH_NOISE, LOW_NOISE = "transformer", "transformer_2"
EXPERTS = (HIGH_NOISE, LOW_NOISE)
# the suffix of each expert's saved adapter file after the output's stem
EXPERT_FILE_SUFFIXES = {HIGH_NOISE: "-high_noise", LOW_NOISE: "-low_noise"}


def unshifted(sigma: float, shift: float) -> float:
    """The draw in (0, 1) that the flow shift sigma = s*u / (1 + (s - 1)*u) maps onto `sigma`."""
    return sigma / (shift - (shift - 1) * sigma)


def _holds_names_with(path: Path, prefix: str) -> bool:
    """Whether an adapter file has a key under `prefix` (the low-noise expert's own, `lora_unet2_`, as a
    backup holds its adapters), read from a safetensors header; other files are taken as one expert's."""
    from modules.loading.safetensors_stream import SafetensorsError, SafetensorsStream

    if path.suffix != ".safetensors" or not path.is_file():
        return False
    try:
        return any(key.startswith(prefix) for key in SafetensorsStream(path).keys())
    except (SafetensorsError, OSError):  # the loader names an unreadable file
        return False


class Wan22Family(WanFamily):
    declaration = DECLARATION  # name, label, parts, layer presets: modules/config/families/wan22.py
    pipeline_classes = ("WanPipeline",)
    single_file_signature = None  # a Wan single file is a Wan 2.1 transformer (family `wan`)
    single_file_part_signatures = {}
    single_files_of = ("wan",)  # each expert's file is a Wan 2.1 14B transformer file (detected as `wan`)
    transformer_parts = EXPERTS
    low_noise_file_example = "wan2.2_t2v_low_noise_14B_fp16.safetensors"
    kohya_base_version = "wan_2.2_t2v_a14b"
    modelspec_architecture = "wan-2.2-t2v-a14b/lora"
    key_layout = WAN22_KEYS
    # two experts of Wan 2.1 14B's shape (resources/model_configs/wan22/, counted on the meta device)
    nominal_part_parameters = {"text_encoder": 5_680_910_336, "transformer": 14_288_491_584,
                               "transformer_2": 14_288_491_584, "vae": 126_892_531}

    def __init__(self, config, weight_modes=None):
        super().__init__(config, weight_modes)
        # the step's denoiser is the trained expert (the low-noise one when only it trains)
        self.denoiser_part = self.running_experts()[0]
        self.boundary_ratio: float | None = None
        self._experts_run: set[str] = set()  # the experts a predict has run so far

    @classmethod
    def claims_model_index(cls, index: dict) -> int:
        # a WanPipeline folder with a second transformer and the boundary between them
        second = index.get("transformer_2")
        two_experts = isinstance(second, list) and second[:1] != [None] and index.get("boundary_ratio") is not None
        return 2 if super().claims_model_index(index) and two_experts else 0

    # --- which expert does what ----------------------------------------------------------------

    def trained_experts(self) -> list[str]:
        parts = self.config.model.parts
        return [e for e in EXPERTS if e in parts and parts[e].train]

    def running_experts(self) -> list[str]:
        """The experts a training step runs: the trained ones (both when neither trains, as a run
        that trains only the text encoder still sees every timestep)."""
        return self.trained_experts() or list(EXPERTS)

    def resting_parts(self) -> tuple[str, ...]:
        return tuple(e for e in EXPERTS if e not in self.running_experts())

    def trained_parts_not_run(self) -> set[str]:
        return set(self.trained_experts()) - self._experts_run

    @classmethod
    def adapter_files(cls, trained_parts: list[str]) -> list[tuple[str, dict[str, str]]]:
        experts = [e for e in EXPERTS if e in trained_parts]
        if not experts:
            return super().adapter_files(trained_parts)
        others = {p: p for p in trained_parts if p not in EXPERTS}  # the text encoder's: in the first file
        return [(EXPERT_FILE_SUFFIXES[e], {e: HIGH_NOISE, **(others if i == 0 else {})})
                for i, e in enumerate(experts)]

    @classmethod
    def init_from_files(cls, path: Path, trained_parts: list[str]) -> list[tuple[Path, dict[str, str]]] | None:
        """A start file written for one expert (a lone Wan transformer's adapter: this family's saved
        `-high_noise` / `-low_noise` files, or a Wan 2.1 LoRA) starts the trained experts: the one
        trained expert whichever expert it was written for; with both trained, a file named for one
        expert starts that one, and its sibling file (the other suffix, beside it) the other, where it
        exists; a file named for neither starts both. The text encoder's adapters are in the first
        file, as adapter_files writes them. A file with the low-noise expert's own keys (`lora_unet2_`,
        a backup's layout) holds the run's adapters as they are (None)."""
        experts = [e for e in EXPERTS if e in trained_parts]
        if not experts or _holds_names_with(path, f"{cls.spec(LOW_NOISE).adapter_prefix}_"):
            return None
        named = next((e for e, suffix in EXPERT_FILE_SUFFIXES.items() if path.stem.endswith(suffix)), None)
        if len(experts) == 1:
            files = [(path, experts[0])]
        elif named is None:
            files = [(path, expert) for expert in EXPERTS]
        else:
            stem = path.stem[: -len(EXPERT_FILE_SUFFIXES[named])]
            siblings = [(path.with_name(f"{stem}{EXPERT_FILE_SUFFIXES[e]}{path.suffix}"), e) for e in EXPERTS]
            files = [(file, e) for file, e in siblings if file == path or file.is_file()]
        others = {p: p for p in trained_parts if p not in EXPERTS}
        return [(file, {expert: HIGH_NOISE, **(others if i == 0 else {})}) for i, (file, expert) in enumerate(files)]

    def diffusers_load_options(self, suffix: str) -> dict:
        return {"load_into_transformer_2": True} if suffix == EXPERT_FILE_SUFFIXES[LOW_NOISE] else {}

    # --- loading -----------------------------------------------------------------------------

    def load(self) -> None:
        from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
        from transformers import AutoTokenizer, UMT5EncoderModel

        if self.single_file is not None:
            self.single_file_stream()  # which parts the files hold, and the experts' shapes, before any weight
        self.parts["text_encoder"] = self.load_part("text_encoder", UMT5EncoderModel)
        for expert in EXPERTS:
            self.parts[expert] = self.load_part(expert, WanTransformer3DModel)
        self.parts["vae"] = self.load_part("vae", AutoencoderKLWan)
        self.boundary_ratio = self._boundary_ratio()
        self.noise_scheduler = UniPCMultistepScheduler.from_pretrained(
            str(self.support_folder("scheduler")), local_files_only=True)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.support_folder("tokenizer")), local_files_only=True)

    def single_file_part(self, part: str):
        from modules.model import wan_single_file

        return wan_single_file.single_file_part(HIGH_NOISE if part in EXPERTS else part)

    def _check_single_file_parts(self) -> None:
        # model.base holds one expert (the high-noise one); the low-noise expert has its own file
        from modules.loading.diffusers_folder import ModelLoadError

        if not self.config.model.parts[LOW_NOISE].path:
            raise ModelLoadError(
                f"model.parts.{LOW_NOISE}.path: model.base {self.single_file.name} is one expert's file (the "
                f"high-noise one's); name the low-noise expert's file here (ComfyUI's "
                f"{self.low_noise_file_example}) or a diffusers {LOW_NOISE}/ folder")
        super()._check_single_file_parts()  # then each expert's shape (WanFamily)

    def _boundary_ratio(self) -> float:
        from modules.loading.diffusers_folder import ModelLoadError

        index_path = (self.model_config_folder() if self.single_file is not None
                      else Path(self.config.model.base)) / "model_index.json"
        try:
            ratio = json.loads(index_path.read_text(encoding="utf-8")).get("boundary_ratio")
        except (OSError, ValueError) as error:
            raise ModelLoadError(f"model.base: {index_path} cannot be read ({error}); {self.label} needs its "
                                 "boundary_ratio (where the high-noise expert hands over)") from None
        if not isinstance(ratio, (int, float)) or not 0 < ratio < 1:
            raise ModelLoadError(f"model.base: {index_path} has boundary_ratio {ratio!r}, not a number in (0, 1): "
                                 f"not a {self.label} folder (a Wan 2.1 folder is model.family 'wan')")
        return float(ratio)

    def checkpoint_blocks(self, part: str) -> list[torch.nn.Module]:
        if part in EXPERTS:
            return list(self.parts[part].blocks)
        return super().checkpoint_blocks(part)

    # --- training ----------------------------------------------------------------------------

    @property
    def boundary_timestep(self) -> float:
        return self.boundary_ratio * self.noise_scheduler.config.num_train_timesteps

    def expert_range(self) -> tuple[float, float]:
        """The sigmas (lowest, highest) the running experts own: the high-noise expert [boundary, 1],
        the low-noise one [0, boundary)."""
        running = self.running_experts()
        return (self.boundary_ratio if LOW_NOISE not in running else 0.0,
                self.boundary_ratio if HIGH_NOISE not in running else 1.0)

    def sample_sigmas(self, batch: int, sequence_length: int, generator: torch.Generator) -> torch.Tensor:
        shift = self.config.loss.flow_shift or self.noise_scheduler.config.get("flow_shift", 1.0)
        low, high = self.expert_range()
        u_low, u_high = unshifted(low, shift), unshifted(high, shift)
        unit = u_low + (u_high - u_low) * self.training_times(batch, generator)
        sigmas = shift * unit / (1 + (shift - 1) * unit)
        if high < 1.0:  # below the boundary in the timesteps the transformer sees, float rounding too
            sigmas = sigmas.float().clamp(max=self._highest_low_noise_sigma())
        return sigmas

    def _highest_low_noise_sigma(self) -> float:
        """The largest float32 sigma whose timestep (sigma x num_train_timesteps, in float32 as
        run_transformer computes it) is below the boundary."""
        import numpy as np

        total = np.float32(self.noise_scheduler.config.num_train_timesteps)
        sigma = np.float32(self.boundary_ratio)
        while sigma * total >= np.float32(self.boundary_timestep):
            sigma = np.nextafter(sigma, np.float32(0))
        return float(sigma)

    def expert_of(self, sigmas: torch.Tensor) -> torch.Tensor:
        """True where a sample's timestep is the high-noise expert's (t >= boundary, as WanPipeline)."""
        return sigmas.float() * self.noise_scheduler.config.num_train_timesteps >= self.boundary_timestep

    def denoise(self, noisy: torch.Tensor, sigmas: torch.Tensor, text: dict[str, torch.Tensor]) -> torch.Tensor:
        from modules.util.torch_utils import shape_only

        running = self.running_experts()
        if len(running) == 1 or shape_only(sigmas):
            # one expert trains (its range is all that is drawn); or the planner's step (fake or meta
            # tensors), whose sigmas hold no values: one expert's pass over the batch is what a step
            # holds at most
            self._experts_run.add(running[0])
            return self.run_transformer(running[0], noisy, sigmas, text)
        high = self.expert_of(sigmas).to(noisy.device)
        owners = {HIGH_NOISE: high, LOW_NOISE: ~high}
        present = [e for e in EXPERTS if bool(owners[e].any())]
        self._experts_run.update(present)
        if len(present) == 1:
            return self.run_transformer(present[0], noisy, sigmas, text)
        out = None
        for expert in present:  # each sample denoised by the expert that owns its timestep
            rows = owners[expert]
            part = self.run_transformer(expert, noisy[rows], sigmas[rows.to(sigmas.device)],
                                        {k: v[rows.to(v.device)] for k, v in text.items()})
            if out is None:
                out = part.new_zeros((noisy.shape[0], *part.shape[1:]))
            out = out.index_put((rows.nonzero().squeeze(1),), part)
        return out

    # --- sampling ----------------------------------------------------------------------------

    def pipeline(self):
        from diffusers import UniPCMultistepScheduler, WanPipeline

        pipe = WanPipeline(tokenizer=self.tokenizer, text_encoder=self.parts["text_encoder"], vae=self.parts["vae"],
                           scheduler=UniPCMultistepScheduler.from_config(self.noise_scheduler.config),
                           transformer=self.parts[HIGH_NOISE], transformer_2=self.parts[LOW_NOISE],
                           boundary_ratio=self.boundary_ratio)
        pipe.set_progress_bar_config(disable=True)
        return pipe
