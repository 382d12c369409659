"""Adapter files in the three key layouts other tools read, saved from and loaded into an AdapterSet.

kohya      `lora_unet_<module>.lora_down.weight` / `.lora_up.weight` / `.alpha`, and the LyCORIS
           names for the other algorithms on the same stems: `.hada_w1_a` ... `.hada_w2_b`,
           `.lokr_w1` | `.lokr_w1_a`+`_b`, `.lokr_w2` | `.lokr_w2_a`+`_b`, `.oft_blocks`,
           `.dora_scale` (each algorithm's class declares its names: AdapterModule.key_names).
           A1111, Forge, ComfyUI read it; diffusers reads its LoRA part.
comfy      ComfyUI's own layout: the same tensor names on the model's own module paths,
           `diffusion_model.input_blocks.1.1.transformer_blocks.0.attn1.to_q.lora_up.weight`,
           `text_encoders.clip_l.transformer.text_model.encoder.layers.0.self_attn.q_proj.alpha`
           (each family's comfy_module_name; FLUX writes its kohya layout, file_layout).
diffusers  peft keys under the pipeline component: `unet.<module>.lora_A.weight` (formats/diffusers.py).
FLUX and Z-Image kohya files write LoRA on their original layers (fused.py).

The AdapterSet's state dict is the kohya layout, so kohya is the identity here. Loading takes
any of the three (also mixed, and kohya stems spelled with ldm block names or SimpleTuner's
`lycoris_` prefix), maps every key to an adapter of this run, and refuses the file naming every
key that maps to none; then the strict AdapterSet load names what is missing or misshapen.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from modules.adapters.adapter_set import AdapterSet, AdapterSetError
from modules.adapters.formats import diffusers as peft_keys
from modules.adapters.formats import fused
from modules.adapters.registry import adapter_class, adapter_classes
from modules.util.atomic import write_with

if TYPE_CHECKING:
    from modules.config.train_config import AdapterConfig
    from modules.model.base import ModelFamily

FORMATS = ("kohya", "comfy", "diffusers")
# tensor names of LyCORIS features no algorithm here trains (each algorithm names its own variants)
_UNSUPPORTED = {"diff": "a full weight difference", "diff_b": "a bias difference"}


def canonical_keys() -> tuple[str, ...]:
    """Every tensor name (after the key stem) a kohya/LyCORIS file of a registered algorithm has."""
    return ("alpha", "dora_scale", *(key for cls in adapter_classes().values() for key in cls.key_names))


def unsupported_keys() -> dict[str, str]:
    """Tensor name -> the LyCORIS feature it belongs to, for what no algorithm here trains."""
    out = dict(_UNSUPPORTED)
    for cls in adapter_classes().values():
        out.update(cls.unsupported_keys)
    return out


def algorithm_of_keys() -> dict[str, str]:
    """The algorithm a tensor name belongs to, kohya and peft names (alpha and dora_scale: several)."""
    return {key: name for name, cls in adapter_classes().items()
            for key in (*cls.key_names, *cls.peft_names.values())}


class AdapterFileError(AdapterSetError):
    pass


# --- key stems -------------------------------------------------------------------------------

def _comfy_stem(family: ModelFamily, part: str, module_name: str) -> str | None:
    try:
        return family.comfy_module_name(part, module_name)
    except NotImplementedError:
        return None


def stems(adapters: AdapterSet, family: ModelFamily, fmt: str) -> dict[str, str]:
    """adapter name -> its key stem in `fmt` (for the adapters a kohya file writes on original
    layers, fused.py: the stem they would have on their own)."""
    out = {}
    fmt = family.file_layout(fmt)
    for name in adapters.modules:
        part, module_name = adapters.part_of[name], adapters.module_name_of[name]
        if fmt == "kohya":
            out[name] = family.kohya_file_stem(part, module_name) or name
        elif fmt == "comfy":
            stem = _comfy_stem(family, part, module_name)
            if stem is None:
                raise AdapterFileError(f"output.format: 'comfy': {family.label} has no ComfyUI key layout yet; "
                                       "use 'kohya'")
            out[name] = stem
        elif fmt == "diffusers":
            out[name] = f"{part}.{family.canonical_module_name(part, module_name)}"
        else:
            raise AdapterFileError(f"output.format: unknown format {fmt!r} (known: {', '.join(FORMATS)})")
    return out


def layer_stems(family: ModelFamily, part: str, module_name: str, name: str) -> dict[str, str]:
    """Every stem a file may use for the adapter `name` on a layer: stem -> layout."""
    found = {name: "kohya"}
    comfy = _comfy_stem(family, part, module_name)
    if comfy is not None:
        found[comfy] = "kohya"
        if comfy.startswith("diffusion_model."):
            # the denoiser's kohya stems in ldm block names (A1111-era files), and SimpleTuner's `lycoris_` ones
            prefix = family.spec(part).adapter_prefix
            found[f"{prefix}_{comfy.removeprefix('diffusion_model.').replace('.', '_')}"] = "kohya"
            found[f"lycoris_{module_name.replace('.', '_')}"] = "kohya"
    for other in family.other_stems(part, module_name):
        found[other] = "kohya"
    for spelled in {family.canonical_module_name(part, module_name), module_name}:
        found[f"{part}.{spelled}"] = "diffusers"
    return found


def _stems_for_loading(adapters: AdapterSet, family: ModelFamily) -> dict[str, tuple[str, str]]:
    """Every stem a file may use for each adapter: stem -> (adapter name, layout)."""
    lookup: dict[str, tuple[str, str]] = {}
    for name in adapters.modules:
        part, module_name = adapters.part_of[name], adapters.module_name_of[name]
        for stem, layout in layer_stems(family, part, module_name, name).items():
            lookup[stem] = (name, layout)
    return lookup


def unmapped_keys(keys, adapters: AdapterSet, family: ModelFamily) -> list[str]:
    """The file keys that name no adapter of the set (by the stems a file may use)."""
    lookup = _stems_for_loading(adapters, family)
    suffixes = (*canonical_keys(), *peft_keys.local_keys())
    return [key for key in keys if _split(key, lookup, suffixes) is None]


def layer_of_key(key: str, lookup: dict[str, tuple[str, str]]) -> tuple[str, str] | None:
    """The (stem, tensor name) of a file key whose stem `lookup` knows."""
    return _split(key, lookup, (*canonical_keys(), *peft_keys.local_keys()))


# --- saving ----------------------------------------------------------------------------------

def check_output_format(fmt: str, adapters: AdapterSet, family: ModelFamily) -> None:
    """Refuse, before training, an output format that cannot hold these adapters."""
    stems(adapters, family, fmt)
    if family.file_layout(fmt) == "diffusers":
        for adapter in adapters:
            why = adapter.peft_unsupported()
            if why:
                raise AdapterFileError(f"output.format: 'diffusers' cannot hold these adapters: {why}")
        for algorithm, members in _by_algorithm(adapters).items():
            why = adapter_class(algorithm).peft_set_problem(members)
            if why:
                raise AdapterFileError(f"output.format: 'diffusers' cannot hold these adapters: {why}")


def _by_algorithm(adapters: AdapterSet) -> dict[str, list]:
    grouped: dict[str, list] = {}
    for adapter in adapters:
        grouped.setdefault(adapter.algorithm, []).append(adapter)
    return grouped


def format_warnings(fmt: str, adapters: AdapterSet, family: ModelFamily) -> list[str]:
    """What a consumer will not load from a file of `fmt` (said before training; the file is
    still complete for the tools the format is made for)."""
    stacked = fused.fused_names(adapters, family) if family.file_layout(fmt) == "kohya" else set()
    comfyui: dict[str, list[str]] = {}
    diffusers: dict[str, list[str]] = {}
    refusing: dict[str, list[str]] = {}
    sd_scripts: dict[str, list[str]] = {}
    for name in adapters.modules:
        part, module_name = adapters.part_of[name], adapters.module_name_of[name]
        shown = f"{part}.{family.canonical_module_name(part, module_name)}"
        why = family.comfyui_skips_diffusers_key(part, module_name) if fmt == "diffusers" else None
        if why:
            comfyui.setdefault(why, []).append(shown)
        why = family.diffusers_skips_key(fmt, part, module_name, name in stacked)
        if why:
            diffusers.setdefault(why, []).append(shown)
        why = family.diffusers_refuses_key(fmt, part, module_name, name in stacked)
        if why:
            refusing.setdefault(why, []).append(shown)
        why = family.sd_scripts_skips_key(part, module_name) if fmt == "kohya" else None
        if why:
            sd_scripts.setdefault(why, []).append(shown)
    warnings = [f"output.format: {fmt!r}: ComfyUI will not load {len(names)} of these adapters (e.g. {names[0]}): "
                f"{why}; use 'kohya' or 'comfy' for ComfyUI" for why, names in comfyui.items()]
    warnings += [f"output.format: {fmt!r}: diffusers' load_lora_weights will not load {len(names)} of these adapters "
                 f"(e.g. {names[0]}): {why}" for why, names in diffusers.items()]
    warnings += [f"output.format: {fmt!r}: diffusers' load_lora_weights refuses the whole file: {len(names)} of these "
                 f"adapters (e.g. {names[0]}): {why}" for why, names in refusing.items()]
    refused = family.diffusers_refuses(fmt)
    if refused:
        warnings.append(f"output.format: {fmt!r}: diffusers' {refused}")
    warnings += [f"output.format: {fmt!r}: kohya's sd-scripts (networks/lora.py) will not load {len(names)} of these "
                 f"adapters (e.g. {names[0]}): {why}; ComfyUI, Forge and diffusers load them"
                 for why, names in sd_scripts.items()]
    return warnings


def diffusers_report(fmt: str, adapters: AdapterSet, family: ModelFamily) -> dict:
    """The save check's diffusers entry ({"applied", "total", "dropped"}, counted in adapters): what
    `load_lora_weights` loads from a file of `fmt`, by the facts the project keeps (each family's
    `diffusers_skips_key`, `diffusers_refuses_key` and `diffusers_refuses`, rebuilt from diffusers'
    converters). Not
    diffusers run on the file: tests/test_diffusers_load_lora.py holds these facts
    against the real loader for every family and format."""
    stacked = fused.fused_names(adapters, family) if family.file_layout(fmt) == "kohya" else set()
    names = [(name, adapters.part_of[name], adapters.module_name_of[name]) for name in adapters.modules]
    # a refused file loads nothing: one adapter on a layer its converter has no rule for is enough
    refused = family.diffusers_refuses(fmt) is not None or any(
        family.diffusers_refuses_key(fmt, part, module_name, name in stacked) for name, part, module_name in names)
    dropped = [f"{part}.{family.canonical_module_name(part, module_name)}" for name, part, module_name in names
               if refused or family.diffusers_skips_key(fmt, part, module_name, name in stacked)]
    return {"applied": len(adapters) - len(dropped), "total": len(adapters), "dropped": sorted(dropped)}


def file_state(adapters: AdapterSet, family: ModelFamily, fmt: str) -> dict[str, torch.Tensor]:
    check_output_format(fmt, adapters, family)
    named = stems(adapters, family, fmt)
    layout = family.file_layout(fmt)
    out = {}
    on_original_layers = set()
    if layout == "kohya":  # families whose kohya files name their original layers (FLUX, Z-Image)
        out.update(fused.fused_state(adapters, family))
        on_original_layers = fused.fused_names(adapters, family)
    for name, adapter in adapters.modules.items():
        if name in on_original_layers:
            continue
        local = adapter.file_tensors()
        if layout == "diffusers":
            local = peft_keys.to_peft(adapter, local)
        out.update({f"{named[name]}.{key}": tensor for key, tensor in local.items()})
    return out


def network_metadata(config: AdapterConfig, output_format: str = "kohya") -> dict[str, str]:
    """kohya's ss_network_* fields, as the configured algorithm declares them."""
    return adapter_class(config.type).network_metadata(config, output_format)


