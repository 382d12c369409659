"""The memory plan of the config in the window, before Start (issue 25 item 3).

A bar per model part (its bytes on the train device, and beside them the bytes parked in RAM by
offloading) and a total bar (the planned device peak against the budget, the rest free), the
verdict, what `auto` picked, the host's figures, and the `--set` lines that make a config fit.
The plan comes from `launch.py plan --json` (ui/plan_worker.py) run off the Tk thread; each edit
asks for a new one after a pause (`DEBOUNCE_MS`), so typing a number plans once; only while the
panel is in view (a hidden panel plans when it is shown again, and costs nothing). After step 2 of
a run the measured peaks (the `memory` event) are drawn on the total bar next to the plan.
Widgets are touched only here, from the Tk main thread (`after`).
"""

from __future__ import annotations

import tkinter as tk

import customtkinter as ctk

from ui.components import ERROR_COLOR
from ui.plan_worker import PlanWorker

DEBOUNCE_MS = 600
POLL_MS = 150
ROW_HEIGHT = 22
NAME_WIDTH = 150
COLORS = {"device": "#3b8ed0", "parked": "#7b8794", "free": "#2f3b45", "over": "#c0392b", "measured": "#f0c419",
          "budget": "#e8e8e8", "text": "#dce4ee"}
FITS_COLOR = ("#2e7d32", "#66bb6a")
LEGEND = ("blue: on the train device   grey: parked in RAM (offloaded)   dark: free   red: over the budget   "
          "dashed line: the budget   yellow mark: the last run's measured peak")


def gib(size: int | float | None) -> str:
    return "?" if size is None else f"{size / 2**30:.2f} GiB"


def verdict_text(plan: dict) -> str:
    device = plan.get("device") or {}
    peak, budget = device.get("peak"), device.get("budget")
    where = peak_phase(device)
    if plan.get("fits") is None:
        return f"Planned device peak {gib(peak)}{where}; no device budget known here (the CPU), so no verdict."
    word = "Fits" if plan["fits"] else "Does not fit"
    return f"{word}: planned device peak {gib(peak)}{where} of a {gib(budget)} budget."


def peak_phase(device: dict) -> str:
    """ " (while caching)" where a phase outside the training step sets the peak (the bars show the step)."""
    phases = device.get("outside_step_phases") or {}
    if not phases or max(phases.values()) <= (device.get("step") or 0):
        return ""
    return f" (while {max(phases, key=phases.get)})"


def part_line(name: str, part: dict) -> str:
    device = part.get("device") or {}
    pieces = ", ".join(f"{label} {gib(device.get(key))}" for key, label in (
        ("weights", "weights"), ("trained", "trained"), ("gradients", "gradients"),
        ("optimizer_state", "optimizer"), ("activations", "activations"), ("offload_window", "window"))
        if device.get(key))
    settings = (f"{part.get('weight_dtype')}, offload {part.get('offload_fraction', 0):.2f}"
                f"{', checkpointed' if part.get('gradient_checkpointing') else ''}"
                f"{', trained' if part.get('train') else ''}")
    return f"{name} ({settings}): {gib(device.get('total'))} on the device ({pieces or 'nothing'}); " \
           f"{gib(part.get('parked'))} parked in RAM"


def host_line(plan: dict) -> str:
    host, budget = plan.get("host") or {}, (plan.get("budget") or {}).get("ram")
    text = (f"Host RAM: {gib(host.get('load_peak'))} while loading, {gib(host.get('train_peak'))} while "
            f"training ({gib(host.get('pinned'))} pinned)")
    return text + (f", of {gib(budget)} available." if budget else ".")


def transfer_line(plan: dict) -> str:
    transfer = plan.get("transfer") or {}
    text = f"Moves {gib(transfer.get('bytes_per_step'))} between host and device per step"
    seconds = transfer.get("seconds_per_step")
    if seconds is not None:
        text += (f"; about {seconds:.2f} s per step on a {transfer.get('gpu_class')}"
                 f"{' (estimated)' if transfer.get('estimated') else ''}")
    return text + "."


def auto_lines(plan: dict) -> list[str]:
    return [f"auto: {path} = {choice.get('value')} ({choice.get('why')})"
            for path, choice in (plan.get("auto") or {}).items()]


