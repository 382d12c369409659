"""Embedding files in the A1111/ComfyUI layout: one [vectors, dim] tensor per text encoder, under
the family's key (`emb_params` for SD1.x; `clip_l` and `clip_g` for SDXL; ComfyUI's `embedding_key`s
`clip_l`, `clip_g`, `t5xxl`, `qwen3_4b` for FLUX.1, SD3, Chroma, Z-Image; `qwen3_4b`/`qwen3_8b` for
FLUX.2 klein 4B/9B; `qwen25_7b` for Qwen-Image and its edit models; `umt5xxl` for Wan), in a
.safetensors file.
diffusers reads them with `load_textual_inversion` (SDXL, FLUX.1: once per text encoder, passing
`state_dict["clip_l"]` with text_encoder/tokenizer and `state_dict["clip_g"]` (`["t5xxl"]`) with
text_encoder_2/tokenizer_2)."""

from __future__ import annotations

from pathlib import Path

import torch

from modules.util.atomic import write_with


def embedding_problems(embeddings, captions: list[str]) -> list[str]:
    """Before the model loads: each embedding's file exists, and each trained placeholder is in some
    training caption (an embedding no caption uses never gets a gradient)."""
    problems = []
    for index, embedding in enumerate(embeddings):
        if embedding.path and not Path(embedding.path).expanduser().is_file():
            problems.append(f"embeddings[{index}].path: {embedding.path} is not a file")
        if embedding.train and captions and not any(embedding.placeholder in c for c in captions):
            problems.append(f"embeddings[{index}].placeholder: {embedding.placeholder!r} is in no caption of the "
                            f"training concepts, so it would never learn: write it into the captions (or into "
                            f"concepts[].captions.prefix)")
    return problems


def read_embedding_file(path: str | Path, keys: dict[str, str], dims: dict[str, int], where: str
                        ) -> dict[str, torch.Tensor]:
    """part -> [vectors, dim] float32 tensor, from `path`; `keys` maps each text part to its file key.
    A single-text-encoder family also takes diffusers' own layout (one tensor under any name)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path).expanduser()
    if path.suffix != ".safetensors":
        raise ValueError(f"{where}: {path.name} is not a .safetensors file (pickled .pt/.bin embeddings are "
                         f"not loaded; convert them first)")
    if not path.is_file():
        raise ValueError(f"{where}: {path} is not a file")
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as error:
        raise ValueError(f"{where}: {path.name} is not a readable safetensors file ({error})") from None
    if len(keys) == 1 and len(tensors) == 1:
        tensors = {next(iter(keys.values())): next(iter(tensors.values()))}
    missing = [key for key in keys.values() if key not in tensors]
    if missing:
        raise ValueError(f"{where}: {path.name} has no {', '.join(missing)} (it has {', '.join(sorted(tensors))}); "
                         f"is it an embedding of another model family?")
    out = {}
    for part, key in keys.items():
        tensor = tensors[key]
        tensor = tensor.unsqueeze(0) if tensor.dim() == 1 else tensor
        if tensor.dim() != 2 or tensor.shape[1] != dims[part]:
            raise ValueError(f"{where}: {path.name}'s {key} is {list(tensor.shape)}, the {part} takes "
                             f"[vectors, {dims[part]}]")
        out[part] = tensor.float()
    counts = {t.shape[0] for t in out.values()}
    if len(counts) != 1:
        raise ValueError(f"{where}: {path.name} has different vector counts per text encoder "
                         f"({', '.join(f'{keys[p]} {t.shape[0]}' for p, t in out.items())})")
    return out


def write_embedding_file(path: Path, vectors: dict[str, torch.Tensor], keys: dict[str, str], dtype: torch.dtype,
                         metadata: dict[str, str]) -> Path:
    from safetensors.torch import save_file

    tensors = {keys[part]: tensor.detach().to("cpu", dtype).contiguous() for part, tensor in vectors.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_with(path, lambda temp: save_file(tensors, str(temp), metadata=metadata))
    return path
