"""Concepts: folders of images with captions; add, remove, enable. Per concept every option of
the schema (captions, balancing, loss weight, masks, validation), and a preview read the way
training reads it: the image count, the aspect buckets the images fall into, and the images one by
one with the caption the trainer uses (prefix/suffix applied; shuffle and dropout drawn as in
epoch 1)."""

from __future__ import annotations

from collections import Counter

import customtkinter as ctk

from modules.config.control_config import ControlConfig
from modules.config.train_config import CaptionConfig, ConceptConfig
from ui.components import show_picture, subsection
from ui.tabs import Tab

THUMB_SIZE = 160
GROUPS = [("Captions", ["caption_source", "caption_file"]),
          ("Balancing and loss", ["repeats", "samples_per_epoch", "loss_weight", "masked_loss", "unmasked_weight"])]
HEAD = ["enabled", "name", "path", "include_subfolders", "validation"]


def preview_items(concept: dict) -> tuple[list, str | None]:
    """(every item as training scans it, problem or None) for a concept dict."""
    from pydantic import ValidationError

    from modules.data.concepts import DataError, scan_concept

    try:
        config = ConceptConfig.model_validate(concept)
        items = scan_concept(0, config, lambda _message: None)
    except (ValidationError, DataError, OSError) as error:
        text = str(error).splitlines()[0] if str(error) else type(error).__name__
        return [], text.replace("concepts[0].", "")
    return items, None


def bucket_stats(items: list, resolutions: list[int], quantum: int, aspect_buckets: bool) -> Counter:
    """How many images train at each bucket size (per resolution), from the image headers only."""
    from PIL import Image

    from modules.data.buckets import bucket_for

    counts: Counter = Counter()
    for item in items:
        try:
            with Image.open(item.image) as image:
                size = image.size
        except OSError:
            continue
        for resolution in resolutions:
            counts[bucket_for(*size, resolution, quantum, aspect_buckets)] += 1
    return counts


def trained_caption(caption: str, concept: dict, position: int, seed: int) -> str:
    """The caption as the trainer uses it in epoch 1 (scan_concept applied prefix/suffix already)."""
    from modules.data.captions import caption_rng, varied_caption

    try:
        options = CaptionConfig.model_validate(concept.get("captions") or {})
    except ValueError:
        return caption
    return varied_caption(caption, options, caption_rng(seed, 0, 0, position))


