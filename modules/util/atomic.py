"""Write files so that a crash never leaves a half-written file where a good one stood.

Everything the trainer writes goes through here: write to a temp name in the same folder,
flush and fsync, then rename over the target (atomic on POSIX and on Windows via os.replace).
A full disk, a read-only folder or a refused name is raised as a UserError naming the target
(modules/errors.py recognises the ways torch and safetensors say it), never as a bare OSError.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from pathlib import Path
from typing import Callable, Iterator

from modules.errors import environment_error


def _umask() -> int:
    """The process umask, read without changing it where the OS tells it (Linux /proc), else by
    the set-and-restore that is the only portable way to read it."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _plain_file_mode() -> int:
    """What open() would have given a new file: 0o666 less the umask (mkstemp always makes 0o600)."""
    return 0o666 & ~_umask()


@contextlib.contextmanager
def atomic_path(target: str | Path) -> Iterator[Path]:
    """Yield a temp path beside `target`; on success it replaces `target`, on error it is removed."""
    target = Path(target)
    with write_errors(target):
        if target.is_dir():
            raise IsADirectoryError(errno.EISDIR, "is a folder", str(target))
        target.parent.mkdir(parents=True, exist_ok=True)
        # the temp name stays short: a long target name must fail as itself, not as its temp name
        handle, temp_name = tempfile.mkstemp(prefix=f".{target.name[:32]}.", suffix=".tmp", dir=target.parent)
    os.close(handle)
    temp = Path(temp_name)
    mode = _plain_file_mode()
    os.chmod(temp, mode)  # others may read outputs as they may any file the user writes
    try:
        with write_errors(target):
            yield temp
            # again after the writer: safetensors' save_file replaces the temp with a 0o600 file of its own
            os.chmod(temp, mode)
            with open(temp, "rb") as written:
                os.fsync(written.fileno())
            os.replace(temp, target)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def write_errors(target: str | Path) -> Iterator[None]:
    """Raise a full disk, a read-only file system, a refused permission or name while writing
    `target` as one UserError naming `target`; anything else passes unchanged."""
    try:
        yield
    except Exception as error:  # noqa: BLE001  (re-raised unless it is one of the environment's refusals)
        translated = environment_error(error, target)
        if translated is None or translated is error:
            raise
        raise translated from error


def write_bytes(target: str | Path, data: bytes) -> None:
    with atomic_path(target) as temp:
        temp.write_bytes(data)


def write_text(target: str | Path, text: str) -> None:
    write_bytes(target, text.encode("utf-8"))


def write_with(target: str | Path, writer: Callable[[Path], None]) -> None:
    """Let `writer(temp_path)` produce the file (safetensors.save_file, Image.save, torch.save)."""
    with atomic_path(target) as temp:
        writer(temp)