def save_adapter_file(path: str | Path, adapters: AdapterSet, family: ModelFamily, fmt: str, dtype: torch.dtype,
                      metadata: dict[str, str]) -> Path:
    state = file_state(adapters, family, fmt)
    tensors = {k: v.to("cpu", dtype).contiguous() for k, v in state.items()}
    header = {**metadata, "difftrainer.format": fmt}
    for algorithm, members in _by_algorithm(adapters).items():
        header.update(adapter_class(algorithm).file_header(members))
    write_with(path, lambda temp: save_file(tensors, str(temp), metadata=header))
    return Path(path)


# --- loading ---------------------------------------------------------------------------------

def check_adapter_file(path: str | Path, where: str = "adapter.init_from") -> None:
    """What a file's name says before it is read: an existing .safetensors file (preflight asks
    this before the model loads)."""
    path = Path(path)
    if not path.is_file():
        raise AdapterFileError(f"{where}: {path} is not a file")
    if path.suffix != ".safetensors":
        raise AdapterFileError(f"{where}: {path.name}: only .safetensors adapter files are read "
                               "(pickled .pt/.ckpt files can run code when loaded)")


def adapter_file_metadata(path: str | Path, where: str = "adapter.init_from") -> dict[str, str]:
    """The header metadata of a .safetensors file, without reading its tensors."""
    path = Path(path)
    try:
        with safe_open(str(path), "pt") as file:
            return file.metadata() or {}
    except (SafetensorError, OSError) as error:
        raise AdapterFileError(f"{where}: {path.name} is not a readable safetensors file ({error})") from None


