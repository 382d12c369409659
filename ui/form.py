"""The form, generated from TrainConfig: each config field gets a widget chosen by its type.

bool -> switch; int/float (optional: empty means None) -> entry; Literal -> option menu with the
Literal's values; a number or a Literal (`offload_fraction`: 0.5 or "auto", `batch_size`: 4 or "auto")
-> combo box; a bool or a Literal (`gradient_checkpointing`: true, false or "auto") -> option menu; an int
or a list of ints (`data.resolution`) -> entry taking "512" or "512, 768"; list[str] -> one
entry per line; a tuple -> one entry per item; a Cadence -> value + unit; a nested model -> its
fields in a sub-group. Label = the field name in words, tooltip = the field's description.

The tabs (hand-written) only decide where each group goes and in which order; `build_form`
with `names=None` takes every field of the model not listed elsewhere, so a field added to the
config shows up without a GUI change. The few hints below are what types cannot say: which
strings are paths, which choices come from the machine or the family instead of the schema,
and which fields only apply when another has a certain value (hidden otherwise).
"""

from __future__ import annotations

import re
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Literal, Union

from pydantic import BaseModel

from modules.config.train_config import Cadence
from modules.quantization.weight_modes import reads_part_option


@dataclass(frozen=True)
class Spec:
    kind: str  # a ui.state kind
    widget: str  # entry | switch | option | combo | lines
    choices: tuple = ()


def strip_annotated(annotation: Any) -> Any:
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation


def union_members(annotation: Any) -> list:
    annotation = strip_annotated(annotation)
    if typing.get_origin(annotation) in (Union, types.UnionType):
        return [strip_annotated(a) for a in typing.get_args(annotation)]
    return [annotation]


def is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def leaf_spec(annotation: Any) -> Spec | None:
    """The widget for a scalar field's type, or None when the type is not a leaf (models, tuples,
    dicts and lists of models, unions of models)."""
    members = union_members(annotation)
    optional = type(None) in members
    members = [m for m in members if m is not type(None)]
    literals = [v for m in members if typing.get_origin(m) is Literal for v in typing.get_args(m)]
    others = [m for m in members if typing.get_origin(m) is not Literal]
    if not others and literals:
        return Spec("choice", "option", tuple(literals))
    if others == [bool] and literals:  # a switch or a word (gradient_checkpointing: true, false or auto)
        return Spec("boolword", "option", ("false", "true", *literals))
    if others == [bool]:
        return Spec("bool", "switch")
    if others == [int] and literals:  # a whole number or a word (batch_size: 4 or auto)
        return Spec("intword", "combo", tuple(literals))
    if others in ([int], [float]) and literals:  # a number or a word (offload_fraction: 0.5 or auto)
        return Spec("fraction", "combo", tuple(literals))
    if others == [int]:
        return Spec("optint" if optional else "int", "entry")
    if others == [float] or others == [int, float] or others == [float, int]:
        return Spec("optfloat" if optional else "float", "entry")
    if others == [str]:
        return Spec("optstr" if optional else "str", "entry")
    if len(others) == 2 and int in others:
        listed = next(m for m in others if m is not int)
        if typing.get_origin(listed) is list and strip_annotated(typing.get_args(listed)[0]) is int:
            return Spec("intlist", "entry")
    if len(others) == 1 and typing.get_origin(others[0]) is list:
        item = strip_annotated(typing.get_args(others[0])[0])
        if item is str:
            return Spec("lines", "lines")
    return None


ACRONYMS = {"lr": "learning rate", "dora": "DoRA", "lokr": "LoKr", "oft": "OFT", "ema": "EMA", "snr": "SNR",
            "cfg": "CFG", "nf4": "nf4", "d0": "d0"}


def words(name: str) -> str:
    """'lokr_decompose_both' -> 'LoKr decompose both'."""
    text = " ".join(ACRONYMS.get(word, word) for word in name.split("_"))
    keep_case = name.split("_")[0] in ("nf4", "d0")  # names, not words
    return text if keep_case else text[:1].upper() + text[1:]


# --- hints the types cannot give (keyed by the generic path: [] for a list item, * for a dict key) ---

def generic(path: str) -> str:
    """'concepts[3].path' -> 'concepts[].path'; 'model.parts.unet.path' -> 'model.parts.*.path'."""
    path = re.sub(r"\[\d+\]", "[]", path)
    return re.sub(r"^(model\.parts|adapter\.parts)\.[^.]+", r"\1.*", path)


PATHS = {  # str fields that name files or folders: the picker's mode
    "model.base": "file_or_dir", "model.parts.*.path": "file_or_dir", "concepts[].path": "dir",
    "output.path": "save", "workspace_dir": "dir", "cache_dir": "dir", "adapter.init_from": "file",
    "embeddings[].path": "file",
}


def _family_names(_cfg) -> list[str]:
    from modules.config.families import family_names

    return list(family_names())


def _layer_presets(cfg) -> list[str]:
    from modules.config.families import family_names, get_family_declaration

    family = cfg.get("model.family")
    if family not in family_names():
        return [str(cfg.get("adapter.layer_preset"))]
    return list(get_family_declaration(family).layer_presets)


def _family_has(value, attribute: str) -> bool | None:
    """The model.family's class attribute, or None while the family is not a known one."""
    from modules.config.families import family_names, get_family_declaration

    family = value("model.family")
    return getattr(get_family_declaration(family), attribute) if family in family_names() else None


def _prompt_images(cfg) -> tuple[int, int, str] | None:
    """(fewest, most, label): the control images the family's sample prompts take."""
    from modules.config.families import family_names, get_family_declaration

    family = cfg.get("model.family")
    if family not in family_names():
        return None
    declaration = get_family_declaration(family)
    return (*declaration.prompt_images, declaration.label)


