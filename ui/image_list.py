"""A list of image files picked in a dialog (a sample prompt's control images): "Pick images…", a small
thumbnail of each chosen image with its name and a remove (x), a missing file shown as such (red,
named), and how many the family takes. The list lives in the Field's variable, one path a line (the
config's list[str]), so the Field's binding writes it to the config as any other list field.

`limits()` says (fewest, most, family label) for the current family, or None while the family is not a
known one; it is asked again after each validation, so the hint and the button follow a change of
family. A pick adds to the list up to `most` (a family that takes one image: the pick replaces it)."""

from __future__ import annotations

from pathlib import Path
from tkinter import filedialog
from typing import Callable

import customtkinter as ctk

from ui.components import ERROR_COLOR

THUMB = 48
IMAGE_TYPES = [("images", "*.png *.jpg *.jpeg *.webp *.bmp"), ("all files", "*")]


def picture_of(path: str | Path, size: int):
    """A CTkImage of the file with its longer side `size`, or None when it cannot be read."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            image = image.convert("RGB")
            scale = size / max(image.size)
            shape = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
            image = image.resize(shape)
    except (OSError, ValueError):
        return None
    return ctk.CTkImage(light_image=image, dark_image=image, size=shape)


def short_name(path: str, chars: int = 14) -> str:
    name = Path(path).name
    return name if len(name) <= chars else name[:chars - 1] + "…"


class ImageList(ctk.CTkFrame):
    def __init__(self, parent, var, limits: Callable[[], tuple[int, int, str] | None]):
        super().__init__(parent, fg_color="transparent")
        self.var, self.limits = var, limits
        head = ctk.CTkFrame(self, fg_color="transparent")
        head.pack(fill="x")
        self.pick_button = ctk.CTkButton(head, text="Pick images…", width=110, command=self.pick)
        self.pick_button.pack(side="left")
        self.hint = ctk.CTkLabel(head, text="", anchor="w", font=ctk.CTkFont(size=11))
        self.hint.pack(side="left", padx=8)
        self.cells = ctk.CTkFrame(self, fg_color="transparent")
        self.cells.pack(fill="x")
        self.pictures: list = []  # the thumbnails shown (kept: Tk drops an image nobody holds)
        self.missing: list[str] = []  # the chosen files that are not there
        self._shown: tuple | None = None
        self.note = ""  # what the last pick left out
        self._trace = var.trace_add("write", self._var_written)
        self.refresh()

    def destroy(self):
        try:
            self.var.trace_remove("write", self._trace)
        except Exception:  # the variable or the interpreter is gone
            pass
        super().destroy()

    def paths(self) -> list[str]:
        return [line.strip() for line in self.var.get().splitlines() if line.strip()]

    def _var_written(self, *_args) -> None:
        if self.winfo_exists():
            self.refresh()

    # --- editing -----------------------------------------------------------------------------

    def pick(self) -> None:
        chosen = filedialog.askopenfilenames(parent=self, title="Control images", filetypes=IMAGE_TYPES)
        if chosen:
            self.add([str(path) for path in chosen])

    def add(self, picked: list[str]) -> None:
        limits = self.limits()
        most = limits[1] if limits else None
        current = self.paths()
        if most == 1:  # one image: the new pick replaces it
            kept, dropped = picked[:1], picked[1:]
        else:
            merged = current + [path for path in picked if path not in current]
            kept = merged if most is None else merged[:most]
            dropped = merged[len(kept):]
        self.note = (f"{limits[2]} takes {most}: left out {', '.join(Path(p).name for p in dropped)}"
                     if dropped and limits else "")
        self.var.set("\n".join(kept))

    def remove(self, index: int) -> None:
        paths = self.paths()
        del paths[index]
        self.note = ""
        self.var.set("\n".join(paths))

    # --- showing -----------------------------------------------------------------------------

    def refresh(self) -> None:
        """The hint and the button for the family now; the thumbnails again where the list or a
        file's presence changed (asked after every validation: cheap when nothing did)."""
        paths = self.paths()
        limits = self.limits()
        if limits is None:
            hint, full = "", False
        else:
            fewest, most, label = limits
            if most == 0:
                hint = f"{label} takes none: remove them"
            elif fewest:
                hint = f"{label} samples from {fewest}" + (f" to {most}" if most > fewest else "")
            else:
                hint = f"{'one image' if most == 1 else f'up to {most}'} ({label})"
            full = most != 1 and len(paths) >= most
        self.hint.configure(text=f"{hint}; {self.note}" if self.note else hint)
        self.pick_button.configure(state="disabled" if full else "normal")
        present = tuple(Path(path).is_file() for path in paths)
        if self._shown == (tuple(paths), present):
            return
        self._shown = (tuple(paths), present)
        for child in self.cells.winfo_children():
            child.destroy()
        self.pictures, self.missing = [], []
        for index, (path, there) in enumerate(zip(paths, present)):
            cell = ctk.CTkFrame(self.cells, fg_color="transparent")
            cell.pack(side="left", anchor="n", padx=(0, 6), pady=2)
            picture = picture_of(path, THUMB) if there else None
            if picture is not None:
                self.pictures.append(picture)
                ctk.CTkLabel(cell, text="", image=picture, width=THUMB, height=THUMB).pack()
                ctk.CTkLabel(cell, text=short_name(path), font=ctk.CTkFont(size=10)).pack()
            else:
                self.missing.append(path)
                ctk.CTkLabel(cell, text=f"{'unreadable' if there else 'missing'}:\n{short_name(path)}",
                             text_color=ERROR_COLOR, width=THUMB, height=THUMB, font=ctk.CTkFont(size=10)).pack()
            ctk.CTkButton(cell, text="x", width=22, height=18, fg_color="#8e3b3b", hover_color="#6e2b2b",
                          command=lambda i=index: self.remove(i)).pack(pady=(1, 0))