def read_adapter_file(path: str | Path, where: str = "adapter.init_from") -> tuple[dict[str, torch.Tensor], dict]:
    """Tensors and the header metadata of a .safetensors file (never unpickles anything)."""
    path = Path(path)
    check_adapter_file(path, where)
    try:
        with safe_open(str(path), "pt") as file:
            metadata = file.metadata() or {}
            tensors = {key: file.get_tensor(key) for key in file.keys()}
    except (SafetensorError, OSError) as error:
        raise AdapterFileError(f"{where}: {path.name} is not a readable safetensors file ({error})") from None
    return tensors, metadata


def _split(key: str, lookup: dict[str, tuple[str, str]], suffixes: tuple[str, ...]) -> tuple[str, str] | None:
    """(stem, tensor name) for a file key whose stem is known, trying each known tensor name."""
    for suffix in suffixes:
        if key.endswith("." + suffix) and key[: -len(suffix) - 1] in lookup:
            return key[: -len(suffix) - 1], suffix
    return None


def _listing(keys: list[str]) -> str:
    return ", ".join(keys[:8]) + (f", ... ({len(keys)} in all)" if len(keys) > 8 else "")


def canonical_state(tensors: dict[str, torch.Tensor], metadata: dict, adapters: AdapterSet, family: ModelFamily,
                    source: str, where: str = "adapter.init_from") -> dict[str, torch.Tensor]:
    """A file's tensors in any of the layouts -> this run's canonical (kohya) adapter state."""
    lookup = _stems_for_loading(adapters, family)
    unsupported = unsupported_keys()
    suffixes = (*canonical_keys(), *peft_keys.local_keys())
    tensors, unmapped = fused.unfuse(tensors, adapters, family)
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    layout_of: dict[str, set[str]] = {}
    for key, tensor in tensors.items():
        found = _split(key, lookup, suffixes)
        if found is None:
            suffix = next((s for s in unsupported if key.endswith("." + s)), None)
            unmapped.append(f"{key} ({unsupported[suffix]}, not supported)" if suffix else key)
            continue
        stem, suffix = found
        name, layout = lookup[stem]
        grouped.setdefault(name, {})[suffix] = tensor
        layout_of.setdefault(name, set()).add(layout)
    if unmapped:
        hint = ""
        if not grouped:  # not one key names a layer: a file of another model, or layers this run leaves out
            made_for = metadata.get("modelspec.architecture") or metadata.get("ss_base_model_version")
            ours = metadata.get("difftrainer.family")  # what this trainer writes (outputs.py)
            hint = f"; none does: is it an adapter of another model than model.family {family.name!r}?" + (
                f" (its header says model.family {ours!r})" if ours and ours != family.name else
                f" (its header says {made_for!r}; this family's LoRA is {family.modelspec_architecture!r})"
                if made_for and made_for != family.modelspec_architecture else "")
        raise AdapterFileError(f"{where}: {source}: {len(unmapped)} key(s) map to no layer this run puts an adapter on "
                               f"(adapter.layer_preset / layer_filter, model.parts.*.train){hint}: {_listing(unmapped)}")
    mixed = sorted(name for name, layouts in layout_of.items() if len(layouts) > 1)
    if mixed:
        raise AdapterFileError(f"{where}: {source}: {_listing(mixed)} given twice, in two key layouts")
    _check_algorithms(grouped, adapters, source, where)
    header = metadata.get("lora_adapter_metadata")
    peft_metadata = json.loads(header) if header else None
    state = {}
    for name, local in grouped.items():
        adapter = adapters.modules[name]
        if layout_of[name] == {"diffusers"}:
            scale = peft_keys.metadata_scale(peft_metadata, adapters.part_of[name],
                                             family.canonical_module_name(adapters.part_of[name],
                                                                          adapters.module_name_of[name]))
            local = peft_keys.from_peft(adapter, local, scale)
        elif "alpha" not in local and "alpha" in adapter.state_dict():
            local["alpha"] = torch.tensor(adapter.default_alpha(local))
        local = adapter.from_file(local, metadata)
        state.update({f"{name}.{key}": tensor for key, tensor in local.items()})
    return state


