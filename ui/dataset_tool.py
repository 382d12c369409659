"""The dataset tool: a concept folder's images with their captions, in a window of its own.

Each row is an image's thumbnail and its caption (`<image>.txt`, as training reads it:
modules/data/concepts.py), edited in place and saved atomically when the box loses the focus or on
Ctrl+S; the run's next cache check re-encodes just that caption. Above the rows: a filter by caption
text, and bulk edits over the selected rows (prefix, suffix, find/replace, add or remove a
comma-separated tag), and the images' sizes and how many have no caption. "Auto-caption…" and
"Generate masks…" run a captioning or masking model over the folder in a child process
(ui/label_dialog.py); the rows read the captions again when it ends, and a row names its image's
mask (`<stem>-masklabel.png`, as masked training reads it) where there is one; its "Mask…" paints
one by hand (ui/mask_painter.py)."""

from __future__ import annotations

import tkinter as tk
from pathlib import Path

import customtkinter as ctk

from modules.autolabel.images import folder_images, read_caption
from modules.data.mask_files import mask_path
from modules.util.atomic import write_text
from ui.components import centre_over
from ui.label_dialog import CAPTION, MASKS, LabelDialog, LabelJob

THUMB = 96
MAX_ROWS = 200  # rows shown at once; the filter narrows a bigger folder
EDITS = ("prefix", "suffix", "replace", "add tag", "remove tag")


def size_stats(images: list[Path], captions: dict[Path, str]) -> str:
    """One line: how many images, their sizes (from the headers), how many have no caption."""
    from collections import Counter

    from PIL import Image

    sizes: Counter = Counter()
    for image in images:
        try:
            with Image.open(image) as opened:
                sizes[opened.size] += 1
        except OSError:
            sizes["unreadable"] += 1
    common = ", ".join(f"{s[0]}x{s[1]}: {n}" if isinstance(s, tuple) else f"{s}: {n}" for s, n in sizes.most_common(4))
    more = f" and {len(sizes) - 4} more sizes" if len(sizes) > 4 else ""
    empty = sum(not captions.get(image) for image in images)
    return f"Sizes {common}{more}; {empty} without a caption."


def edited(caption: str, edit: str, text: str, replacement: str = "") -> str:
    """`caption` after one bulk edit. Tags are the comma-separated parts of the caption."""
    if edit == "prefix":
        return text + caption if not caption.startswith(text) else caption
    if edit == "suffix":
        return caption + text if not caption.endswith(text) else caption
    if edit == "replace":
        return caption.replace(text, replacement) if text else caption
    tags = [tag.strip() for tag in caption.split(",") if tag.strip()]
    if edit == "add tag":
        return ", ".join(tags + [text.strip()]) if text.strip() and text.strip() not in tags else caption
    if edit == "remove tag":
        return ", ".join(tag for tag in tags if tag != text.strip())
    raise ValueError(f"unknown edit {edit!r} (known: {', '.join(EDITS)})")


