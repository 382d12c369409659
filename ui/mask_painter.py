"""Painting an image's loss mask by hand, in a window of its own from the dataset tool.

The mask is white where training counts the image (weight 1) and black where it weights it by the
concept's `unmasked_weight` (modules/data/masks.py); an image without a mask trains everywhere, so
a new mask starts white. Shown over the image: the black part tinted red. Tools: the brush paints
white, the eraser black, fill floods the connected area under the click with white (left button)
or black (right button). The stroke width is the brush size in image pixels. Saved atomically as
`<image stem>-masklabel.png` (Save or Ctrl+S), the file masked training reads first."""

from __future__ import annotations

import tkinter as tk
from pathlib import Path
from typing import Callable

import customtkinter as ctk

from modules.autolabel.images import mask_file
from modules.data.mask_files import mask_path
from modules.util.atomic import write_with
from ui.components import centre_over

VIEW = 512  # the longest side the image is shown at, in canvas pixels
TOOLS = ("brush", "eraser", "fill")
TINT = (220, 40, 40)  # over the black (not trained) part


def starting_mask(image: Path, size: tuple[int, int]):
    """The image's mask as it stands (any suffix masked training reads), at the image's size, or all white."""
    from PIL import Image

    path = mask_path(image)
    if path is not None:
        try:
            with Image.open(path) as opened:
                return opened.convert("L").resize(size, Image.Resampling.NEAREST)
        except OSError:
            pass
    return Image.new("L", size, 255)


class MaskPainter(ctk.CTkToplevel):
    def __init__(self, master, image: str | Path, on_saved: Callable[[Path], None] = lambda path: None):
        from PIL import Image

        super().__init__(master)
        self.image_path, self.on_saved = Path(image), on_saved
        self.title(f"Mask: {self.image_path.name}")
        with Image.open(self.image_path) as opened:
            self.picture = opened.convert("RGB")
        self.mask = starting_mask(self.image_path, self.picture.size)
        self.scale = VIEW / max(self.picture.size)  # big images shown smaller, small ones bigger to paint on
        self.view_size = (max(1, round(self.picture.width * self.scale)), max(1, round(self.picture.height * self.scale)))
        self.changed = False
        self._last: tuple[int, int] | None = None

        bar = ctk.CTkFrame(self, fg_color="transparent")
        bar.pack(fill="x", padx=8, pady=(8, 2))
        self.tool_var = tk.StringVar(self, value="brush")
        ctk.CTkSegmentedButton(bar, values=list(TOOLS), variable=self.tool_var).pack(side="left")
        ctk.CTkLabel(bar, text="Size").pack(side="left", padx=(12, 4))
        self.size_var = tk.IntVar(self, value=max(2, max(self.picture.size) // 24))
        ctk.CTkSlider(bar, from_=1, to=max(8, max(self.picture.size) // 4), variable=self.size_var,
                      width=140).pack(side="left")
        ctk.CTkButton(bar, text="Save", width=80, command=self.save).pack(side="right", padx=2)
        ctk.CTkButton(bar, text="All white", width=80, command=lambda: self._fill_all(255)).pack(side="right", padx=2)
        self.status = ctk.CTkLabel(self, text="White: trained. Black (red here): weighted by unmasked_weight.",
                                   anchor="w")
        self.status.pack(fill="x", padx=12)
        self.canvas = tk.Canvas(self, width=self.view_size[0], height=self.view_size[1], highlightthickness=0,
                                cursor="crosshair")
        self.canvas.pack(padx=8, pady=8)
        self._photo = None
        self._item = self.canvas.create_image(0, 0, anchor="nw")
        for button, value in ((1, 255), (3, 0)):
            self.canvas.bind(f"<ButtonPress-{button}>", lambda event, v=value: self._press(event, v))
            self.canvas.bind(f"<B{button}-Motion>", lambda event, v=value: self._drag(event, v))
            self.canvas.bind(f"<ButtonRelease-{button}>", lambda _event: self._release())
        self.bind("<Control-s>", lambda _event: self.save() and None)
        self.bind("<Escape>", lambda _event: self.destroy())
        centre_over(self, master)
        self.redraw()

    # --- painting -----------------------------------------------------------------------------

    def image_point(self, x: float, y: float) -> tuple[int, int]:
        """Canvas pixels to image pixels, kept inside the image."""
        return (min(self.picture.width - 1, max(0, int(x / self.scale))),
                min(self.picture.height - 1, max(0, int(y / self.scale))))

    def _value(self, button_value: int) -> int:
        """What a stroke paints: the brush white, the eraser black; fill by the button (left white)."""
        tool = self.tool_var.get()
        return 255 if tool == "brush" else 0 if tool == "eraser" else button_value

    def _press(self, event, button_value: int) -> None:
        point = self.image_point(event.x, event.y)
        if self.tool_var.get() == "fill":
            from PIL import ImageDraw

            ImageDraw.floodfill(self.mask, point, self._value(button_value))
            self._done_stroke()
            return
        self._last = point
        self._paint(point, point, self._value(button_value))

    def _drag(self, event, button_value: int) -> None:
        if self._last is None:
            return
        point = self.image_point(event.x, event.y)
        self._paint(self._last, point, self._value(button_value))
        self._last = point

    def _release(self) -> None:
        if self._last is not None:
            self._last = None
            self._done_stroke()

    def _paint(self, start: tuple[int, int], end: tuple[int, int], value: int) -> None:
        from PIL import ImageDraw

        radius = max(1, int(self.size_var.get())) / 2
        draw = ImageDraw.Draw(self.mask)
        draw.line([start, end], fill=value, width=max(1, round(2 * radius)))
        for x, y in (start, end):  # round ends, so a stroke is a chain of discs
            draw.ellipse([x - radius, y - radius, x + radius, y + radius], fill=value)
        self.changed = True
        self.redraw()

    def _fill_all(self, value: int) -> None:
        self.mask.paste(value, (0, 0, *self.mask.size))
        self._done_stroke()

    def _done_stroke(self) -> None:
        self.changed = True
        self.status.configure(text="Changed; Save (Ctrl+S) writes it.")
        self.redraw()

    def redraw(self) -> None:
        from PIL import Image, ImageTk

        tinted = Image.blend(self.picture, Image.new("RGB", self.picture.size, TINT), 0.55)
        shown = Image.composite(self.picture, tinted, self.mask).resize(self.view_size, Image.Resampling.BILINEAR)
        self._photo = ImageTk.PhotoImage(shown, master=self.canvas)  # kept: Tk does not hold the photo alive
        self.canvas.itemconfigure(self._item, image=self._photo)

    # --- saving -----------------------------------------------------------------------------

    def save(self) -> Path:
        """Write the mask as pure black and white `<image stem>-masklabel.png`, atomically."""
        target = mask_file(self.image_path)
        mask = self.mask.point(lambda v: 255 if v >= 128 else 0)
        write_with(target, lambda temp: mask.save(temp, format="PNG"))
        self.changed = False
        self.status.configure(text=f"Saved {target.name}.")
        self.on_saved(target)
        return target
