"""Loading a labelling model and its processor from a local folder with transformers, and feeding
them: one message naming the folder when the files do not load, inputs moved to the model's
device with floating tensors in its dtype."""

from __future__ import annotations

from pathlib import Path

from modules.autolabel.model_folder import LabelModelError

DTYPES = ("float32", "float16", "bfloat16")


def torch_dtype(name: str):
    import torch

    if name not in DTYPES:
        raise LabelModelError(f"unknown dtype {name!r} (known: {', '.join(DTYPES)})", field="--dtype")
    return getattr(torch, name)


def load_pretrained(loader, folder: Path, what: str, **options):
    """`loader.from_pretrained(folder, local_files_only=True, **options)`; a folder whose files do not
    fit raises one LabelModelError naming it (never a download: local_files_only)."""
    from transformers.utils import logging

    logging.set_verbosity_error()  # its notes (a slower image processor without torchvision) are not the user's
    logging.disable_progress_bar()  # a bar per load, in the run's log
    try:
        return loader.from_pretrained(str(folder), local_files_only=True, **options)
    except ImportError as error:  # a class that needs an optional package: transformers' message names both
        first = str(error).strip().split(". ")[0].replace("\n", " ") or type(error).__name__
        raise LabelModelError(f"{folder}: its {what} needs a package that is not installed ({first})",
                              field="--model") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise LabelModelError(f"{folder}: its {what} does not load ({first})", field="--model") from None


def load_model(loader, folder: Path, device: str, dtype: str):
    model = load_pretrained(loader, folder, "model", dtype=torch_dtype(dtype))
    return model.to(device).eval()


def model_inputs(batch, model):
    """The processor's output on the model's device; floating tensors (pixels) in its dtype."""
    moved = {}
    for name, value in batch.items():
        if hasattr(value, "to"):
            value = value.to(model.device)
            if value.is_floating_point():
                value = value.to(model.dtype)
        moved[name] = value
    return moved
