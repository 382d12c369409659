"""Continuing from an adapter file (`adapter.init_from`) adopts what the file says about its own
layout where the config leaves it open: whether it has weight decomposition and on which axis
(LyCORIS writes `dora_scale` on the output axis, kohya/ComfyUI-style files on the input axis), the
rank, and the algorithm's own options its shapes decide (LoKr's factor, decompose_both,
full_matrix: `AdapterModule.options_from_file`). A setting given explicitly that the file
contradicts is refused, naming both. Only tensor shapes are read (safetensors' header), before the
adapters are built; the layers a file adapts beyond the run's selection are added once the model
has loaded (layers.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from safetensors import SafetensorError, safe_open

from modules.adapters.formats.files import (AdapterFileError, adapter_file_metadata, algorithm_of_keys,
                                           check_adapter_file)
from modules.adapters.registry import adapter_class
from modules.config.adapter_configs import resolve_dora_axis
from modules.config.train_config import AdapterConfig, TrainConfig


def file_shapes(path: str | Path, where: str = "adapter.init_from") -> dict[str, tuple[int, ...]]:
    """Every tensor's shape, from the header alone."""
    check_adapter_file(path, where)
    try:
        with safe_open(str(path), "pt") as file:
            return {key: tuple(file.get_slice(key).get_shape()) for key in file.keys()}
    except (SafetensorError, OSError) as error:
        raise AdapterFileError(f"{where}: {Path(path).name} is not a readable safetensors file ({error})") from None


def _dora_axis(shape: tuple[int, ...]) -> str | None:
    """LyCORIS's output-axis dora_scale is (out, 1[, 1, 1]); the input-axis one (1, in[, k, k])."""
    if len(shape) < 2 or shape[0] == shape[1] == 1:
        return None
    if all(s == 1 for s in shape[1:]):
        return "output"
    return "input" if shape[0] == 1 else None


# the tensors whose shape tells the rank, and on which axis: LoRA's down/A (rank, in), LoHa's
# w1_b (rank, in), LoKr's decomposed w2_a/w1_a (rows, rank); a full LoKr factor has no rank
_RANK_AXES = {"lora_down.weight": 0, "lora_A.weight": 0, "hada_w1_b": 0, "lokr_w2_a": 1, "lokr_w1_a": 1}


def _layers_of(shapes: dict[str, tuple[int, ...]], algorithm: str) -> dict[str, dict[str, tuple[int, ...]]]:
    """stem -> tensor name -> shape, for the file's tensors of `algorithm` (kohya names)."""
    names = adapter_class(algorithm).key_names
    layers: dict[str, dict[str, tuple[int, ...]]] = {}
    for key, shape in shapes.items():
        stem, _, tensor = key.rpartition(".")
        if tensor in names:
            layers.setdefault(stem, {})[tensor] = shape
    return layers


def _found(shapes: dict[str, tuple[int, ...]], config: AdapterConfig | None = None) -> dict[str, tuple[object, str]]:
    """setting -> (value the file says, an example key), for what the file decides."""
    found: dict[str, tuple[object, str]] = {}
    scales = {k: s for k, s in shapes.items() if k.endswith((".dora_scale", ".lora_magnitude_vector"))}
    found["dora"] = (bool(scales), next(iter(scales), next(iter(shapes), "")))
    axes = {}
    for key, shape in scales.items():
        axis = "output" if key.endswith(".lora_magnitude_vector") else _dora_axis(shape)
        if axis:
            axes.setdefault(axis, key)
    if len(axes) == 1:
        (axis, key), = axes.items()
        found["dora_axis"] = (axis, key)
    ranks = {}
    for key, shape in shapes.items():
        for suffix, axis in _RANK_AXES.items():
            if key.endswith("." + suffix):
                ranks.setdefault(shape[axis], key)
    if len(ranks) == 1:
        (rank, key), = ranks.items()
        found["rank"] = (rank, key)
    if config is not None:
        algorithm_of = algorithm_of_keys()
        algorithms = {algorithm_of.get(key.rpartition(".")[2]) for key in shapes} - {None}
        if algorithms == {config.type}:  # another algorithm: the loader names adapter.type
            rank = found["rank"][0] if "rank" in found else None
            found.update(adapter_class(config.type).options_from_file(config, _layers_of(shapes, config.type), rank))
    return found


def adopt_file_layout(config: AdapterConfig, source: str | Path, output_format: str = "kohya",
                      model_family: str | None = None) -> tuple[AdapterConfig, list[str]]:
    """The adapter config with the file's layout adopted where no setting was given, and what was
    adopted (one line per setting); a given setting the file contradicts is an AdapterFileError
    (naming the file's family where its header gives another than `model_family`)."""
    shapes = file_shapes(source)
    name = Path(source).name
    explicit = config.model_fields_set
    changes: dict[str, object] = {}
    said, conflicts = [], []
    for field, (value, key) in _found(shapes, config).items():
        if field not in type(config).model_fields:
            continue  # an algorithm without this option (OFT has no rank); its own checks say what differs
        if field == "dora_axis" and not changes.get("dora", getattr(config, "dora", False)):
            continue
        current = getattr(config, field)
        if field == "dora_axis" and resolve_dora_axis(current, output_format) == value:
            continue  # `auto` already means the file's axis with this output format
        if current == value:
            continue
        if field in explicit:
            conflicts.append(f"adapter.{field} is {current!r} but the file's is {value!r} (e.g. {key})")
            continue
        changes[field] = value
        said.append(f"adapter.{field}: {value!r} (e.g. {key})")
    if conflicts:
        # a LoRA of another model differs in rank as often as not: that, not the rank, is the news
        made_for = adapter_file_metadata(source).get("difftrainer.family")
        other = (f" (its header says it is an adapter of model.family {made_for!r}; this run trains "
                 f"{model_family!r})") if made_for and model_family and made_for != model_family else ""
        raise AdapterFileError(f"adapter.init_from: {name} does not fit the explicit adapter settings{other}: "
                               + "; ".join(conflicts) + "; remove the setting to adopt the file's")
    if not changes:
        return config, []
    adopted = config.model_copy(update=changes)
    type(config).model_validate(adopted.model_dump(exclude_unset=False))  # the combination is valid
    return adopted, [f"adapter.init_from: {name}: adopted the file's layout: " + ", ".join(said)]


def adopt_init_from(config: TrainConfig, warn: Callable[[str], None]) -> None:
    """Set the run's adapter config to the init_from file's layout (said through `warn`). The
    trainer calls it right after preflight: before a resumed run's config is compared with its
    backup's (which holds the adopted settings) and before the adapters are built."""
    if config.method.type != "adapter" or not config.adapter.init_from:
        return
    config.adapter, adopted = adopt_file_layout(config.adapter, config.adapter.init_from, config.output.format,
                                                config.model.family)
    for line in adopted:
        warn(line)