class PlanPanel(ctk.CTkFrame):
    def __init__(self, parent, app, worker: PlanWorker | None = None):
        super().__init__(parent)
        self.app, self.cfg = app, app.cfg
        self.worker = worker or PlanWorker()
        self.plan: dict | None = None  # the plan shown
        self.measured: dict | None = None  # the last run's memory event, drawn on the total bar
        self.rows: list[tuple[str, int, int]] = []  # what the bars show: (name, on the device, parked)
        self._asked_for: tuple | None = None  # the config JSON and options last sent to the worker
        self._debounce = None
        self._polling = False
        header = ctk.CTkFrame(self, fg_color="transparent")
        header.pack(fill="x", padx=8, pady=(6, 0))
        ctk.CTkLabel(header, text="Memory plan", font=ctk.CTkFont(weight="bold")).pack(side="left")
        self.state_label = ctk.CTkLabel(header, text="", anchor="w")
        self.state_label.pack(side="left", padx=12)
        # a budget of the user's: the GPU of a remote box, or one this machine does not have
        self.budget = tk.StringVar(value="")
        ctk.CTkLabel(header, text="GiB").pack(side="right")
        self.budget_entry = ctk.CTkEntry(header, textvariable=self.budget, width=60)
        self.budget_entry.pack(side="right", padx=4)
        ctk.CTkLabel(header, text="Plan for GPU memory (empty: the train device's free memory)").pack(side="right")
        self.budget.trace_add("write", lambda *_: self.config_changed())
        self.verdict = ctk.CTkLabel(self, text="", anchor="w", justify="left", wraplength=700)
        self.verdict.pack(fill="x", padx=8)
        self.canvas = tk.Canvas(self, height=ROW_HEIGHT * 2, highlightthickness=0, background="#242424")
        self.canvas.pack(fill="x", padx=8, pady=4)
        self.canvas.bind("<Configure>", lambda _event: self._draw_bars())
        ctk.CTkLabel(self, text=LEGEND, anchor="w", font=ctk.CTkFont(size=11)).pack(fill="x", padx=8)
        self.details = ctk.CTkLabel(self, text="", anchor="w", justify="left", wraplength=700,
                                    font=ctk.CTkFont(size=11))
        self.details.pack(fill="x", padx=8)
        self.fixes = ctk.CTkLabel(self, text="", anchor="w", justify="left", wraplength=700,
                                  font=ctk.CTkFont(family="monospace", size=11))
        self.fixes.pack(fill="x", padx=8, pady=(0, 6))
        self.cfg.validate_listeners.append(self.config_changed)
        # built when its tab is first shown or used (ui/lazy_tabs.py), after the window's first
        # validation: plan the config as it stands now, not only after the next edit
        self.after_idle(self.config_changed)
        # (on the plain canvas: a CTkFrame binds events to an inner canvas of its own)
        self.canvas.bind("<Destroy>", self._destroyed, add="+")

    # --- asking for a plan -------------------------------------------------------------------

    def config_changed(self) -> None:
        """After each validation: plan the config once the edits pause (a config that does not
        validate has no plan: its problems are under its fields)."""
        if self._debounce is not None:
            self.after_cancel(self._debounce)
            self._debounce = None
        if self.cfg.config is None:
            self._asked_for = None
            self.state_label.configure(text="fix the config's problems to see its plan")
            return
        self._debounce = self.after(DEBOUNCE_MS, self._ask)

    def _ask(self) -> None:
        self._debounce = None
        if self.cfg.config is None:
            return
        if not self.winfo_viewable():  # out of view (another tab): looked at again until shown
            self._debounce = self.after(DEBOUNCE_MS, self._ask)
            return
        options = self.budget_options()
        if options is None:
            self.state_label.configure(text=f"the GPU memory to plan for is a number of GiB, not {self.budget.get()!r}")
            return
        asked = (self.cfg.config_json(), options)
        if asked == self._asked_for:
            return
        self._asked_for = asked
        self.worker.request(*asked)
        self.state_label.configure(text="planning…")
        if not self._polling:
            self._polling = True
            self.after(POLL_MS, self._poll)

    def budget_options(self) -> tuple[str, ...] | None:
        """`launch.py plan`'s arguments for the budget typed in (none when empty; None when it is not
        a positive number)."""
        text = self.budget.get().strip()
        if not text:
            return ()
        try:
            value = float(text)
        except ValueError:
            return None
        return ("--vram", f"{value:g}GiB") if value > 0 else None

    def _poll(self) -> None:
        results = self.worker.drain()
        newest = [r for r in results if r[0] == self.worker.requested]
        if newest:
            _, kind, payload = newest[-1]
            if kind == "ok":
                self.show(payload)
                self.state_label.configure(text="of the config as it stands")
            else:
                self.state_label.configure(text=f"no plan: {payload}")
        if self.worker.busy:
            self.after(POLL_MS, self._poll)
        else:
            self._polling = False

    # --- showing it ----------------------------------------------------------------------------

    def show(self, plan: dict) -> None:
        self.plan = plan
        fits = plan.get("fits")
        self.verdict.configure(text=verdict_text(plan),
                               text_color=ERROR_COLOR if fits is False else FITS_COLOR if fits else ("gray10", "gray90"))
        parts = plan.get("parts") or {}
        lines = [part_line(name, part) for name, part in parts.items()]
        lines += [host_line(plan), transfer_line(plan), *auto_lines(plan)]
        self.details.configure(text="\n".join(lines))
        fixes = plan.get("fixes") or []
        self.fixes.configure(text=("To fit, change:\n" + "\n".join(f"  {fix}" for fix in fixes)) if fixes else "")
        self.rows = [(name, int((part.get("device") or {}).get("total") or 0), int(part.get("parked") or 0))
                     for name, part in parts.items()]
        self._draw_bars()

    def show_measured(self, report: dict) -> None:
        """A run's `memory` event: its device peak marked on the total bar."""
        self.measured = report
        self._draw_bars()

    def _draw_bars(self) -> None:
        canvas = self.canvas
        canvas.delete("all")
        if self.plan is None:
            return
        device = self.plan.get("device") or {}
        peak, budget = int(device.get("peak") or 0), device.get("budget")
        measured = ((self.measured or {}).get("measured") or {}).get("device_peak_allocated")
        rows = [*self.rows, ("total", peak, 0)]
        canvas.configure(height=ROW_HEIGHT * len(rows) + 4)
        width = max(canvas.winfo_width(), 300) - NAME_WIDTH - 8
        scale_to = max([budget or 0, peak, measured or 0, *(on + parked for _, on, parked in self.rows)]) or 1
        x0 = NAME_WIDTH

        def x(size: float) -> float:
            return x0 + width * size / scale_to

        for row, (name, on_device, parked) in enumerate(rows):
            top, bottom = row * ROW_HEIGHT + 4, row * ROW_HEIGHT + ROW_HEIGHT - 2
            canvas.create_text(4, (top + bottom) / 2, text=name, anchor="w", fill=COLORS["text"])
            if name == "total" and budget:
                within = min(on_device, budget)
                canvas.create_rectangle(x0, top, x(within), bottom, fill=COLORS["device"], width=0)
                if on_device > budget:
                    canvas.create_rectangle(x(budget), top, x(on_device), bottom, fill=COLORS["over"], width=0)
                else:
                    canvas.create_rectangle(x(on_device), top, x(budget), bottom, fill=COLORS["free"], width=0)
                label = f"{gib(on_device)} of {gib(budget)}" + (f", {gib(budget - on_device)} free"
                                                                  if on_device <= budget else "")
            else:
                canvas.create_rectangle(x0, top, x(on_device), bottom, fill=COLORS["device"], width=0)
                if parked:
                    canvas.create_rectangle(x(on_device), top, x(on_device + parked), bottom,
                                            fill=COLORS["parked"], width=0, stipple="gray50")
                label = gib(on_device) + (f" + {gib(parked)} parked" if parked else "")
            if name == "total" and measured is not None:
                canvas.create_line(x(measured), top - 2, x(measured), bottom + 2, fill=COLORS["measured"], width=3)
                label += f"; measured {gib(measured)}"
            canvas.create_text(x0 + 4, (top + bottom) / 2, text=label, anchor="w", fill=COLORS["text"])
        if budget:
            canvas.create_line(x(budget), 0, x(budget), ROW_HEIGHT * len(rows) + 4, fill=COLORS["budget"], dash=(3, 2))

    def _destroyed(self, event) -> None:
        if event.widget is self.canvas:
            if self.config_changed in self.cfg.validate_listeners:
                self.cfg.validate_listeners.remove(self.config_changed)
            self.worker.close()
