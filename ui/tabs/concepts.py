"""Concepts: folders of images with captions; add, remove, enable; a preview per concept with the
image count and a few thumbnails with their captions (read the way training reads them)."""

from __future__ import annotations

import customtkinter as ctk

from ui.components import section
from ui.tabs import Tab

THUMBNAILS = 4
THUMB_SIZE = 72


def preview_items(concept: dict) -> tuple[int, list, str | None]:
    """(image count, the first items, problem or None) for a concept dict, as training scans it."""
    from pydantic import ValidationError

    from modules.config.train_config import ConceptConfig
    from modules.data.concepts import DataError, scan_concept

    try:
        config = ConceptConfig.model_validate(concept)
        items = scan_concept(0, config, lambda _message: None)
    except (ValidationError, DataError, OSError) as error:
        text = str(error).splitlines()[0] if str(error) else type(error).__name__
        return 0, [], text.replace("concepts[0].", "")
    return len(items), items[:THUMBNAILS], None


class ConceptsTab(Tab):
    def __init__(self, parent, app):
        super().__init__(parent, app)
        section(self, "Concepts")
        ctk.CTkButton(self, text="Add concept", width=130, command=self.add).pack(anchor="w", padx=8, pady=4)
        self.list_frame = ctk.CTkFrame(self, fg_color="transparent")
        self.list_frame.pack(fill="x")
        self.previews: list[dict] = []
        self._count = -1
        self.rebuild()
        self.cfg.reload_listeners.append(self.rebuild)

    def concepts(self) -> list:
        return self.cfg.data.setdefault("concepts", [])

    def add(self, path: str = "") -> None:
        self.concepts().append({"name": "", "path": path, "caption_source": "txt", "caption_file": "caption.txt",
                                "repeats": 1, "enabled": True, "include_subfolders": False})
        self.rebuild(force=True)
        self.cfg.validate()

    def remove(self, index: int) -> None:
        del self.concepts()[index]
        self.rebuild(force=True)
        self.cfg.validate()

    def rebuild(self, force: bool = False) -> None:
        count = len(self.concepts())
        if count == self._count and not force:
            for index in range(count):
                self.update_preview(index)
            return
        self._count = count
        self.cfg.unbind_prefix("concepts[")
        for path in [p for p in self.fields if p.startswith("concepts[")]:
            del self.fields[path]
        for child in self.list_frame.winfo_children():
            child.destroy()
        self.previews = []
        if not count:
            ctk.CTkLabel(self.list_frame, text="No concepts yet: add a folder of images (captions in .txt files "
                         "of the same name).", anchor="w").pack(fill="x", padx=8, pady=6)
        for index in range(count):
            self._concept(index)

    def _concept(self, index: int) -> None:
        at = f"concepts[{index}]"
        box = ctk.CTkFrame(self.list_frame)
        box.pack(fill="x", padx=8, pady=6)
        head = ctk.CTkFrame(box, fg_color="transparent")
        head.pack(fill="x")
        ctk.CTkLabel(head, text=f"Concept {index + 1}", font=ctk.CTkFont(weight="bold")).pack(side="left", padx=8)
        ctk.CTkButton(head, text="Remove", width=80, fg_color="#8e3b3b", hover_color="#6e2b2b",
                      command=lambda: self.remove(index)).pack(side="right", padx=8, pady=4)
        self.field(box, f"{at}.enabled", "Enabled", "bool", widget="switch")
        self.field(box, f"{at}.name", "Name", "str")
        path = self.field(box, f"{at}.path", "Image folder", "str", widget="path", path_mode="dir")
        source = self.field(box, f"{at}.caption_source", "Caption source", "choice", widget="option",
                            values=["txt", "file", "filename"])
        caption_file = self.field(box, f"{at}.caption_file", "Caption file (source 'file')", "str")
        self.field(box, f"{at}.repeats", "Repeats", "int")
        subfolders = self.field(box, f"{at}.include_subfolders", "Include subfolders", "bool", widget="switch")
        preview = ctk.CTkFrame(box, fg_color="transparent")
        preview.pack(fill="x", padx=8, pady=(2, 8))
        count = ctk.CTkLabel(preview, text="", anchor="w")
        count.pack(fill="x")
        thumbs = ctk.CTkFrame(preview, fg_color="transparent")
        thumbs.pack(fill="x")
        self.previews.append({"count": count, "thumbs": thumbs, "key": None, "images": []})
        for field in (path, source, caption_file, subfolders):
            field.var.trace_add("write", lambda *_: self.after(300, lambda: self.update_preview(index)))
        self.update_preview(index)

    def update_preview(self, index: int) -> None:
        if index >= len(self.previews) or index >= len(self.concepts()):
            return
        slot = self.previews[index]
        if not slot["count"].winfo_exists():
            return
        concept = self.concepts()[index]
        key = repr(concept)
        if key == slot["key"]:
            return
        slot["key"] = key
        for child in slot["thumbs"].winfo_children():
            child.destroy()
        slot["images"] = []
        if not str(concept.get("path") or "").strip():
            slot["count"].configure(text="Preview: choose a folder")
            return
        total, items, problem = preview_items(concept)
        if problem:
            slot["count"].configure(text=f"Preview: {problem}")
            return
        slot["count"].configure(text=f"{total} image{'s' if total != 1 else ''}" + (" — first ones:" if items else ""))
        from PIL import Image

        for column, item in enumerate(items):
            try:
                with Image.open(item.image) as image:
                    image = image.convert("RGB")
                    image.thumbnail((THUMB_SIZE, THUMB_SIZE))
                    picture = ctk.CTkImage(light_image=image, dark_image=image, size=image.size)
            except OSError:
                continue
            slot["images"].append(picture)
            cell = ctk.CTkFrame(slot["thumbs"], fg_color="transparent")
            cell.grid(row=0, column=column, padx=4, sticky="n")
            ctk.CTkLabel(cell, text="", image=picture).pack()
            caption = item.caption or "(no caption)"
            ctk.CTkLabel(cell, text=caption[:60] + ("…" if len(caption) > 60 else ""), wraplength=140,
                         font=ctk.CTkFont(size=11), justify="center").pack()
