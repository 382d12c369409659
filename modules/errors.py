"""The one base class for errors that are the user's input's fault.

`launch.py` and the GUI catch `UserError` and show its message alone (no traceback unless
`--debug`); anything else is a bug and keeps its traceback. Each error class of a module
(ConfigError, ModelLoadError, DataError, ...) derives from it, so a new one needs no list edit.
"""

from __future__ import annotations


class UserError(Exception):
    """An input that cannot be used: a config value, a file, a folder, a device, a machine limit.

    `field` names the dotted config path at fault where there is one (`output.path`).
    """

    def __init__(self, message: str = "", *, field: str | None = None):
        self.field = field
        if field and message and not message.startswith(field):
            message = f"{field}: {message}"
        super().__init__(message)
