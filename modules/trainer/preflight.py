"""Preflight: every problem of a run that shows before its model loads, from the config alone,
reported together, each naming its dotted config field.

A run that would fail only after minutes of loading (or, worse, at its final save) fails here in
a second instead: an output path that is a folder or on a read-only disk, a workspace that cannot
be written or cannot hold the planned backups, a train device this torch does not have, a model
folder of another family than `model.family`, damaged weight files, captions that are not UTF-8,
dtypes and weight modes that do not run here, sample prompts of more or fewer images than the model
takes (the count its config files fix where they do: Wan 2.1 FLF2V's two), a run whose planned peak is
over the train device's free memory (fit_check.py: the plan of modules/plan/, where the device says what is free), video
concepts whose new latent cache entries the cache folder's disk cannot hold (video_preflight.py, whose
estimate of clips, windows, decode time and cache size the run also says). Nothing is written (a write
test creates and removes one temp file); nothing is loaded but file headers, JSON and the first one or
two video windows the estimate times.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

from modules.config.errors import ConfigError
from modules.config.method_configs import METHODS
from modules.config.train_config import TrainConfig
from modules.errors import UserError


class PreflightError(ConfigError):
    """Problems that keep a run from starting; `problems` holds one line per problem. A ConfigError
    (a config that cannot be used, here), with its own heading."""

    def __init__(self, problems: list[str]):
        self.problems, self.source = problems, None
        # one problem reads as itself ("output.path: ..."), as every other user error does
        UserError.__init__(self, problems[0] if len(problems) == 1 else
                           f"the run cannot start ({len(problems)} problems):\n" + "\n".join(f"  {p}" for p in problems))


def run_preflight(config: TrainConfig, say=None, plan: dict | None = None) -> dict | None:
    """Raise on the config's problems; `say(line)` is given what the preflight found out on the way
    (the video concepts' decode and cache estimate). `plan`: the run's plan where one was made already
    (planned_autos.py), for the fit check. Returns the plan the fit check read (None: not planned)."""
    notes: list[str] = []
    made: dict = {"plan": plan}
    problems = _collect(config, notes, made)
    for note in notes if say else ():
        say(note)
    if len(problems) == 1 and isinstance(problems[0], UserError):
        raise problems[0]  # one problem keeps its own class (DataError, ModelLoadError, ...)
    if problems:
        raise PreflightError([str(problem) for problem in problems])
    return made["plan"]


def preflight_problems(config: TrainConfig, notes: list[str] | None = None) -> list[str]:
    """One line per problem, each starting with the dotted field it is about (`notes` gets the
    estimates said on the way)."""
    return [str(problem) for problem in _collect(config, notes)]


def _collect(config: TrainConfig, notes: list[str] | None = None, made: dict | None = None) -> list[str | UserError]:
    """Each problem as its line, or as the error a check raised (which names its field). `made`:
    {"plan": the run's plan or None}, a plan given is read and one made is put there."""
    made = {"plan": None} if made is None else made
    device_problems, device = _device_problems(config)
    place_problems = _output_problems(config) + _folder_problems(config)
    model_problems, family = _model_problems(config)
    caption_problems, images_per_epoch, captions = _concept_problems(config)
    problems = (device_problems + place_problems + model_problems + _init_from_problems(config, family) + caption_problems
                + _loss_problems(config) + _frame_problems(config) + _control_problems(config, family))
    if config.embeddings:
        from modules.methods.embedding_files import embedding_problems

        problems += embedding_problems(config.embeddings, captions)
    if device is not None:
        dtype_problems = _dtype_problems(config, device)
        problems += dtype_problems
        if family is not None and not dtype_problems:  # a config that loads: does it fit its device?
            from modules.trainer.fit_check import fit_plan, fit_problem

            if made["plan"] is None:
                made["plan"] = fit_plan(config, device)
            problem = fit_problem(config, device, made["plan"]) if made["plan"] is not None else None
            if problem:
                problems.append(problem)
    if family is not None:  # the estimate reads the model's headers; places already refused are not sized
        from modules.trainer.video_preflight import estimate_video_cache

        video = estimate_video_cache(config, family) if not caption_problems else None
        if video is not None and notes is not None:
            notes.append(video.summary())
        refused = {str(problem).split(":")[0] for problem in place_problems}
        problems += _disk_space_problems(config, family, images_per_epoch, refused, video)
    return problems


def _frame_problems(config: TrainConfig) -> list[str]:
    """Frame counts (video concepts, sample prompts) the family cannot take: a still-image family, or
    not 1 + n x its VAE's temporal step (modules/data/video.py)."""
    from modules.config.families import get_family_class
    from modules.data.video import frame_count_problem

    family = get_family_class(config.model.family)
    asked = [(f"concepts[{i}].video.frames", c.video.frames) for i, c in enumerate(config.concepts) if c.enabled]
    asked += [(f"sampling.prompts[{i}].frames", p.frames) for i, p in enumerate(config.sampling.prompts) if p.enabled]
    problems = [(where, frame_count_problem(frames, family.temporal_quantum, family.label)) for where, frames in asked]
    problems = [f"{where}: {problem}" for where, problem in problems if problem]
    if config.model.image_to_video and not family.image_to_video:
        problems.append(f"model.image_to_video: {family.label} has no image-to-video training (Wan 2.2 TI2V has)")
    return problems


# --- devices -----------------------------------------------------------------------------------

def device_problems(config: TrainConfig) -> list[str]:
    """train_device and temp_device take a tensor here (for `cache`, which runs no full preflight)."""
    return _device_problems(config)[0]


def _device_problems(config: TrainConfig) -> tuple[list[str], torch.device | None]:
    """Each device must take a tensor: the one test that works for every backend (cuda, mps, xpu,
    a privateuse1 device) without naming any."""
    from modules.util.torch_utils import resolve_device

    problems, train_device = [], None
    for field in ("train_device", "temp_device"):
        name = getattr(config, field)
        device = resolve_device(name)
        try:
            torch.empty(1, device=device)
        except (RuntimeError, AssertionError, ValueError) as error:
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            hint = ""
            if device.type == "cuda" and torch.version.cuda is None:
                hint = (f"; this torch ({torch.__version__}) is built without CUDA: install a CUDA build of torch, "
                        "or set it to cpu or auto")
            problems.append(f"{field}: {name!r} is not available here ({reason}){hint}")
            continue
        if field == "train_device":
            train_device = device
    return problems, train_device


def _dtype_problems(config: TrainConfig, device: torch.device) -> list[str]:
    """The dense dtypes the config computes in, and the weight modes it stores parts in, run on
    the train device (the same probes `launch.py info` reports)."""
    from modules.quantization.capabilities import _dense_dtype_works, detect_capabilities
    from modules.quantization.policy import plan_base_precision
    from modules.quantization.weight_modes import DENSE_DTYPES, DENSE_MODE_NAMES

    dense_fields: dict[str, list[str]] = {}
    for name, part in config.model.parts.items():
        if part.weight_dtype in DENSE_MODE_NAMES:
            dense_fields.setdefault(part.weight_dtype, []).append(f"model.parts.{name}.weight_dtype")
    dense_fields.setdefault(config.train_dtype, []).append("train_dtype")
    dense_fields.setdefault(config.adapter.dtype, []).append("adapter.dtype")
    problems = [f"{field}: {dtype} does not run on {device} here"
                for dtype, fields in dense_fields.items() if dtype != "float32"
                and not _dense_dtype_works(DENSE_DTYPES[dtype], device) for field in fields]
    quantized = {name: part.weight_dtype for name, part in config.model.parts.items()
                 if part.weight_dtype not in DENSE_MODE_NAMES and part.weight_dtype != "auto"}
    if quantized:  # the probes import torchao and bitsandbytes: only when a quantized mode is asked for
        try:
            plan_base_precision(quantized, config.model.family, {}, None, detect_capabilities(device))
        except ValueError as error:
            problems += str(error).splitlines()
    return problems


# --- places that will be written ---------------------------------------------------------------

def nearest_existing(path: Path) -> Path:
    """`path`, or the closest of its parents that exists (where the missing folders will be made)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _write_problem(field: str, folder: Path) -> str | None:
    """Can files be created in `folder` (or, where it does not exist yet, be made under its parent)?
    Tried for real with a temp file: permission bits say nothing for root, and a read-only mount
    or a full quota shows only when writing."""
    existing = nearest_existing(folder)
    if not existing.is_dir():
        return f"{field}: {existing} is a file, so the folder {folder} cannot be made"
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        return f"{field}: cannot write in {existing} ({error.strerror or error})"
    return None


def _output_problems(config: TrainConfig) -> list[str]:
    from modules.saving.output_target import output_file_problem

    # empty output.path: the workspace's own default file (config.output_path)
    problem = output_file_problem(config.output_path, config.output.path)
    if problem is None:
        problem = _write_problem("output.path", config.output_path.parent)
    return [problem] if problem else []


def workspace_problem(config: TrainConfig) -> str | None:
    """An empty workspace_dir would be the current folder: a run started from a checkout would
    write its cache, backups and lock into the project."""
    if not config.workspace_dir.strip():
        return (f"workspace_dir: empty, which would put the run's files in the current folder ({Path.cwd()}); "
                "name a folder for this run, e.g. workspace/my-run")
    return None


def _folder_problems(config: TrainConfig) -> list[str]:
    problem = workspace_problem(config)
    problems = [problem] if problem else []
    folders = [] if problem else [("workspace_dir", Path(config.workspace_dir))]
    if config.cache_dir:
        folders.append(("cache_dir", Path(config.cache_dir)))
    for field, folder in folders:
        if folder.exists() and not folder.is_dir():
            problems.append(f"{field}: {folder} is a file, not a folder")
            continue
        problem = _write_problem(field, folder)
        if problem:
            problems.append(problem)
    return problems


# --- the model ---------------------------------------------------------------------------------

def _model_problems(config: TrainConfig):
    """(problems, the family object when its files can be read further)."""
    from modules.model.detect import family_mismatch
    from modules.config.families import get_family_class

    family_class = get_family_class(config.model.family)
    base = config.model.base
    if base:
        path = Path(base)
        if not path.exists():
            return [f"model.base: {base} is not a folder (a diffusers model) or a .safetensors file: it does not exist"], None
        mismatch = family_mismatch(path, config.model.family)
        if mismatch:
            return [mismatch], None
    family = family_class(config)
    problems = []
    for spec in family.part_specs:
        try:
            _check_weight_files(family, spec.name)
        except UserError as error:
            # parts read from one single file fail its checks alike: that file's problem, once
            if str(error) not in map(str, problems):
                problems.append(error)
    return problems, (family if not problems else None)


def _init_from_problems(config: TrainConfig, family) -> list[str]:
    """adapter.init_from is read only after the model has loaded: a missing file, a pickle's
    suffix or a file of another model family (where the model's files are sound: `family`) is
    told here, before that."""
    from modules.adapters.formats.files import AdapterFileError, check_adapter_file
    from modules.trainer.init_from_family import init_from_family_problem

    if not config.adapter.init_from or not METHODS.traits(config.method.type).uses_adapter:
        return []
    try:
        check_adapter_file(config.adapter.init_from)
    except AdapterFileError as error:
        return [str(error)]
    problem = init_from_family_problem(config) if family is not None else None
    return [problem] if problem else []


def _check_weight_files(family, part: str) -> None:
    """The part's folder and weight files are there and their safetensors headers are whole
    (a truncated download is named here, not halfway through the load)."""
    from modules.loading.diffusers_folder import ModelLoadError
    from modules.loading.safetensors_stream import SafetensorsError, SafetensorsStream
    from modules.loading.streamed_load import checkpoint_files

    if family.from_single_file(part):
        family.single_file_stream(part)  # opens the file and checks its header and which parts it holds
        return
    where = f"model.parts.{part}"
    for path in checkpoint_files(family.part_folder(part), where):
        if path.suffix == ".safetensors":
            try:
                SafetensorsStream(path)
            except SafetensorsError as error:
                raise ModelLoadError(f"{where}: {error}") from None


def _loss_problems(config: TrainConfig) -> list[str]:
    from modules.config.families import get_family_class
    from modules.trainer.loss import snr_weighting_requested

    weighting = snr_weighting_requested(config.loss)
    if weighting and get_family_class(config.model.family).flow_matching:
        return [f"{weighting}: SNR weighting is for epsilon and v-prediction models; "
                f"{config.model.family} trains with flow matching"]
    return []


def _control_problems(config: TrainConfig, family=None) -> list[str | UserError]:
    """Control images where the family takes none (or more than it takes), and sample prompts'
    control images that are not there. `family` (its files readable): the model's own count of prompt
    images where its config files say one (Wan 2.1 FLF2V: two, first and last frame; its I2V: one),
    else the declaration's range."""
    from modules.config.families import get_family_declaration
    from modules.config.prompt_control_images import prompt_control_problems
    from modules.data.concepts import DataError
    from modules.data.pairs import check_controls

    declaration = get_family_declaration(config.model.family)
    problems: list[str | UserError] = []
    try:
        check_controls(config, declaration, [(i, c) for i, c in enumerate(config.concepts) if c.enabled])
    except DataError as error:
        problems.append(error)
    try:
        exact = family.exact_prompt_images() if family is not None else None
    except (OSError, ValueError):  # a config file that does not read: the load names it
        exact = None
    problems += prompt_control_problems(config.sampling.prompts, declaration, exact)
    return problems


# --- the data ----------------------------------------------------------------------------------

def _concept_problems(config: TrainConfig) -> tuple[list[UserError], int, list[str]]:
    """Each enabled concept scanned as training will scan it (captions read and decoded);
    also how many images an epoch trains, for the disk estimate, and the captions it trains on
    (with their prefix and suffix)."""
    from modules.data.concepts import DataError, check_concepts, scan_concept
    from modules.data.pairs import scan_items
    from modules.data.video import is_video_concept, scan_options

    try:
        check_concepts(config.concepts)
    except DataError as error:
        return [error], 0, []
    problems, images, captions = [], 0, []
    for index, concept in enumerate(config.concepts):
        if not concept.enabled:
            continue
        try:  # (scanned as the dataset scans it: a video concept's clips count)
            items = scan_concept(index, concept, _ignore, **scan_options(concept)) if is_video_concept(concept) \
                else scan_items(index, concept, _ignore)
        except DataError as error:
            problems.append(error)
            continue
        if not items:  # found here, not after the model's load and the caching of the other concepts
            problems.append(_no_image_problem(index, concept))
            continue
        if not concept.validation:
            images += concept.samples_per_epoch or len(items) * concept.repeats
            captions += [concept.captions.prefix + item.caption + concept.captions.suffix for item in items]
    return problems, images, captions


def _no_image_problem(index: int, concept) -> str:
    from modules.data.concepts import IMAGE_SUFFIXES

    folder = Path(concept.path)
    line = (f"concepts[{index}].path: no image in {folder} (training reads "
            f"{', '.join(sorted(IMAGE_SUFFIXES))}, each with its caption in a .txt of the same name)")
    if not concept.include_subfolders and any(
            p.suffix.lower() in IMAGE_SUFFIXES for p in folder.glob("*/**/*") if p.is_file()):
        line += f"; its subfolders hold images: set concepts[{index}].include_subfolders to true to read them"
    return line


def _ignore(_message: str) -> None:
    """Warnings of the scan (captionless images) are given again when training scans."""


# --- disk space --------------------------------------------------------------------------------

def _disk_space_problems(config: TrainConfig, family, images_per_epoch: int, refused: set[str],
                         video=None) -> list[str]:
    """Each disk must hold what the run writes there: backups and saves, the output file, and a
    video concept's new latent cache entries (`video`: video_preflight.py's estimate)."""
    from modules.methods.base import method_class
    from modules.trainer.backup_size import describe, planned_bytes, planned_steps

    needs = []
    if video is not None and video.cache_bytes:
        needs.append((video.cache_field, video.cache_dir, video.cache_bytes,
                      f"the latent cache of {video.windows - video.cached} new video window(s)"))
    size = method_class(config.method.type).planned_size(config, family)
    if size is not None:  # None: pickled weights, no header to size the trained weights from
        planned = planned_bytes(config, size, planned_steps(config, images_per_epoch))
        workspace_need = planned.backups + planned.saves
        workspace_detail = f"{planned.backup_count} backup(s) of ~{describe(planned.backups / planned.backup_count)}"
        if planned.save_count:
            workspace_detail += f", {planned.save_count} save(s) of ~{describe(planned.saves / planned.save_count)}"
        needs += [("workspace_dir", Path(config.workspace_dir), workspace_need, workspace_detail),
                  ("output.path", config.output_path.parent, planned.output, "the output file")]
    by_disk: dict[int, list] = {}
    for field, folder, need, detail in needs:
        if field in refused:
            continue
        existing = nearest_existing(folder)
        by_disk.setdefault(os.stat(existing).st_dev, []).append((field, existing, need, detail))
    problems = []
    for entries in by_disk.values():
        free = shutil.disk_usage(entries[0][1]).free
        need = sum(entry[2] for entry in entries)
        if need > free:
            fields = " and ".join(dict.fromkeys(entry[0] for entry in entries))
            details = "; ".join(entry[3] for entry in entries)
            problems.append(f"{fields}: not enough free disk space in {entries[0][1]}: {describe(free)} free, the run "
                            f"writes about {describe(need)} ({details}); free some space, lower "
                            f"backup.rolling_count{_video_hint(entries)}, or choose a folder on another disk")
    return problems



def _video_hint(entries) -> str:
    if any(detail.startswith("the latent cache") for *_, detail in entries):
        return ", the video windows (concepts[i].video.windows or .frames, data.resolution)"
    return ""
