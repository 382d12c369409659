"""The one base class for errors that are the user's input's fault.

`launch.py` and the GUI catch `UserError` and show its message alone (no traceback unless
`--debug`); anything else is a bug and keeps its traceback. Each error class of a module
(ConfigError, ModelLoadError, DataError, ...) derives from it, so a new one needs no list edit.
"""

from __future__ import annotations

import errno
import os


class UserError(Exception):
    """An input that cannot be used: a config value, a file, a folder, a device, a machine limit.

    `field` names the dotted config path at fault where there is one (`output.path`).
    """

    def __init__(self, message: str = "", *, field: str | None = None):
        self.field = field
        if field and message and not message.startswith(field):
            message = f"{field}: {message}"
        super().__init__(message)


class DiskFullError(UserError):
    """A write ran out of space (or quota) on its file system."""


class NotWritableError(UserError):
    """A write the file system refused: read-only, no permission, a name too long."""


_DISK_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_REFUSED = {errno.EROFS: "read-only file system", errno.EACCES: "permission denied",
            errno.EPERM: "permission denied", errno.ENAMETOOLONG: "file name too long",
            errno.EISDIR: "it is a folder", errno.ENOTDIR: "a part of the path is a file, not a folder"}


def environment_error(error: BaseException, path: str | os.PathLike | None = None) -> UserError | None:
    """The user-facing form of an error the machine raised while writing `path`: disk full,
    read-only file system, no permission, a name too long. None for anything else (a bug keeps
    its traceback).

    Besides OSError, two libraries report a full disk in their own words: torch.save's C++ zip
    writer (`[enforce fail at inline_container.cc:...] . unexpected pos N vs M`, or `... file
    write failed`: a short write, which is a full disk or quota in practice) and safetensors
    (`SafetensorError: Error while serializing: I/O error: No space left on device (os error 28)`).
    """
    if isinstance(error, UserError):
        return error
    where = str(path) if path is not None else None
    if isinstance(error, OSError) and error.errno is not None:
        if error.errno in _DISK_FULL_ERRNOS or error.errno == errno.EROFS:  # only writes meet these
            target = f"cannot write {where or error.filename or ''}".rstrip()
            if error.errno == errno.EROFS:
                return NotWritableError(f"{target}: {_REFUSED[error.errno]}")
            return DiskFullError(f"disk full: {target} ({error.strerror}); free some space and run again")
        if error.errno in _REFUSED:
            # `path` is given where a write failed; from launch.py's last net it may have been a read
            target = f"cannot write {where}" if where else (error.filename or "a file")
            return NotWritableError(f"{target}: {_REFUSED[error.errno]}")
        return None
    text = str(error)
    if type(error).__name__ == "SafetensorError" and ("os error 28" in text or "No space left" in text):
        return DiskFullError(f"disk full: cannot write {where or 'a safetensors file'} ({text}); "
                             "free some space and run again")
    if isinstance(error, RuntimeError) and "inline_container.cc" in text and (
            "unexpected pos" in text or "write failed" in text or "failed writing" in text):
        return DiskFullError(f"disk full: cannot write {where or 'a torch file'} (torch.save stopped short: "
                             f"{text.strip()}); free some space and run again")
    return None
