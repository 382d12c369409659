"""Concepts: folders of images with captions, one card each (a thumbnail of the first image, the
name, the image count (an edit concept's pairs, and the samples its scan skips), enabled and
repeats); a card opens the concept's window (ui/concept_window.py)
with every option of the schema, its statistics, its images with the caption the trainer uses
(prefix/suffix applied; shuffle and dropout drawn as in epoch 1) and an augmentation preview.

Reading a folder (captions, image headers for sizes and buckets) and making thumbnails run on a
worker thread (ui/background.py), so a folder of a thousand images never freezes the window; the
results come back to the Tk thread by `after`."""

from __future__ import annotations

import copy

import customtkinter as ctk

from modules.config.train_config import ConceptConfig
from ui.background import THUMBNAILS, BackgroundJobs
from ui.components import show_picture
from ui.concept_stats import ConceptSummary, summarize
from ui.concept_window import ConceptWindow, concept_title
from ui.tabs import Tab

CARD_THUMB = 128
CARD_WIDTH = 400  # a card's share of the row: its fields' labels are LABEL_WIDTH wide
CARD_FIELDS = ["enabled", "repeats"]


class _CardFields:
    """What build_form needs from a tab, registering into its own dict: a card's enabled and
    repeats are second widgets of paths whose first widgets live in the concept's window (the one
    `App.field_for` finds); both follow the config (ConfigState.set updates every binding of a path)."""

    field = Tab.field

    def __init__(self, cfg):
        self.cfg, self.fields = cfg, {}


