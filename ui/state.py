"""The GUI's config: one JSON dict shaped like TrainConfig, edited by dotted path.

Every widget binds a Tk variable to a dotted path (`adapter.rank`, `model.parts.unet.weight_dtype`,
`concepts[0].path`) and owns that binding for its lifetime: the widget releases it when it is
destroyed, so rebuilding one section (the parts of a new family, a removed concept) never touches
another section's bindings. There is no unbind-by-prefix.

When the variable changes, its text is converted for the field's kind and
written into `data`, and the whole dict is validated by TrainConfig itself (the same validation
the CLI runs), so the GUI and `launch.py train` can never disagree on what is valid. Each problem
line (`path: message`) is shown on the field bound to that path; problems no field shows are
listed in the window's problem bar. Start is refused while `start_problems()` is not empty.

A value that does not convert (letters in a number) is written as the text the user typed, so
pydantic's message names it: `adapter.rank: must be a whole number (got 'abc')`.
"""

from __future__ import annotations

import copy
import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel, ValidationError

from modules.config.errors import ConfigError, format_validation_error
from modules.config.loading import (
    build_config,
    config_overlay,
    merge_layer,
    parse_dotted,
)
from modules.config.train_config import TrainConfig

KINDS = ("str", "optstr", "int", "optint", "float", "optfloat", "fraction", "intword", "bool", "boolword", "choice",
         "lines", "intlist")


def default_data(family: str = "sd15") -> dict:
    return build_config([{"model": {"family": family}}]).model_dump(mode="json")


def get_path(data: Any, path: str) -> Any:
    node = data
    for step in parse_dotted(path):
        node = node[step]
    return node


def set_path(data: Any, path: str, value: Any) -> None:
    """Write `value` at `path`; a missing key of an object on the way is created (the per-part
    overrides `adapter.parts.<part>.rank` start out as an empty dict)."""
    steps = parse_dotted(path)
    node = data
    for step in steps[:-1]:
        if isinstance(node, dict) and step not in node:
            node[step] = {}
        node = node[step]
    node[steps[-1]] = value


def to_value(kind: str, raw: Any) -> Any:
    """The variable's content -> the JSON value for the config (raw text where it does not convert)."""
    if kind == "bool":
        return bool(raw)
    text = raw if isinstance(raw, str) else str(raw)
    stripped = text.strip()
    if kind == "boolword":  # "true" / "false", or the word itself
        return {"true": True, "false": False}.get(stripped.lower(), stripped)
    if kind in ("str", "choice"):
        return text
    if kind == "optstr":
        return stripped or None
    if kind == "lines":
        return [line.strip() for line in text.splitlines() if line.strip()]
    if kind == "intlist":  # one number, or several separated by commas
        items = [item.strip() for item in stripped.split(",") if item.strip()]
        try:
            numbers = [int(item) for item in items]
        except ValueError:
            return text
        return numbers[0] if len(numbers) == 1 and "," not in stripped else numbers
    if kind.startswith("opt") and not stripped:
        return None
    try:
        if kind in ("int", "optint"):
            return int(stripped)
        if kind in ("float", "optfloat"):
            return float(stripped)
        if kind == "fraction":
            return "auto" if stripped.lower() == "auto" else float(stripped)
        if kind == "intword":
            return "auto" if stripped.lower() == "auto" else int(stripped)
    except ValueError:
        return text
    raise ValueError(f"unknown field kind {kind!r}")


def to_text(kind: str, value: Any) -> Any:
    """A config value -> what the variable shows."""
    if kind == "bool":
        return bool(value)
    if kind == "boolword" and isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return ""
    if kind == "lines":
        return "\n".join(value) if isinstance(value, list) else str(value)
    if kind == "intlist" and isinstance(value, list):
        return ", ".join(str(item) for item in value)
    if isinstance(value, float):
        return repr(value)
    return str(value)


def field_info(path: str):
    """The pydantic FieldInfo of a dotted path (list items and dict entries walked through), or None."""
    from typing import get_origin

    model: Any = TrainConfig
    info = None
    skip_key = False
    for step in parse_dotted(path):
        if isinstance(step, int):
            continue
        if skip_key:  # the key of a dict field (model.parts.<unet>)
            skip_key = False
            continue
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or step not in model.model_fields:
            return None
        info = model.model_fields[step]
        skip_key = get_origin(info.annotation) is dict
        model = _inner_model(info.annotation)
    return info


