"""A model the user names for labelling: a local folder in transformers' layout (config.json,
weights, processor files). Read without torch, so a wrong folder is refused before any model loads."""

from __future__ import annotations

import json
from pathlib import Path

from modules.errors import UserError


class LabelModelError(UserError):
    """A model folder that cannot label images: missing, not a transformers folder, the wrong kind."""


def model_config(folder: str | Path, option: str = "--model") -> dict:
    """The folder's config.json as a dict; one message naming the folder when it is not usable."""
    path = Path(folder).expanduser()
    if not path.is_dir():
        hint = (f" (a Hugging Face hub id is fetched only when asked: python launch.py download-model {folder}, "
                "or Download in the dialog)"
                if "/" in str(folder) and not path.exists() and not str(folder).startswith(("/", ".", "~")) else "")
        raise LabelModelError(f"{path} is not a folder{hint}", field=option)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise LabelModelError(f"{path} has no config.json: not a transformers model folder", field=option)
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise LabelModelError(f"{config_file} cannot be read as JSON ({error})", field=option) from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise LabelModelError(f"{config_file} names no model_type: not a transformers model config", field=option)
    return config


def has_chat_template(folder: str | Path) -> bool:
    """Whether the folder's processor or tokenizer carries a chat template (files as transformers saves them)."""
    path = Path(folder)
    if (path / "chat_template.jinja").is_file() or (path / "chat_template.json").is_file():
        return True
    for name in ("processor_config.json", "tokenizer_config.json"):
        try:
            if json.loads((path / name).read_text(encoding="utf-8")).get("chat_template"):
                return True
        except (OSError, UnicodeDecodeError, ValueError, AttributeError):
            continue
    return False