class ConceptsTab(Tab):
    def __init__(self, parent, app):
        super().__init__(parent, app)
        self.jobs = BackgroundJobs(self)
        bar = ctk.CTkFrame(self, fg_color="transparent")
        bar.pack(fill="x")
        ctk.CTkButton(bar, text="Add concept", width=130, command=self.add).pack(side="left", padx=8, pady=(12, 4))
        self.list_frame = ctk.CTkFrame(self, fg_color="transparent")
        self.list_frame.pack(fill="x")
        self.cards: list[dict] = []
        self.windows: list[ConceptWindow] = []
        self.previews: list[dict] = []  # per concept: its window's image slot (count, buckets, image, caption, ...)
        self._count = -1
        self._columns = 0
        self.rebuild()
        self.cfg.reload_listeners.append(self.rebuild)
        self.cfg.validate_listeners.append(self._schedule_previews)
        self.list_frame.bind("<Configure>", lambda _event: self._arrange(), add="+")

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

    def open(self, index: int) -> ConceptWindow:
        """The concept's window, shown (what clicking its card does)."""
        window = self.windows[index]
        window.show()
        return window

    def rebuild(self, force: bool = False) -> None:
        count = len(self.concepts())
        if count == self._count and not force:
            self._schedule_previews()
            return
        self._count = count
        for window in self.windows:
            window.destroy()  # the concepts' own fields release their own bindings
        for child in self.list_frame.winfo_children():
            child.destroy()
        self.cards, self.windows, self.previews = [], [], []
        self._columns = 0
        if not count:
            ctk.CTkLabel(self.list_frame, text="No concepts yet: add a folder of images (captions in .txt files "
                         "of the same name).", anchor="w").pack(fill="x", padx=8, pady=6)
        for index in range(count):
            window = ConceptWindow(self, index)
            self.windows.append(window)
            self.previews.append(window.slot)
            self.cards.append(self._card(index))
        self._arrange()
        self._schedule_previews()

    # --- cards ---------------------------------------------------------------------------------------

    def _card(self, index: int) -> dict:
        card = ctk.CTkFrame(self.list_frame, width=CARD_WIDTH)
        top = ctk.CTkFrame(card, fg_color="transparent")
        top.pack(fill="x", padx=6, pady=(6, 0))
        thumb = ctk.CTkLabel(top, text="…", width=CARD_THUMB, height=CARD_THUMB, fg_color=("#d8d8d8", "#333333"),
                             corner_radius=6, cursor="hand2")
        thumb.pack(side="left")
        words = ctk.CTkFrame(top, fg_color="transparent")
        words.pack(side="left", fill="both", expand=True, padx=8)
        name = ctk.CTkLabel(words, text=concept_title(self.concepts()[index], index), anchor="w",
                            font=ctk.CTkFont(weight="bold"), cursor="hand2", wraplength=220, justify="left")
        name.pack(fill="x")
        count = ctk.CTkLabel(words, text="Reading the folder…", anchor="w", justify="left", wraplength=220)
        count.pack(fill="x")
        buttons = ctk.CTkFrame(words, fg_color="transparent")
        buttons.pack(fill="x", pady=(6, 0))
        ctk.CTkButton(buttons, text="Open…", width=80, command=lambda: self.open(index)).pack(side="left")
        ctk.CTkButton(buttons, text="Remove", width=80, fg_color="#8e3b3b", hover_color="#6e2b2b",
                      command=lambda: self.remove(index)).pack(side="left", padx=6)
        for widget in (thumb, name):  # the card opens its window
            widget.bind("<Button-1>", lambda _event: self.open(index), add="+")
            inner = getattr(widget, "_label", None)
            if inner is not None:
                inner.bind("<Button-1>", lambda _event: self.open(index), add="+")
        fields = _CardFields(self.cfg)
        from ui.form import build_form

        build_form(fields, card, ConceptConfig, f"concepts[{index}]", CARD_FIELDS)
        return {"frame": card, "thumb": thumb, "name": name, "count": count, "fields": fields.fields,
                "picture": None, "thumb_of": None}

    def _arrange(self) -> None:
        """Cards in a grid, as many columns as the tab's width holds."""
        if not self.cards:
            return
        width = self.list_frame.winfo_width()
        columns = max(1, (width if width > 1 else 1100) // CARD_WIDTH)
        if columns == self._columns:
            return
        self._columns = columns
        for index, card in enumerate(self.cards):
            card["frame"].grid(row=index // columns, column=index % columns, sticky="nsew", padx=6, pady=6)

    # --- reading the folders (background) -------------------------------------------------------------

    def _schedule_previews(self) -> None:
        if getattr(self, "_preview_job", None) is None:
            self._preview_job = self.after(300, self._update_previews)

    def _update_previews(self) -> None:
        self._preview_job = None
        for index in range(len(self.previews)):
            self.update_preview(index)

    def update_preview(self, index: int) -> None:
        """Read the concept's folder again on the worker when what decides its reading changed."""
        if index >= len(self.previews) or index >= len(self.concepts()):
            return
        slot = self.previews[index]
        if not slot["count"].winfo_exists():
            return
        concept = copy.deepcopy(self.concepts()[index])
        data = copy.deepcopy(self.cfg.data.get("data") or {})
        family = self.cfg.get("model.family")
        key = repr((concept, data.get("resolution"), data.get("aspect_buckets"), family))
        self.cards[index]["name"].configure(text=concept_title(concept, index))
        self.windows[index].retitle()
        self.windows[index].update_augmentation()  # (drawn again only when the data settings changed)
        if key == slot["key"]:
            return
        slot["key"] = key
        if not str(concept.get("path") or "").strip():  # nothing to read: at once
            self._summarized(index, key, ConceptSummary(problem="choose a folder"))
            return
        self.cards[index]["count"].configure(text="Reading the folder…")
        self.jobs.submit(("summary", index), lambda: summarize(concept, data, family),
                         lambda summary: self._summarized(index, key, summary))

    def _summarized(self, index: int, key: str, summary: ConceptSummary) -> None:
        if index >= len(self.previews) or self.previews[index]["key"] != key:
            return  # the concepts were rebuilt or changed meanwhile
        self.windows[index].show_summary(summary)
        card = self.cards[index]
        card["count"].configure(text=summary.count_text().removeprefix("Preview: ")
                                + (f"\n{summary.without_caption} without a caption" if summary.without_caption else "")
                                + (f"\n{summary.skipped_text()}" if summary.skipped else ""))
        self._card_thumbnail(index, summary.items[0].image if summary.items else None)

    def _card_thumbnail(self, index: int, image) -> None:
        card = self.cards[index]
        if image is None:
            self._set_card_picture(card, None, "no image")
            return
        card["thumb_of"] = image
        self.jobs.submit(("thumb", index), lambda: THUMBNAILS.get(image, CARD_THUMB),
                         lambda picture: self._thumbnail_made(index, image, picture),
                         lambda error: self._set_card_picture(card, None, "unreadable"))

    def _thumbnail_made(self, index: int, image, thumbnail) -> None:
        if index >= len(self.cards) or self.cards[index]["thumb_of"] != image:
            return
        picture = ctk.CTkImage(light_image=thumbnail, dark_image=thumbnail, size=thumbnail.size)
        self._set_card_picture(self.cards[index], picture, "")

    @staticmethod
    def _set_card_picture(card: dict, picture, text: str) -> None:
        if not card["thumb"].winfo_exists():
            return
        show_picture(card["thumb"], picture)  # the label lets go of the old photo image first
        card["thumb"].configure(text=text)
        card["picture"] = picture

    # --- browsing, captions ----------------------------------------------------------------------------

    def browse(self, index: int, step: int) -> None:
        slot = self.previews[index]
        if slot["items"]:
            slot["position"] = (slot["position"] + step) % len(slot["items"])
            self.windows[index].show_item()

    def open_dataset_tool(self, index: int):
        """The concept's images and captions in the dataset tool (ui/dataset_tool.py)."""
        from pathlib import Path

        from ui.dataset_tool import DatasetTool

        concept = self.concepts()[index]
        folder = str(concept.get("path") or "").strip()
        if not folder or not Path(folder).is_dir():
            self.app.set_status(f"concepts[{index}].path: choose a folder of images first.")
            return None
        if (concept.get("controls") or {}).get("source") == "folders":  # an edit concept's captions: its targets'
            folder = str(Path(folder) / "target")
        tool = DatasetTool(self.app, folder, bool(concept.get("include_subfolders")))
        tool.bind("<Destroy>", lambda event: event.widget is tool and self._captions_edited(index), add="+")
        return tool

    def _captions_edited(self, index: int) -> None:
        """The preview reads the captions again (its concept's settings did not change)."""
        if index < len(self.previews):
            self.previews[index]["key"] = None
        self._schedule_previews()