def _inner_model(annotation: Any):
    from typing import get_args

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _inner_model(arg)
        if found is not None:
            return found
    return None


def _family_mismatch(base: str, family: str) -> str | None:
    """detect.family_mismatch, read again only when the model's folder or file changes (each edit
    of any field validates the whole config)."""
    from modules.config.families import family_names

    if family not in family_names():
        return None  # the schema's own message names a bad family
    path = Path(base)
    try:
        stamp = path.stat().st_mtime_ns
    except OSError:
        return None
    return _cached_family_mismatch(str(path), family, stamp)


@functools.lru_cache(maxsize=32)
def _cached_family_mismatch(base: str, family: str, _stamp: int) -> str | None:
    from modules.model.detect import family_mismatch

    return family_mismatch(base, family)


def field_description(path: str) -> str | None:
    info = field_info(path)
    return info.description if info is not None else None


@dataclass
class Binding:
    path: str
    kind: str
    var: Any  # a Tk variable
    show_error: Callable[[str | None], None] | None = None
    trace: str | None = None
    extra: dict = field(default_factory=dict)


class ConfigState:
    def __init__(self, data: dict | None = None):
        self.data: dict = data if data is not None else default_data()
        self.config: TrainConfig | None = None
        self.problems: list[str] = []  # every problem line, validation and readiness
        self.errors: dict[str, str] = {}  # dotted path -> message
        self.bindings: list[Binding] = []
        self.machine_info: dict | None = None
        self.reload_listeners: list[Callable[[], None]] = []  # rebuild after data was replaced
        self.validate_listeners: list[Callable[[], None]] = []  # after each validation
        self.info_listeners: list[Callable[[], None]] = []  # machine info arrived
        self.set_hooks: dict[str, Callable[[Any], bool]] = {}  # path -> handles the change itself when True
        self._quiet = False
        self.validate()

    # --- binding -----------------------------------------------------------------------------

    def bind(self, path: str, kind: str, var, show_error: Callable[[str | None], None] | None = None) -> Binding:
        if kind not in KINDS:
            raise ValueError(f"unknown field kind {kind!r}")
        binding = Binding(path, kind, var, show_error)
        self._quiet = True
        try:
            var.set(to_text(kind, self._value(path)))
        finally:
            self._quiet = False
        binding.trace = var.trace_add("write", lambda *_: self._changed(binding))
        self.bindings.append(binding)
        if show_error:
            show_error(self.errors.get(path))
        return binding

    def release(self, binding: Binding) -> None:
        """Called by the widget that owns `binding` when it is destroyed: that binding only."""
        if binding in self.bindings:
            self.bindings.remove(binding)
        try:
            binding.var.trace_remove("write", binding.trace)
        except Exception:  # the variable or the interpreter is gone
            pass

    def binding(self, path: str) -> Binding | None:
        return next((b for b in self.bindings if b.path == path), None)

    def bound_paths(self) -> set[str]:
        return {b.path for b in self.bindings}

    def _value(self, path: str) -> Any:
        try:
            return get_path(self.data, path)
        except (KeyError, IndexError, TypeError, ConfigError):
            return None

    def _changed(self, binding: Binding) -> None:
        if self._quiet:
            return
        try:
            raw = binding.var.get()
        except Exception:  # a Tk variable that cannot read its text (e.g. IntVar with letters)
            raw = ""
        self.set(binding.path, to_value(binding.kind, raw), _from=binding)

    # --- editing ------------------------------------------------------------------------------

    def get(self, path: str) -> Any:
        return self._value(path)

    def set(self, path: str, value: Any, _from: Binding | None = None) -> None:
        hook = self.set_hooks.get(path)
        if hook is not None and hook(value):
            return  # the hook replaced the data (a new family brings its own parts)
        set_path(self.data, path, value)
        # other widgets bound to the same path follow
        self._quiet = True
        try:
            for other in self.bindings:
                if other is not _from and other.path == path:
                    other.var.set(to_text(other.kind, value))
        finally:
            self._quiet = False
        self.validate()

    def load(self, data: dict) -> None:
        """Replace the whole config (preset, import, reset) and refresh every widget."""
        self.data = copy.deepcopy(data)
        self.refresh()

    def refresh(self) -> None:
        for listener in list(self.reload_listeners):
            listener()
        self._quiet = True
        try:
            for binding in list(self.bindings):
                text = to_text(binding.kind, self._value(binding.path))
                try:
                    same = binding.var.get() == text
                except Exception:  # a variable that cannot read its text
                    same = False
                if not same:  # an unchanged variable is left alone: setting it redraws its widget
                    binding.var.set(text)
        finally:
            self._quiet = False
        self.validate()

    def set_machine_info(self, info: dict) -> None:
        self.machine_info = info
        for listener in list(self.info_listeners):
            listener()
        self.validate()

    def weight_dtypes(self) -> list[str] | None:
        """The weight_dtype choices `launch.py info` reports working for the current family (auto
        included), or None while the info is not in yet."""
        family = (self.machine_info or {}).get("families", {}).get(self.data["model"]["family"])
        if not family or not family.get("weight_dtypes"):
            return None
        modes = list(family["weight_dtypes"])
        return modes + (["auto"] if "auto" not in modes else [])

    # --- validation ---------------------------------------------------------------------------

    def validate(self) -> list[str]:
        try:
            self.config = TrainConfig.model_validate(self.data)
            problems = []
        except ValidationError as error:
            self.config = None
            problems = format_validation_error(error, TrainConfig, self.data)  # "did you mean" for a typo'd key
        except ConfigError as error:
            self.config = None
            problems = list(error.problems)
        problems += self.readiness_problems()
        self.problems = problems
        self.errors = {}
        for line in problems:
            path, _, message = line.partition(": ")
            self.errors.setdefault(path, message)
        for binding in list(self.bindings):
            if binding.show_error:
                binding.show_error(self.errors.get(binding.path))
        for listener in list(self.validate_listeners):
            listener()
        return problems

    def readiness_problems(self) -> list[str]:
        """What the schema allows but a run cannot start with, found before a child process starts."""
        problems = []
        data = self.data
        if not str(data.get("model", {}).get("base") or "").strip():
            problems.append("model.base: choose a base model (a diffusers folder or a .safetensors file)")
        elif not Path(str(data["model"]["base"])).exists():
            problems.append(f"model.base: {data['model']['base']} does not exist")
        else:  # the family, found as soon as a model is chosen rather than ~30 s into its load
            mismatch = _family_mismatch(str(data["model"]["base"]), str(data.get("model", {}).get("family")))
            if mismatch:
                problems.append(mismatch)
        concepts = data.get("concepts") or []
        if not any(isinstance(c, dict) and c.get("enabled", True) for c in concepts):
            problems.append("concepts: add at least one enabled concept (a folder of images)")
        for index, concept in enumerate(concepts):
            if isinstance(concept, dict) and concept.get("enabled", True):
                folder = str(concept.get("path") or "")
                if not folder.strip():
                    problems.append(f"concepts[{index}].path: choose a folder of images")
                elif not Path(folder).is_dir():
                    problems.append(f"concepts[{index}].path: {folder} is not a folder")
        if self.config is not None:  # the sample prompts' control images, as the run's preflight says
            from modules.config.families import get_family_declaration
            from modules.config.prompt_control_images import prompt_control_problems

            problems += prompt_control_problems(self.config.sampling.prompts,
                                                get_family_declaration(self.config.model.family))
        modes = self.weight_dtypes()
        if modes is not None:
            for part, settings in (data.get("model", {}).get("parts") or {}).items():
                mode = settings.get("weight_dtype") if isinstance(settings, dict) else None
                if isinstance(mode, str) and mode not in modes:
                    problems.append(f"model.parts.{part}.weight_dtype: {mode} does not work on this machine "
                                    f"(works: {', '.join(modes)})")
        return problems

    def start_problems(self) -> list[str]:
        return self.validate()

    # --- files ---------------------------------------------------------------------------------

    def overlay(self) -> dict:
        """The preset-style overlay of the current (valid) config."""
        if self.config is None:
            raise ConfigError(self.problems)
        return config_overlay(self.config)

    def config_json(self) -> str:
        if self.config is None:
            raise ConfigError(self.problems)
        return self.config.model_dump_json(indent=2)

    def restore(self, raw: Any) -> None:
        """Load a saved dict, valid or not: invalid values stay visible, marked on their fields."""
        if not isinstance(raw, dict):
            return
        try:
            self.load(build_config([raw]).model_dump(mode="json"))
            return
        except ConfigError:
            pass
        family = (raw.get("model") or {}).get("family", "sd15") if isinstance(raw.get("model"), dict) else "sd15"
        try:
            base = default_data(family)
        except ConfigError:
            base = default_data()
        merged = merge_layer(base, {k: v for k, v in raw.items() if k in base})
        self.load(json.loads(json.dumps(merged)))
