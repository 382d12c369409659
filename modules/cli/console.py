"""Console reporting for headless runs: a tqdm bar on a terminal, plain lines otherwise.
Everything human-readable goes to stderr; stdout is left for results (and the event protocol)."""

from __future__ import annotations

import sys

from tqdm import tqdm

from modules.saving.consumers.check import summary
from modules.trainer.callbacks import Progress, TrainCallbacks
from modules.trainer.memory_report import describe_memory


def epoch_label(p: Progress) -> str:
    """"epoch 1/N" as the GUI's status line reads it. p.epoch counts the epochs done, so the last step
    of the last epoch reports p.epoch == p.epochs: shown as N/N, not N+1/N."""
    return f"{min(p.epoch + 1, p.epochs)}/{p.epochs}"


class ConsoleCallbacks(TrainCallbacks):
    def __init__(self, stream=sys.stderr, every: int = 10):
        self.stream = stream
        self.tty = stream.isatty()
        self.every = every  # plain-line cadence in steps
        self.bar: tqdm | None = None

    def _line(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def on_started(self, total_steps: int) -> None:
        if self.tty:
            self.bar = tqdm(total=total_steps, file=self.stream, unit="step", dynamic_ncols=True)

    def on_status(self, text: str) -> None:
        self._line(f"[{text}]")

    def on_progress(self, p: Progress) -> None:
        if self.bar is not None:
            if self.bar.n == self.bar.initial == 0 and p.step > 1:
                # resumed: the steps of earlier processes count as tqdm's `initial`, so its rate
                # and ETA cover only the steps this process ran
                self.bar.initial = self.bar.n = self.bar.last_print_n = p.step - 1
            self.bar.update(p.step - self.bar.n)
            self.bar.set_postfix(epoch=epoch_label(p), loss=f"{p.loss:.4f}", lr=f"{p.lr:.2e}")
        elif p.step % self.every == 0 or p.step == p.total_steps or p.step == 1:
            eta = f"{p.eta_s:.0f}s" if p.eta_s != float("inf") else "?"
            self._line(f"step {p.step}/{p.total_steps} epoch {epoch_label(p)} loss {p.loss:.4f} "
                       f"lr {p.lr:.2e} {p.it_per_s:.2f} it/s eta {eta}")

    def on_sample(self, path: str, control_images: list[str] | None = None) -> None:
        self._line(f"sample: {path}" + (f" (from {', '.join(control_images)})" if control_images else ""))

    def on_backup(self, path: str) -> None:
        self._line(f"backup: {path}")

    def on_save(self, path: str, consumers: dict[str, dict] | None = None) -> None:
        self._line(f"saved: {path}")
        for name, result in (consumers or {}).items():
            self._line(f"  {summary(name, result)}")

    def on_validation(self, step: int, loss: float) -> None:
        self._line(f"validation loss at step {step}: {loss:.5f}")

    def on_memory(self, report: dict) -> None:
        self._line(describe_memory(report))

    def on_warning(self, message: str) -> None:
        self._line(f"warning: {message}")

    def on_error(self, message: str) -> None:
        self._line(f"error: {message}")

    def on_finished(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