class DatasetTool(ctk.CTkToplevel):
    def __init__(self, master, folder: str | Path, include_subfolders: bool = False):
        super().__init__(master)
        self.folder = Path(folder)
        self.include_subfolders = include_subfolders
        self.label_dialogs: list = []  # the auto-caption and mask dialogs opened from here
        self.painter = None  # the last mask painter opened from here
        self.title(f"Dataset: {self.folder}")
        centre_over(self, master, 820, 640)
        self.images = folder_images(self.folder, include_subfolders)
        self.captions = {image: read_caption(image) for image in self.images}
        self.selected: set[Path] = set()
        self.rows: dict[Path, dict] = {}
        self._pictures = []

        bar = ctk.CTkFrame(self, fg_color="transparent")
        bar.pack(fill="x", padx=8, pady=(8, 2))
        ctk.CTkLabel(bar, text="Filter").pack(side="left", padx=(0, 4))
        self.filter_var = tk.StringVar(self)
        ctk.CTkEntry(bar, textvariable=self.filter_var, width=220).pack(side="left")
        self.filter_var.trace_add("write", lambda *_: self.show())
        self.count_label = ctk.CTkLabel(bar, text="", anchor="w")
        self.count_label.pack(side="left", padx=8)
        ctk.CTkButton(bar, text="Select shown", width=100, command=self.select_shown).pack(side="right", padx=2)
        ctk.CTkButton(bar, text="Select none", width=90, command=self.select_none).pack(side="right", padx=2)

        bulk = ctk.CTkFrame(self, fg_color="transparent")
        bulk.pack(fill="x", padx=8, pady=2)
        self.edit_var = tk.StringVar(self, value=EDITS[0])
        ctk.CTkOptionMenu(bulk, variable=self.edit_var, values=list(EDITS), width=120).pack(side="left")
        self.text_var, self.replacement_var = tk.StringVar(self), tk.StringVar(self)
        ctk.CTkEntry(bulk, textvariable=self.text_var, width=200, placeholder_text="text or tag").pack(side="left", padx=4)
        ctk.CTkEntry(bulk, textvariable=self.replacement_var, width=160,
                     placeholder_text="replace with").pack(side="left", padx=4)
        ctk.CTkButton(bulk, text="Apply to selected", width=130, command=self.apply_bulk).pack(side="left", padx=4)
        ctk.CTkButton(bulk, text="Generate masks…", width=120,
                      command=lambda: self.open_label_dialog(MASKS)).pack(side="right", padx=2)
        ctk.CTkButton(bulk, text="Auto-caption…", width=110,
                      command=lambda: self.open_label_dialog(CAPTION)).pack(side="right", padx=2)
        self.stats = ctk.CTkLabel(self, text=size_stats(self.images, self.captions), anchor="w")
        self.stats.pack(fill="x", padx=12)
        self.status = ctk.CTkLabel(self, text="", anchor="w")
        self.status.pack(fill="x", padx=12)

        self.list = ctk.CTkScrollableFrame(self)
        self.list.pack(fill="both", expand=True, padx=8, pady=(2, 8))
        self.bind("<Escape>", lambda _event: self.destroy())
        self.show()

    # --- rows -------------------------------------------------------------------------------------

    def shown(self) -> list[Path]:
        text = self.filter_var.get().strip().lower()
        return [image for image in self.images if text in self.captions[image].lower()]

    def show(self) -> None:
        for child in self.list.winfo_children():
            child.destroy()
        self.rows, self._pictures = {}, []
        shown = self.shown()
        for image in shown[:MAX_ROWS]:
            self._row(image)
        more = f" (first {MAX_ROWS} shown)" if len(shown) > MAX_ROWS else ""
        self.count_label.configure(text=f"{len(shown)} of {len(self.images)} images{more}")

    def _row(self, image: Path) -> None:
        from PIL import Image

        row = ctk.CTkFrame(self.list)
        row.pack(fill="x", padx=4, pady=3)
        var = tk.BooleanVar(row, value=image in self.selected)
        ctk.CTkCheckBox(row, text="", variable=var, width=24,
                        command=lambda: self._toggle(image, var.get())).pack(side="left", padx=4)
        try:
            with Image.open(image) as opened:
                opened = opened.convert("RGB")
                opened.thumbnail((THUMB, THUMB))
                picture = ctk.CTkImage(light_image=opened, dark_image=opened, size=opened.size)
            self._pictures.append(picture)
            ctk.CTkLabel(row, text="", image=picture, width=THUMB).pack(side="left", padx=4, pady=4)
        except OSError as error:
            ctk.CTkLabel(row, text=str(error), width=THUMB, wraplength=THUMB).pack(side="left", padx=4)
        right = ctk.CTkFrame(row, fg_color="transparent")
        right.pack(side="left", fill="both", expand=True, padx=4, pady=4)
        mask = mask_path(image)
        head = ctk.CTkFrame(right, fg_color="transparent")
        head.pack(fill="x")
        name = ctk.CTkLabel(head, text=image.name + (f"   (mask: {mask.name})" if mask else ""), anchor="w")
        name.pack(side="left", fill="x", expand=True)
        paint = ctk.CTkButton(head, text="Mask…", width=64, height=22, command=lambda: self.open_mask_painter(image))
        paint.pack(side="right")
        box = ctk.CTkTextbox(right, height=56, wrap="word")
        box.insert("1.0", self.captions[image])
        box.pack(fill="x")
        box.bind("<FocusOut>", lambda _event=None: self.save(image))  # Tk may call it without an event while the row goes
        box.bind("<Control-s>", lambda _event=None: self.save(image) or "break")
        self.rows[image] = {"box": box, "selected": var, "name": name, "paint": paint}

    def _toggle(self, image: Path, on: bool) -> None:
        (self.selected.add if on else self.selected.discard)(image)

    def select_shown(self) -> None:
        self.selected |= set(self.shown())
        for image, row in self.rows.items():
            row["selected"].set(image in self.selected)

    def select_none(self) -> None:
        self.selected.clear()
        for row in self.rows.values():
            row["selected"].set(False)

    # --- models that label the folder -------------------------------------------------------------

    def open_label_dialog(self, job: LabelJob) -> LabelDialog:
        """The "Auto-caption…" (CAPTION) or "Generate masks…" (MASKS) dialog over this folder."""
        for image in list(self.rows):  # a caption typed and not saved yet is the model's to keep or replace
            self.save(image)
        dialog = LabelDialog(self, job, self.folder, self.include_subfolders, on_done=self.reload)
        self.label_dialogs.append(dialog)
        return dialog

    def open_mask_painter(self, image: Path):
        """Paint `image`'s loss mask by hand (ui/mask_painter.py); its row names the mask once saved."""
        from ui.mask_painter import MaskPainter

        self.painter = MaskPainter(self, image, on_saved=lambda path: self._mask_saved(image, path))
        return self.painter

    def _mask_saved(self, image: Path, mask: Path) -> None:
        row = self.rows.get(image)
        if row is not None and row["name"].winfo_exists():
            row["name"].configure(text=f"{image.name}   (mask: {mask.name})")

    def reload(self) -> None:
        """Read the captions (and masks) from the folder again: a model has written them."""
        if not self.winfo_exists():
            return
        self.captions = {image: read_caption(image) for image in self.images}
        self.stats.configure(text=size_stats(self.images, self.captions))
        self.show()

    # --- saving -----------------------------------------------------------------------------------

    def save(self, image: Path, caption: str | None = None) -> bool:
        """Write the caption (the row's text unless given) to `<image>.txt` if it changed."""
        if caption is None:
            row = self.rows.get(image)
            if row is None or not row["box"].winfo_exists():
                return False
            caption = row["box"].get("1.0", "end-1c").strip()
        if caption == self.captions[image] and (not caption or image.with_suffix(".txt").is_file()):
            return False  # unchanged (an image without a caption gets no empty .txt by being looked at)
        write_text(image.with_suffix(".txt"), caption + "\n")
        self.captions[image] = caption
        empty = sum(not self.captions[i] for i in self.images)
        self.stats.configure(text=self.stats.cget("text").rsplit("; ", 1)[0] + f"; {empty} without a caption.")
        self.status.configure(text=f"Saved {image.with_suffix('.txt').name}.")
        return True

    def apply_bulk(self) -> int:
        """The chosen edit over the selected images; returns how many captions changed."""
        for image in list(self.rows):  # what is typed in a box and not saved yet comes first
            self.save(image)
        changed = 0
        for image in sorted(self.selected):
            caption = edited(self.captions[image], self.edit_var.get(), self.text_var.get(), self.replacement_var.get())
            if caption != self.captions[image]:
                self.save(image, caption)
                changed += 1
        self.show()
        self.status.configure(text=f"{self.edit_var.get()}: {changed} of {len(self.selected)} selected captions changed.")
        return changed
