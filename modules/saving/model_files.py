"""Saving a fine-tuned model: one single file in the original layout (ldm_checkpoint.py names the
keys), or a diffusers pipeline folder that `from_pretrained` loads whole.

What each part's weights are: a part held densely in memory (every trained part, and most
others) is written from memory in the output dtype. A part kept quantized in memory (a frozen
text encoder in nf4, say) cannot be written from there; its original weights are copied from
the base instead, which works where the base is in the layout being written (a single file for
a single file, a diffusers folder for a folder) and is refused before training otherwise
(`uncopyable_parts`).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from modules.quantization.weight_modes import DENSE_MODE_NAMES
from modules.util.atomic import write_errors, write_with


def _dense(family, part: str) -> bool:
    return family.weight_mode(part) in DENSE_MODE_NAMES


def uncopyable_parts(family, single_file: bool) -> list[str]:
    """Parts held quantized whose original weights are not in the layout being written."""
    return [spec.name for spec in family.part_specs if not _dense(family, spec.name)
            and family.from_single_file(spec.name) != single_file]


def _cast(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    # each tensor to RAM in the output dtype, one at a time (never a second copy on the train device)
    return {key: tensor.detach().to("cpu").to(dtype).contiguous() for key, tensor in state.items()}


def write_single_file(path: Path, family, dtype: torch.dtype, metadata: dict[str, str]) -> Path:
    from modules.loading.single_file import part_keys
    from modules.saving.ldm_checkpoint import part_to_ldm

    tensors: dict[str, torch.Tensor] = {}
    for spec in family.part_specs:
        layout = family.single_file_part(spec.name)
        if _dense(family, spec.name):
            module = family.parts[spec.name]
            tensors.update(part_to_ldm(module, _cast(module.state_dict(), dtype), layout.prefixes[0]))
        else:  # the base file's own tensors of the part, as they are (uncopyable_parts refused the rest)
            stream = family.single_file_stream(spec.name)
            tensors.update({key: stream.read(key) for key in part_keys(stream, layout)})
    write_with(path, lambda temp: save_file(tensors, str(temp), metadata=metadata))
    return path


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)  # the base's unchanged files take no second space on the same disk
    except OSError:
        shutil.copy2(source, target)


def _copy(source: Path, target: Path) -> None:
    if source.is_dir():
        shutil.copytree(source, target, copy_function=_link_or_copy)
    else:
        _link_or_copy(str(source), str(target))


def _write_part(module, folder: Path, dtype: torch.dtype) -> None:
    folder.mkdir(parents=True)
    state = _cast(module.state_dict(), dtype)
    if hasattr(module, "save_config"):  # a diffusers model
        module.save_config(str(folder))
        name = "diffusion_pytorch_model.safetensors"
    else:  # a transformers model
        module.config.save_pretrained(str(folder))
        name = "model.safetensors"
    save_file(state, str(folder / name), metadata={"format": "pt"})


def _component(entry) -> bool:
    """A model index entry that names a component folder: [library, class] with a library (an empty
    slot is [null, null]; a modular index adds the component's spec as a third item); the pipeline's
    own settings (Krea-2's `patch_size: 2`, `text_encoder_select_layers: [2, 5, ...]`) are no folders."""
    return (isinstance(entry, list) and len(entry) in (2, 3) and isinstance(entry[0], str) and bool(entry[0])
            and isinstance(entry[1], str))


def write_pipeline_folder(folder: Path, family, trained_parts: list[str], dtype: torch.dtype,
                          metadata: dict[str, str]) -> Path:
    """The base pipeline with the trained parts replaced, at `folder` (assembled beside it, then
    renamed into place, so a crash never leaves half a folder where a good one stood)."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    temp = folder.parent / f".tmp-{folder.name}"
    shutil.rmtree(temp, ignore_errors=True)
    single_file_base = family.single_file is not None
    try:
        with write_errors(folder):
            temp.mkdir()
            written = set()
            for spec in family.part_specs:
                if spec.name in trained_parts or (family.from_single_file(spec.name) and _dense(family, spec.name)):
                    _write_part(family.parts[spec.name], temp / spec.subfolder, dtype)
                else:
                    _copy(family.part_folder(spec.name), temp / spec.subfolder)
                written.add(spec.subfolder)
            source = Path(family.config.model.base) if not single_file_base else family.model_config_folder()
            # a modular pipeline's folder (Anima's) has modular_model_index.json instead
            index_name = next((n for n in ("model_index.json", "modular_model_index.json") if (source / n).is_file()),
                              "model_index.json")
            index = json.loads((source / index_name).read_text(encoding="utf-8"))
            for name, entry in index.items():  # tokenizers, scheduler, and the pipeline's model_index.json itself
                if not name.startswith("_") and name not in written and _component(entry):
                    _copy(family.support_folder(name), temp / name)
            _copy(source / index_name, temp / index_name)
            (temp / "difftrainer.json").write_text(json.dumps(metadata, indent=2), encoding="utf-8")
            old = folder.parent / f".old-{folder.name}"
            if folder.exists():
                shutil.rmtree(old, ignore_errors=True)
                folder.rename(old)
            temp.rename(folder)
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return folder
