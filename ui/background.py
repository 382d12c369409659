"""Work off the Tk thread: reading a folder of a thousand images (headers, captions, thumbnails)
takes seconds, and the window must not freeze for it.

`BackgroundJobs(widget)` runs each submitted function on one worker thread and hands its result
to a callback on the Tk main thread (polled with `after`, the only way results reach widgets).
Jobs carry a key: a newer job with the same key makes an older one's result stale, so it is
dropped (a concept's folder typed letter by letter scans once per pause, and only the last scan's
result is shown). `ThumbnailCache` makes and keeps small PIL images by (path, size, mtime).
"""

from __future__ import annotations

import gc
import queue
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable

POLL_MS = 40


class BackgroundJobs:
    def __init__(self, widget):
        self.widget = widget
        self._todo: queue.Queue = queue.Queue()
        self._done: queue.Queue = queue.Queue()
        self._latest: dict[Any, int] = {}  # key -> the serial of its newest job
        self._serial = 0
        self._polling = False
        self._thread = threading.Thread(target=self._work, name="gui-background", daemon=True)
        self._thread.start()

    def submit(self, key, function: Callable[[], Any], done: Callable[[Any], None],
               failed: Callable[[BaseException], None] | None = None) -> None:
        """Run `function()` on the worker; then `done(result)` (or `failed(error)`) on the Tk thread,
        unless a newer job with the same `key` was submitted meanwhile."""
        self._serial += 1
        self._latest[key] = self._serial
        self._todo.put((key, self._serial, function, done, failed))
        if not self._polling:
            self._polling = True
            self.widget.after(POLL_MS, self._poll)

    @property
    def busy(self) -> bool:
        return bool(self._latest)

    def _work(self) -> None:
        while True:
            key, serial, function, done, failed = self._todo.get()
            if self._latest.get(key) != serial:
                continue  # superseded before it started
            hold_collector(self)  # (see hold_collector)
            try:
                self._done.put((key, serial, True, function(), done, failed))
            except Exception as error:  # noqa: BLE001  (handed to the Tk thread, shown there)
                self._done.put((key, serial, False, error, done, failed))

    def _poll(self) -> None:
        try:
            if not self.widget.winfo_exists():
                release_collector(self)
                return
        except Exception:  # noqa: BLE001  (the window is gone: nothing to deliver to)
            release_collector(self)
            return
        while True:
            try:
                key, serial, ok, value, done, failed = self._done.get_nowait()
            except queue.Empty:
                break
            if self._latest.get(key) != serial:
                continue
            del self._latest[key]
            if ok:
                done(value)
            elif failed is not None:
                failed(value)
            else:
                raise value
        if self._latest:
            self.widget.after(POLL_MS, self._poll)
        else:  # every job delivered: the worker is idle
            self._polling = False
            release_collector(self)


# A job allocates a lot (a thousand file names and headers), so the cyclic garbage collector would
# run on the worker and finalize there the Tk objects of widgets destroyed meanwhile (a rebuilt
# concept list): a tkinter Variable finalized off the Tk thread waits for the Tk thread to do it
# (~1 s each, then fails, when the Tk thread is not in mainloop but in update()). So while any
# worker has jobs, automatic collection is off; the Tk thread turns it back on once every job is
# delivered, and its own next allocation collects there.
_collector_lock = threading.Lock()
_collector_holders: set = set()
_collector_was_enabled = False


def hold_collector(owner) -> None:
    global _collector_was_enabled
    with _collector_lock:
        if not _collector_holders:
            _collector_was_enabled = gc.isenabled()
            gc.disable()
        _collector_holders.add(owner)


def release_collector(owner) -> None:
    with _collector_lock:
        if owner not in _collector_holders:
            return
        _collector_holders.discard(owner)
        if not _collector_holders and _collector_was_enabled:
            gc.enable()


class ThumbnailCache:
    """PIL thumbnails (RGB, fitting `size` x `size`), kept for the most recent `capacity` files and
    made again when a file changes (its mtime or size). Thread-safe: made on a worker thread,
    turned into a Tk image on the main thread."""

    def __init__(self, capacity: int = 512):
        self.capacity = capacity
        self._lock = threading.Lock()
        self._images: OrderedDict = OrderedDict()

    def cached(self, path: str | Path, size: int):
        """The thumbnail if it is made already and the file did not change since, else None."""
        try:
            key = self._key(Path(path), size)
        except OSError:
            return None
        with self._lock:
            if key in self._images:
                self._images.move_to_end(key)
                return self._images[key]
        return None

    @staticmethod
    def _key(path: Path, size: int) -> tuple:
        stat = path.stat()
        return str(path), size, stat.st_mtime_ns, stat.st_size

    def get(self, path: str | Path, size: int):
        """The thumbnail, from the cache or made now; raises OSError for an unreadable image."""
        from PIL import Image, ImageOps

        path = Path(path)
        key = self._key(path, size)
        with self._lock:
            if key in self._images:
                self._images.move_to_end(key)
                return self._images[key]
        with Image.open(path) as image:
            image.draft("RGB", (size, size))  # a JPEG decodes at a fraction of its size: far faster
            image = ImageOps.exif_transpose(image).convert("RGB")
            image.thumbnail((size, size))
        with self._lock:
            self._images[key] = image
            while len(self._images) > self.capacity:
                self._images.popitem(last=False)
        return image


THUMBNAILS = ThumbnailCache()  # one per window process: cards, the concept window and the preview share it
