"""Run: the live loss curve, the latest samples (each with its step and prompt, and the control images its
prompt started from beside it, labelled "control"), and the run's log.
After a resume or a reopen, the curve and gallery start from what the earlier runs left
(ui/run_history.py)."""

from __future__ import annotations

from pathlib import Path

import customtkinter as ctk

from modules.sampling.video_writer import video_of_poster
from ui.components import ERROR_COLOR
from ui.image_list import picture_of, short_name
from ui.video_playback import FramePlayer, open_with_system, read_frames

GALLERY_SIZE = 4
THUMB = 160
CONTROL_THUMB = 56
LOG_LINES = 2000


class RunTab(ctk.CTkFrame):
    def __init__(self, parent, app):
        super().__init__(parent, fg_color="transparent")
        self.pack(fill="both", expand=True)
        self.app = app
        self.columnconfigure(0, weight=3)
        self.columnconfigure(1, weight=2)
        self.rowconfigure(0, weight=3)
        self.rowconfigure(2, weight=2)

        from matplotlib.backends.backend_tkagg import FigureCanvasTkAgg
        from matplotlib.figure import Figure

        # the figure canvas asks for the size it was last given, so its frame does not pass that on:
        # otherwise the plot never shrinks and pushes the log out at small sizes
        plot = ctk.CTkFrame(self, height=120)
        plot.pack_propagate(False)
        plot.grid(row=0, column=0, sticky="nsew", padx=4, pady=4)
        dark = ctk.get_appearance_mode() == "Dark"
        background, text = ("#2b2b2b", "#dce4ee") if dark else ("#dbdbdb", "#1a1a1a")
        self.figure = Figure(figsize=(5, 3), dpi=90, facecolor=background)
        self.axes = self.figure.add_subplot(111, facecolor=background)
        self.axes.set_title("loss", color=text)
        self.axes.set_xlabel("step", color=text)
        self.axes.tick_params(colors=text)
        for spine in self.axes.spines.values():
            spine.set_color(text)
        self.axes.grid(True, alpha=0.2)
        (self.line,) = self.axes.plot([], [], color="#4a9eda", linewidth=1.4, markersize=5)
        # before the first step there is nothing to scale the axes to: a line of text instead
        self.placeholder = self.figure.text(0.5, 0.5, "The loss curve appears here after the first step.",
                                            ha="center", va="center", color=text)
        self.figure.tight_layout()
        self.canvas = FigureCanvasTkAgg(self.figure, master=plot)
        # a small requested size: the figure follows the space the window gives it
        self.canvas.get_tk_widget().configure(width=200, height=100)
        self.canvas.get_tk_widget().pack(fill="both", expand=True)
        self.steps: list[int] = []
        self.losses: list[float] = []
        self.redraws = 0
        self._redraw_job = None
        self._redraw()

        gallery = ctk.CTkFrame(self)
        gallery.grid(row=0, column=1, sticky="nsew", padx=4, pady=4)
        ctk.CTkLabel(gallery, text="Latest samples", font=ctk.CTkFont(weight="bold")).pack(anchor="w", padx=8, pady=4)
        self.gallery = ctk.CTkFrame(gallery, fg_color="transparent")
        self.gallery.pack(fill="both", expand=True)
        self.samples: list[str] = []
        self.sample_info: dict[str, dict] = {}
        self.players: dict = {}  # poster path -> FramePlayer of its video, once played
        self._images = []
        self.controls_shown: dict[str, list[str]] = {}  # sample path -> the control images shown beside it
        self._empty = ctk.CTkLabel(self.gallery, text="Samples appear here while training.")
        self._empty.pack(padx=8, pady=8)

        # the run's measured memory after step 2 beside its plan (the `memory` event): one line
        self.memory_line = ctk.CTkLabel(self, text="", anchor="w", font=ctk.CTkFont(size=11))
        self.memory_line.grid(row=1, column=0, columnspan=2, sticky="ew", padx=8)
        self.memory_line.grid_remove()  # (shown with its first report: no empty row before)
        # a small requested height: at 900x600 and 150% the plot keeps its share of the space
        self.log = ctk.CTkTextbox(self, wrap="none", height=60, font=ctk.CTkFont(family="monospace", size=11))
        self.log.grid(row=2, column=0, columnspan=2, sticky="nsew", padx=4, pady=4)
        self.log.configure(state="disabled")
        self.log_lines = 0

    def clear(self) -> None:
        self.memory_line.configure(text="")
        self.memory_line.grid_remove()
        self.steps, self.losses = [], []
        self._redraw()
        self.samples = []
        self.sample_info = {}
        self._show_samples()
        self.log.configure(state="normal")
        self.log.delete("1.0", "end")
        self.log.configure(state="disabled")
        self.log_lines = 0

    def add_loss(self, step: int, loss: float | None) -> None:
        if loss is None:
            return
        if self.steps and self.steps[-1] >= step:  # a resumed run retrains from its backup's step
            while self.steps and self.steps[-1] >= step:
                self.steps.pop()
                self.losses.pop()
            self.samples = [p for p in self.samples if (self.sample_info.get(p) or {}).get("step") is None
                            or self.sample_info[p]["step"] < step]
            self._show_samples()
        self.steps.append(step)
        self.losses.append(loss)
        if self._redraw_job is None:  # at most a few redraws a second, however fast steps come
            self._redraw_job = self.after(250, self._redraw)

    def _redraw(self) -> None:
        self._redraw_job = None
        empty = not self.steps
        self.axes.set_visible(not empty)
        self.placeholder.set_visible(empty)
        # one point is no line: a dot, so a one-step run still shows its loss
        self.line.set_marker("o" if len(self.steps) == 1 else "")
        self.line.set_data(self.steps, self.losses)
        self.axes.relim()
        self.axes.autoscale_view()
        self.canvas.draw_idle()
        self.redraws += 1

    def load_history(self, history) -> None:
        """The curve and samples of earlier runs (a resume continues them; a reopen shows them)."""
        self.steps = [step for step, _ in history.losses]
        self.losses = [loss for _, loss in history.losses]
        self._redraw()
        self.samples = [s["path"] for s in history.samples]
        self.sample_info = {s["path"]: s for s in history.samples}
        self._show_samples()

    def add_sample(self, path: str, info: dict | None = None) -> None:
        self.samples.append(path)
        self.sample_info[path] = info or {"path": path, "step": None, "prompt": None}
        self._show_samples()

    def caption(self, path: str) -> str:
        info = self.sample_info.get(path) or {}
        step = f"step {info['step']}" if info.get("step") is not None else Path(path).name
        prompt = info.get("prompt")
        if prompt and len(prompt) > 40:
            prompt = prompt[:39] + "…"
        return f"{step}: {prompt}" if prompt else step

    def _show_samples(self) -> None:
        for player in self.players.values():
            player.stop()
        self.players = {}
        for child in self.gallery.winfo_children():
            child.destroy()
        self._images = []
        self.controls_shown = {}
        if not self.samples:
            self._empty = ctk.CTkLabel(self.gallery, text="Samples appear here while training.", wraplength=150)
            self._empty.pack(padx=8, pady=8)
            return
        from PIL import Image

        for column, path in enumerate(reversed(self.samples[-GALLERY_SIZE:])):
            try:
                with Image.open(path) as image:
                    image = image.convert("RGB")
                    scale = THUMB / max(image.size)
                    size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
                    picture = ctk.CTkImage(light_image=image.copy(), dark_image=image.copy(), size=size)
            except OSError:
                continue
            self._images.append(picture)
            outer = ctk.CTkFrame(self.gallery, fg_color="transparent")
            outer.grid(row=column // 2, column=column % 2, padx=4, pady=4)
            self._controls(outer, path)
            cell = ctk.CTkFrame(outer, fg_color="transparent")
            cell.pack(side="left", anchor="n")
            shown = ctk.CTkLabel(cell, text="", image=picture)
            shown.pack()
            ctk.CTkLabel(cell, text=self.caption(path), font=ctk.CTkFont(size=11), wraplength=THUMB).pack()
            video = video_of_poster(Path(path))
            if video is not None:
                self._video_buttons(cell, shown, picture, path, video)

    def _controls(self, outer, path: str) -> None:
        """The control images the sample was made from, small, in a column left of it."""
        controls = (self.sample_info.get(path) or {}).get("control_images") or []
        if not controls:
            return
        column = ctk.CTkFrame(outer, fg_color="transparent")
        column.pack(side="left", anchor="n", padx=(0, 4))
        ctk.CTkLabel(column, text="control", font=ctk.CTkFont(size=10)).pack()
        for control in controls:
            picture = picture_of(control, CONTROL_THUMB)
            if picture is None:  # moved or deleted since: named, in red
                ctk.CTkLabel(column, text=f"missing:\n{short_name(control, 10)}", text_color=ERROR_COLOR,
                             font=ctk.CTkFont(size=10), width=CONTROL_THUMB).pack(pady=1)
                continue
            self._images.append(picture)
            ctk.CTkLabel(column, text="", image=picture).pack(pady=1)
        self.controls_shown[path] = list(controls)

    def _video_buttons(self, cell, shown, poster, path: str, video: Path) -> None:
        """Play (in the cell, at thumbnail size) and Open (the system's player) under a video's poster."""
        row = ctk.CTkFrame(cell, fg_color="transparent")
        row.pack()
        play = ctk.CTkButton(row, text="\u25b6 Play", width=70, height=24)
        play.configure(command=lambda: self._toggle_video(path, video, shown, poster, play))
        play.pack(side="left", padx=2)
        ctk.CTkButton(row, text="Open", width=60, height=24,
                      command=lambda: self._open_video(video)).pack(side="left", padx=2)

    def _toggle_video(self, path: str, video: Path, shown, poster, button) -> None:
        player = self.players.get(path)
        if player is not None and player.playing:
            player.stop()
            shown.configure(image=poster)
            button.configure(text="\u25b6 Play")
            return
        if player is None:
            try:
                frames, fps = read_frames(video, THUMB)
            except Exception as error:  # an unreadable or half-written file: said, the poster stays
                self.app.set_status(f"Cannot play {video.name}: {error}")
                return
            if not frames:
                self.app.set_status(f"Cannot play {video.name}: it has no frames")
                return
            images = [ctk.CTkImage(light_image=frame, dark_image=frame, size=frame.size) for frame in frames]
            player = self.players[path] = FramePlayer(shown, images, fps)
        player.start()
        button.configure(text="\u25a0 Stop")

    def _open_video(self, video: Path) -> None:
        problem = open_with_system(video)
        if problem:
            self.app.set_status(problem[:1].upper() + problem[1:])

    def show_memory(self, report: dict) -> None:
        from modules.trainer.memory_report import describe_memory

        text = describe_memory(report)
        self.memory_line.configure(text=text[:1].upper() + text[1:])
        self.memory_line.grid()

    def append_log(self, text: str) -> None:
        self.log.configure(state="normal")
        self.log.insert("end", text.rstrip("\n") + "\n")
        self.log_lines += 1
        if self.log_lines > LOG_LINES:
            self.log.delete("1.0", f"{self.log_lines - LOG_LINES + 1}.0")
            self.log_lines = LOG_LINES
        self.log.see("end")
        self.log.configure(state="disabled")

    def log_text(self) -> str:
        return self.log.get("1.0", "end-1c")
