"""How a family's parts are found and read: diffusers folders, original-layout single files,
support folders (tokenizer/, scheduler/), weight modes and compute dtypes, and the streamed,
quantizing load of one part. ModelFamily mixes this in; a family file calls `load_part`."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from modules.loading.diffusers_folder import (
    ModelLoadError,
    component_folder,
    weights_fingerprint,
)
from modules.quantization.half_storage import part_compute_dtype
from modules.quantization.skip_rules import FAMILY_SKIP_ATTRIBUTE
from modules.util.torch_utils import dtype_of


class PartLoading:
    """The loading part of ModelFamily (it reads `config`, `part_specs`, `spec`, `name`, `label`,
    `nominal_part_parameters` and `quantize_skip_patterns` from the family)."""

    released_configs_of: str | None = None  # a family whose released part configs are this one's too

    # parts built from their config on the meta device, no weight read: the parts a job never runs
    # (the denoiser while `launch.py cache` encodes), so load() still runs unchanged and code that
    # reads such a part's `.config` keeps working, while a 24 GB transformer costs nothing
    skeleton_parts: frozenset[str] = frozenset()
    # the accelerator quantized layers are quantized on at load (the trainer sets its train device
    # when that is not the CPU); None: on the CPU, where the layers are stored
    quantize_device: torch.device | None = None

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

    def part_file(self, part: str) -> Path | None:
        """The single file `part` is read from: its own `path` when that is a file (a VAE or text
        encoder shipped alone, as ComfyUI ships them), else the base file when the part has no path;
        None: a diffusers folder."""
        from modules.loading.single_file import is_single_file

        own = self.config.model.parts[part].path
        if own:
            return Path(own) if is_single_file(own) else None
        return self.single_file

    def from_single_file(self, part: str) -> bool:
        return self.part_file(part) is not None

    def model_config_folder(self) -> Path:
        """The diffusers-layout configs (and tokenizers/scheduler where shipped) a single file's
        parts are built from: resources/model_configs/<family>/ unless model_configs_dir says."""
        if self.model_configs_dir is not None:
            return Path(self.model_configs_dir)
        return self.released_config_folder()

    @classmethod
    def released_config_folder(cls) -> Path:
        """The configs of the family's released model (no weights): resources/model_configs/<family>/,
        or those of the family whose parts it shares (`released_configs_of`)."""
        return Path(__file__).resolve().parents[2] / "resources" / "model_configs" / (cls.released_configs_of or cls.name)

    def single_file_stream(self, part: str | None = None):
        """The open base file; with `part`, the file that part is read from (its own or the base)."""
        from modules.loading.single_file import open_single_file

        if part is not None and self.part_file(part) != self.single_file:
            return self._own_part_stream(part)
        if self._single_file_stream is None:
            self._single_file_stream = open_single_file(self.single_file)
            try:
                self._check_single_file_parts()
            except ModelLoadError:  # checked again on the next open, not taken as passed
                self._single_file_stream = None
                raise
        return self._single_file_stream

    def _own_part_stream(self, part: str):
        """A part's own single file, opened once, checked to hold that part's weights."""
        from modules.loading.single_file import open_single_file, part_keys

        streams = self.__dict__.setdefault("_part_streams", {})
        if part not in streams:
            where, path = f"model.parts.{part}.path", self.part_file(part)
            stream = open_single_file(path, where)
            layout = self.single_file_part(part)
            if layout is None:
                raise ModelLoadError(f"{where}: {path.name} is a file; {self.label} reads its {part} from a "
                                     f"diffusers {self.spec(part).subfolder}/ folder only")
            if not part_keys(stream, layout):
                raise ModelLoadError(f"{where}: {path.name} holds no {part} weights (its keys are not a {self.label} "
                                     f"{part}'s); name the {part}'s single file or its diffusers folder here")
            self.check_part_file(part, stream, where)
            streams[part] = stream
        return streams[part]

    def _check_single_file_parts(self) -> None:
        """Before any weights load: every part the file lacks must have its own `path`."""
        from modules.loading.single_file import part_keys

        stream, missing = self._single_file_stream, []
        if not any(self.single_file_part(spec.name) for spec in self.part_specs):
            raise ModelLoadError(f"model.base: {stream.path.name} is a file; {self.label} loads from a "
                                 "diffusers folder only")
        for spec in self.part_specs:
            layout = self.single_file_part(spec.name)
            from_base = not self.config.model.parts[spec.name].path
            if from_base and (layout is None or not part_keys(stream, layout)):
                missing.append(f"model.parts.{spec.name}.path: {stream.path.name} holds no {spec.name} weights; "
                               f"name a diffusers {spec.subfolder}/ folder (config.json and weights)"
                               + (f" or a single {spec.name} file" if layout else "") + " here")
        if missing:
            raise ModelLoadError("; ".join(missing))
        for spec in self.part_specs:
            if not self.config.model.parts[spec.name].path:
                self.check_part_file(spec.name, stream, "model.base")

    def check_part_file(self, part: str, stream, where: str) -> None:
        """Before any weight loads: ModelLoadError at `where` when the single file `stream` (which holds
        `part`'s keys) holds a variant of the part the family's config does not build, as its header
        shows (Wan: a transformer of another size or kind, the other Wan VAE). Nothing by default."""

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
                counts[spec.name] = (part_parameter_count(self.single_file_stream(spec.name), layout) if layout
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
        its weights are quantized or stored in the other 16-bit float (half_storage.py); never read
        back from a parameter, which may be fp8 or uint8."""
        return part_compute_dtype(self.weight_mode(part), dtype_of(self.config.train_dtype))

    def load_part(self, part: str, cls: type, rename: Callable[[str], str] | None = None,
                  ignore_unexpected: list[str] | None = None) -> nn.Module:
        """Stream a part from its folder into `cls`, quantized as its weight mode says (a skeleton
        part: its architecture only, every tensor on the meta device: skeleton_build.py)."""
        from modules.loading.streamed_load import empty_model, load_streamed

        folder, where = self.part_folder(part), f"model.parts.{part}"
        if part in self.skeleton_parts:
            from modules.loading.skeleton_build import skeleton_model

            return skeleton_model(cls, folder, where)
        part_config = self.config.model.parts[part]
        model, sources = empty_model(cls, folder, where), None
        setattr(model, FAMILY_SKIP_ATTRIBUTE, self.quantize_skip_patterns.get(part, ()))
        if self.from_single_file(part):  # original-layout keys, converted to diffusers names
            from modules.loading.single_file import convert_part

            stream = self.single_file_stream(part)
            sources = [convert_part(stream, self.single_file_part(part), model, where)]
            folder = stream.path
        model, report = load_streamed(
            model, folder, part=part, where=where, mode=self.weight_mode(part),
            compute_dtype=self.compute_dtype(part), quantize_skip=part_config.quantize_skip,
            layer_options=part_config.layer_options(), rename=rename, ignore_unexpected=ignore_unexpected,
            sources=sources, quantize_device=self.quantize_device, quantized_home=self.quantized_home(part),
        )
        if report is not None:
            self.quantization_reports[part] = report
        return model

    def quantized_home(self, part: str) -> torch.device | None:
        """Where the part's quantized layers are stored once quantized on `quantize_device`: there,
        when the whole part will sit on it (offload_fraction 0); else on the temp device, where its
        parked blocks wait (the conductor brings the resident ones over), so the train device
        never holds more than its plan while loading. None: no quantize device, the CPU."""
        if self.quantize_device is None:
            return None
        if self.config.model.parts[part].offload_fraction == 0:
            return torch.device(self.quantize_device)
        return torch.device(self.config.temp_device)

    def fingerprint(self, *parts: str) -> str:
        """Identity of the named parts' weights and dtypes, for cache keys."""
        facts = []
        for part in parts:
            if self.from_single_file(part):
                file = self.part_file(part)
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
