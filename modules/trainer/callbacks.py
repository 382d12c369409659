"""TrainCallbacks: how a run reports what it does. The CLI prints, the JSONL protocol writes
events, the GUI queues them; the trainer only calls these methods (from the training thread)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Progress:
    step: int  # optimizer steps done
    total_steps: int
    epoch: int  # 0-based
    epochs: int
    loss: float  # mean loss of the last optimizer step
    lr: float
    it_per_s: float
    eta_s: float


class TrainCallbacks:
    def on_started(self, total_steps: int) -> None: ...

    def on_status(self, text: str) -> None: ...

    def on_progress(self, progress: Progress) -> None: ...

    def on_sample(self, path: str, control_images: list[str] | None = None) -> None:
        """A sample written; `control_images`: the files its prompt started from (an edit or
        image-to-video family's), passed only where there are some."""

    def on_backup(self, path: str) -> None: ...

    def on_save(self, path: str, consumers: dict[str, dict] | None = None) -> None:
        """A file saved; `consumers`: per tool, {"applied": n, "total": m, "dropped": [stems]}
        (modules/saving/consumers/check.py), for files whose tools' key maps are kept."""

    def on_validation(self, step: int, loss: float) -> None: ...

    def on_memory(self, report: dict) -> None:
        """Measured peaks, once after step 2 (modules/trainer/memory_report.py): {"step": n,
        "measured": {"device", "device_peak_allocated", "device_peak_reserved", "host_peak_rss",
        "host_rss"}} in bytes (None where not measurable)."""

    def on_warning(self, message: str) -> None: ...

    def on_error(self, message: str) -> None: ...

    def on_finished(self) -> None: ...


class FanOut(TrainCallbacks):
    """Every callback to several receivers (JSONL events on stdout and a log on stderr)."""

    def __init__(self, *receivers: TrainCallbacks):
        self.receivers = receivers

    def _all(self, method: str, *args) -> None:
        for receiver in self.receivers:
            getattr(receiver, method)(*args)

    def on_started(self, total_steps):
        self._all("on_started", total_steps)

    def on_status(self, text):
        self._all("on_status", text)

    def on_progress(self, progress):
        self._all("on_progress", progress)

    def on_sample(self, path, control_images=None):
        for receiver in self.receivers:  # without control images: as every receiver takes it
            if control_images is None:
                receiver.on_sample(path)
            else:
                receiver.on_sample(path, control_images=control_images)

    def on_backup(self, path):
        self._all("on_backup", path)

    def on_save(self, path, consumers=None):
        for receiver in self.receivers:  # without consumers: as every receiver takes it
            if consumers is None:
                receiver.on_save(path)
            else:
                receiver.on_save(path, consumers=consumers)

    def on_validation(self, step, loss):
        self._all("on_validation", step, loss)

    def on_memory(self, report):
        self._all("on_memory", report)

    def on_warning(self, message):
        self._all("on_warning", message)

    def on_error(self, message):
        self._all("on_error", message)

    def on_finished(self):
        self._all("on_finished")
