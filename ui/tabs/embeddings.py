"""Embeddings: the textual-inversion embeddings (placeholder, init text, vectors, train on/off, start
file, learning rate); add and remove them. Trained alone with method "embedding" (Training tab),
else beside the adapter or fine-tune; a frozen one (train off) is read from its file."""

from __future__ import annotations

import customtkinter as ctk

from modules.config.train_config import EmbeddingConfig
from ui.components import section
from ui.tabs import Tab


class EmbeddingsTab(Tab):
    def __init__(self, parent, app):
        super().__init__(parent, app)
        section(self, "Embeddings (textual inversion)")
        ctk.CTkLabel(self, anchor="w", justify="left", wraplength=640, text=(
            "New words for the text encoders: write the placeholder in captions and sample prompts. Training "
            "method \"embedding\" trains only these; with an adapter or fine-tune, the ones with Train on train "
            "alongside it and are saved next to the output as <name>.<placeholder>.safetensors.")
        ).pack(fill="x", padx=8, pady=(0, 4))
        ctk.CTkButton(self, text="Add embedding", width=130, command=self.add).pack(anchor="w", padx=8, pady=4)
        self.list_frame = ctk.CTkFrame(self, fg_color="transparent")
        self.list_frame.pack(fill="x")
        self._count = -1
        self.rebuild()
        self.cfg.reload_listeners.append(self.rebuild)

    def embeddings(self) -> list:
        return self.cfg.data.setdefault("embeddings", [])

    def add(self) -> None:
        taken = {e.get("placeholder") for e in self.embeddings()}
        number = next(n for n in range(1, len(taken) + 2) if f"<embedding-{n}>" not in taken)
        self.embeddings().append(EmbeddingConfig(placeholder=f"<embedding-{number}>").model_dump(mode="json"))
        self.rebuild(force=True)
        self.cfg.validate()

    def remove(self, index: int) -> None:
        del self.embeddings()[index]
        self.rebuild(force=True)
        self.cfg.validate()

    def rebuild(self, force: bool = False) -> None:
        count = len(self.embeddings())
        if count == self._count and not force:
            return
        self._count = count
        for child in self.list_frame.winfo_children():
            child.destroy()  # the fields release their own bindings
        if not count:
            ctk.CTkLabel(self.list_frame, text="No embeddings.", anchor="w").pack(fill="x", padx=8)
        for index in range(count):
            box = ctk.CTkFrame(self.list_frame)
            box.pack(fill="x", padx=8, pady=6)
            head = ctk.CTkFrame(box, fg_color="transparent")
            head.pack(fill="x")
            ctk.CTkLabel(head, text=f"Embedding {index + 1}", font=ctk.CTkFont(weight="bold")).pack(side="left", padx=8)
            ctk.CTkButton(head, text="Remove", width=80, fg_color="#8e3b3b", hover_color="#6e2b2b",
                          command=lambda i=index: self.remove(i)).pack(side="right", padx=8, pady=4)
            self.form(box, EmbeddingConfig, f"embeddings[{index}]")
