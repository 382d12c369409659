"""Read a pickled torch file (`.bin` weights, a backup's `state.pt`) without ever running its code.

`torch.load(weights_only=True)` refuses a pickle that names anything beyond tensors and plain
containers, with a long message about allow-listing globals: the wrong advice for a file from
the internet. This says what the file is and what to do instead, naming the file; a truncated or
non-torch file gets one line too.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any

import torch

from modules.errors import UserError


class TorchFileError(UserError, ValueError):
    pass


def load_weights_only(path: str | Path, where: str, **kwargs: Any) -> Any:
    """torch.load(path, weights_only=True, **kwargs), its refusals raised as TorchFileError."""
    path = Path(path)
    try:
        return torch.load(path, weights_only=True, **{"map_location": "cpu", **kwargs})
    except pickle.UnpicklingError as error:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(error))
        named = f" (it names {found.group(1)})" if found else ""
        raise TorchFileError(
            f"{where}: {path} holds Python objects beyond tensors{named}; it is not loaded, since "
            "unpickling it could run code. Use a .safetensors file instead (or convert this one where you "
            "trust it)") from None
    except (RuntimeError, EOFError) as error:  # the zip reader's "failed finding central directory", ...
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise TorchFileError(f"{where}: {path} is truncated or not a torch file ({first_line})") from None