class ConceptsTab(Tab):
    def __init__(self, parent, app):
        super().__init__(parent, app)
        ctk.CTkButton(self, text="Add concept", width=130, command=self.add).pack(anchor="w", padx=8, pady=(12, 4))
        self.list_frame = ctk.CTkFrame(self, fg_color="transparent")
        self.list_frame.pack(fill="x")
        self.previews: list[dict] = []
        self._count = -1
        self.rebuild()
        self.cfg.reload_listeners.append(self.rebuild)
        self.cfg.validate_listeners.append(self._schedule_previews)

    def concepts(self) -> list:
        return self.cfg.data.setdefault("concepts", [])

    def add(self, path: str = "") -> None:
        self.concepts().append(ConceptConfig(path=path).model_dump(mode="json"))
        self.rebuild(force=True)
        self.cfg.validate()

    def remove(self, index: int) -> None:
        del self.concepts()[index]
        self.rebuild(force=True)
        self.cfg.validate()

    def rebuild(self, force: bool = False) -> None:
        count = len(self.concepts())
        if count == self._count and not force:
            self._schedule_previews()
            return
        self._count = count
        for child in self.list_frame.winfo_children():
            child.destroy()  # the concepts' own fields release their own bindings
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
        ctk.CTkButton(head, text="Captions…", width=90,
                      command=lambda: self.open_dataset_tool(index)).pack(side="right", padx=4, pady=4)
        self.form(box, ConceptConfig, at, HEAD)
        placed = set(HEAD) | {"captions", "controls"}
        for title, names in GROUPS:
            group = subsection(box, title)
            self.form(group, ConceptConfig, at, names)
            if title == "Captions":
                self.form(group, CaptionConfig, f"{at}.captions")
            placed |= set(names)
        self.form(subsection(box, "Control images (edit models)"), ControlConfig, f"{at}.controls")
        rest = [n for n in ConceptConfig.model_fields if n not in placed]
        if rest:
            self.form(subsection(box, "More"), ConceptConfig, at, rest)
        self._preview_widgets(box, index)

    def open_dataset_tool(self, index: int):
        """The concept's images and captions in the dataset tool (ui/dataset_tool.py)."""
        from pathlib import Path

        from ui.dataset_tool import DatasetTool

        concept = self.concepts()[index]
        folder = str(concept.get("path") or "").strip()
        if not folder or not Path(folder).is_dir():
            self.app.set_status(f"concepts[{index}].path: choose a folder of images first.")
            return None
        tool = DatasetTool(self.app, folder, bool(concept.get("include_subfolders")))
        tool.bind("<Destroy>", lambda event: event.widget is tool and self._captions_edited(index), add="+")
        return tool

    def _captions_edited(self, index: int) -> None:
        """The preview reads the captions again (its concept's settings did not change)."""
        if index < len(self.previews):
            self.previews[index]["key"] = None
        self._schedule_previews()

    # --- the preview --------------------------------------------------------------------------------

    def _preview_widgets(self, box, index: int) -> None:
        preview = ctk.CTkFrame(box, fg_color="transparent")
        preview.pack(fill="x", padx=8, pady=(2, 8))
        count = ctk.CTkLabel(preview, text="", anchor="w", justify="left")
        count.pack(fill="x")
        buckets = ctk.CTkLabel(preview, text="", anchor="w", justify="left", wraplength=600)
        buckets.pack(fill="x")
        row = ctk.CTkFrame(preview, fg_color="transparent")
        row.pack(fill="x")
        back = ctk.CTkButton(row, text="◀", width=32, command=lambda: self.browse(index, -1))
        back.pack(side="left", padx=(0, 4))
        image = ctk.CTkLabel(row, text="", width=THUMB_SIZE, height=THUMB_SIZE)
        image.pack(side="left")
        forward = ctk.CTkButton(row, text="▶", width=32, command=lambda: self.browse(index, 1))
        forward.pack(side="left", padx=4)
        caption = ctk.CTkLabel(row, text="", anchor="nw", justify="left", wraplength=420)
        caption.pack(side="left", fill="both", expand=True, padx=8)
        self.previews.append({"count": count, "buckets": buckets, "image": image, "caption": caption,
                              "key": None, "items": [], "position": 0, "picture": None, "images": []})
        self.update_preview(index)

    def _schedule_previews(self) -> None:
        if getattr(self, "_preview_job", None) is None:
            self._preview_job = self.after(300, self._update_previews)

    def _update_previews(self) -> None:
        self._preview_job = None
        for index in range(len(self.previews)):
            self.update_preview(index)

    def update_preview(self, index: int) -> None:
        if index >= len(self.previews) or index >= len(self.concepts()):
            return
        slot = self.previews[index]
        if not slot["count"].winfo_exists():
            return
        concept = self.concepts()[index]
        data = self.cfg.data.get("data", {})
        key = repr((concept, data.get("resolution"), data.get("aspect_buckets"), self.cfg.get("model.family")))
        if key == slot["key"]:
            return
        slot["key"] = key
        slot["items"], slot["position"] = [], 0
        if not str(concept.get("path") or "").strip():
            self._show(index, "Preview: choose a folder")
            return
        items, problem = preview_items(concept)
        if problem:
            self._show(index, f"Preview: {problem}")
            return
        slot["items"] = items
        self._show(index, f"{len(items)} image{'s' if len(items) != 1 else ''}", self._bucket_text(items))

    def _bucket_text(self, items: list) -> str:
        from pydantic import ValidationError

        from modules.config.train_config import DataConfig
        from modules.config.families import family_names, get_family_declaration

        family = self.cfg.get("model.family")
        if family not in family_names() or not items:
            return ""
        try:  # the data settings as they are now (cfg.config may not be validated yet during a reload)
            data = DataConfig.model_validate(self.cfg.data.get("data") or {})
        except ValidationError:
            return ""
        quantum = get_family_declaration(family).bucket_quantum
        counts = bucket_stats(items, data.resolutions, quantum, data.aspect_buckets)
        return "Buckets: " + ", ".join(f"{w}x{h}: {n}" for (w, h), n in sorted(counts.items(), key=lambda x: -x[1]))

    def browse(self, index: int, step: int) -> None:
        slot = self.previews[index]
        if slot["items"]:
            slot["position"] = (slot["position"] + step) % len(slot["items"])
            self._show_item(index)

    def _show(self, index: int, count: str, buckets: str = "") -> None:
        slot = self.previews[index]
        slot["count"].configure(text=count)
        slot["buckets"].configure(text=buckets)
        self._show_item(index)

    def _show_item(self, index: int) -> None:
        """The image at the slot's position and its trained caption. The label is pointed at the new
        picture (or at none) before the old one is let go: a label left on a deleted photo image
        fails on its next redraw."""
        from PIL import Image

        slot = self.previews[index]
        if not slot["items"]:
            self._set_picture(slot, None)
            slot["image"].configure(text="")
            slot["caption"].configure(text="")
            return
        position = slot["position"]
        item = slot["items"][position]
        try:
            with Image.open(item.image) as image:
                image = image.convert("RGB")
                image.thumbnail((THUMB_SIZE, THUMB_SIZE))
                picture = ctk.CTkImage(light_image=image, dark_image=image, size=image.size)
        except OSError as error:
            self._set_picture(slot, None)
            slot["image"].configure(text=str(error))
            return
        self._set_picture(slot, picture)
        slot["image"].configure(text="")
        caption = trained_caption(item.caption, self.concepts()[index], position, int(self.cfg.get("seed") or 0))
        slot["caption"].configure(text=f"{position + 1}/{len(slot['items'])}  {item.image.name}\n"
                                       f"Trained caption: {caption or '(empty)'}")

    @staticmethod
    def _set_picture(slot: dict, picture) -> None:
        show_picture(slot["image"], picture)
        slot["picture"] = picture
        slot["images"] = [picture] if picture is not None else []