def _check_algorithms(grouped: dict[str, dict[str, torch.Tensor]], adapters: AdapterSet, source: str, where: str) -> None:
    """Name the setting to change when the file holds another algorithm or another DoRA than the run."""
    problems: dict[str, str] = {}  # one message per kind of mismatch, with its first example
    algorithm_of = algorithm_of_keys()

    def add(message: str) -> None:
        problems.setdefault(re.sub(r"\([^)]*\)", "", message), message)  # the example in parentheses

    for name, local in grouped.items():
        adapter = adapters.modules[name]
        found = {algorithm_of[k] for k in local if k in algorithm_of}
        if found and found != {adapter.algorithm}:
            add(f"it holds {'/'.join(sorted(found))} adapters (e.g. {name}) and adapter.type is {adapter.algorithm!r}")
        has_dora = "dora_scale" in local or "lora_magnitude_vector" in local
        axis = getattr(adapter, "dora_axis", None)
        if has_dora and axis is None:
            add(f"it has weight decomposition (dora_scale, e.g. {name}); set adapter.dora: true")
        elif axis is not None and not has_dora:
            add(f"it has no weight decomposition (no dora_scale at {name}); set adapter.dora: false")
        elif has_dora and axis == "input" and "lora_magnitude_vector" in local:
            add(f"its magnitudes are peft's, on the output axis (e.g. {name}); set adapter.dora_axis: output")
        elif has_dora and "dora_scale" in local:
            shape = tuple(local["dora_scale"].shape)
            file_axis = "output" if shape[0] == adapter.out_dim and (len(shape) < 2 or shape[1] == 1) else "input"
            if file_axis != axis and adapter.out_dim != 1:
                add(f"its dora_scale is on the {file_axis} axis (e.g. {name}: {shape}); set adapter.dora_axis: {file_axis}")
    if problems:
        raise AdapterFileError(f"{where}: {source} does not fit adapter settings: " + "; ".join(sorted(problems.values())))


def load_adapter_file(path: str | Path, adapters: AdapterSet, family: ModelFamily,
                      where: str = "adapter.init_from") -> None:
    """Load a file of any supported layout into the adapters, strictly."""
    tensors, metadata = read_adapter_file(path, where)
    state = canonical_state(tensors, metadata, adapters, family, Path(path).name, where)
    adapters.load_state_dict(state, source=f"{where}: {Path(path).name}")