def _weight_dtypes(cfg) -> list[str]:
    from modules.config.train_config import weight_dtype_choices

    # until `launch.py info` is in: every registered mode (the schema's list)
    return cfg.weight_dtypes() or weight_dtype_choices()


def _devices(cfg, with_auto: bool) -> list[str]:
    devices = list((cfg.machine_info or {}).get("devices", {}) or ["cpu"])
    return (["auto"] if with_auto else []) + devices


# choices that come from the registry or this machine instead of the schema: (widget, provider)
CHOICES: dict[str, tuple[str, Callable]] = {
    "model.family": ("option", _family_names),
    "adapter.layer_preset": ("option", _layer_presets),
    "model.parts.*.weight_dtype": ("option", _weight_dtypes),
    "train_device": ("combo", lambda cfg: _devices(cfg, True)),
    "temp_device": ("combo", lambda cfg: _devices(cfg, False)),
}

# lists of image files, picked in a dialog and shown as thumbnails: (fewest, most, label) for the family
IMAGE_LISTS: dict[str, Callable] = {"sampling.prompts[].control_images": _prompt_images}

# Fields that apply only in some settings: shown when the rule holds. A rule gets `sibling(name)`
# (a field next to this one) and `value(path)` (any path).
VISIBLE: dict[str, Callable[[Callable, Callable], bool]] = {
    "adapter.dora_axis": lambda s, v: bool(v("adapter.dora")),
    "concepts[].caption_file": lambda s, v: s("caption_source") == "file",
    "concepts[].unmasked_weight": lambda s, v: bool(s("masked_loss")),
    "model.parts.*.nf4_double_quant": lambda s, v: reads_part_option(s("weight_dtype"), "nf4_double_quant"),
    "model.parts.*.learning_rate": lambda s, v: bool(s("train")),
    "loss.huber_delta": lambda s, v: s("type") == "huber",
    "loss.logit_mean": lambda s, v: s("timesteps") == "logit_normal",
    "loss.logit_std": lambda s, v: s("timesteps") == "logit_normal",
    "lr_scheduler.cycles": lambda s, v: s("type") == "cosine_with_restarts",
    "lr_scheduler.power": lambda s, v: s("type") == "polynomial",
    "embeddings[].learning_rate": lambda s, v: bool(s("train")),
    "ema.decay": lambda s, v: bool(s("enabled")),
    "ema.update_every": lambda s, v: bool(s("enabled")),
    "ema.device": lambda s, v: bool(s("enabled")),
    # flow-matching families sample with their own scheduler; a guidance-distilled one with no negative prompt
    "sampling.scheduler": lambda s, v: _family_has(v, "flow_matching") is not True,
    "sampling.prompts[].negative_prompt": lambda s, v: _family_has(v, "negative_prompt") is not False,
    # an edit or image-to-video family's prompts take control images; shown elsewhere only while a
    # prompt still holds some (from another family), so that they can be removed
    "sampling.prompts[].control_images": lambda s, v: bool(s("control_images"))
    or (_family_has(v, "prompt_images") or (0, 1))[1] > 0,
}

NOT_EDITABLE = {"version"}  # the file format's version: written by the trainer, never a user choice


def build_form(tab, parent, model: type[BaseModel], prefix: str, names: list[str] | None = None,
               exclude: set[str] = frozenset()) -> list[str]:
    """Fields for `model`'s fields under `prefix` ('' at the root), in `names` order, or every field
    not in `exclude` (declaration order). Returns the paths of the fields made."""
    made = []
    for name in (names if names is not None else [n for n in model.model_fields if n not in exclude]):
        info = model.model_fields[name]
        path = f"{prefix}.{name}" if prefix else name
        if path in NOT_EDITABLE:
            continue
        made += build_field(tab, parent, path, name, info.annotation, info.description)
    return made


def build_field(tab, parent, path: str, name: str, annotation: Any, description: str | None) -> list[str]:
    from ui.components import subsection

    annotation = strip_annotated(annotation)
    key = generic(path)
    options: dict[str, Any] = {"tooltip": description, "visible": VISIBLE.get(key)}
    if annotation is Cadence:
        tab.field(parent, f"{path}.value", words(name) + " (0: never)", "float",
                  unit=(f"{path}.unit", list(typing.get_args(Cadence.model_fields["unit"].annotation))), **options)
        return [f"{path}.value", f"{path}.unit"]
    if is_model(annotation):
        group = subsection(parent, words(name), description)
        return build_form(tab, group, annotation, path)
    if typing.get_origin(annotation) is tuple:
        made = []
        for index, member in enumerate(typing.get_args(annotation)):
            made += build_field(tab, parent, f"{path}[{index}]", f"{name} [{index}]", member, description)
        return made
    spec = leaf_spec(annotation)
    if spec is None:
        raise TypeError(f"{path}: no widget for {annotation!r}; place it in a tab's layout (ui/tabs/)")
    widget, values = spec.widget, list(spec.choices)
    if key in CHOICES:
        widget, provider = CHOICES[key]
        options["choices"] = provider
    elif key in IMAGE_LISTS:
        widget = "images"
        options["images"] = IMAGE_LISTS[key]
    elif key in PATHS:
        widget = "path"
        options["path_mode"] = PATHS[key]
        if key in ("output.path", "adapter.init_from", "embeddings[].path"):
            options["filetypes"] = [("safetensors", "*.safetensors"), ("all files", "*")]
    tab.field(parent, path, words(name), spec.kind, widget=widget, values=values, **options)
    return [path]
