"""Tabs built the first time they are shown or used, so the window appears at once.

Building every tab's form up front took ~2 s of Tk drawing before the window could appear (112
fields, each a handful of customtkinter widgets; issue 30, defect 11). The first tab is built with
the window; each other one when it is first selected (`LazyTabview.set`, or a click on its
button) or when code first reads it (`app.tabs[name].fields`). A tab's fields bind to the config
when they are built, so a late tab shows the config as it is then."""

from __future__ import annotations

from collections.abc import Callable

import customtkinter as ctk


class LazyTab:
    """Stands for a tab until something needs it; then builds it and passes everything through."""

    def __init__(self, build: Callable[[], object]):
        self._build = build
        self._tab = None

    @property
    def built(self) -> bool:
        return self._tab is not None

    def get(self):
        if self._tab is None:
            self._tab = self._build()
        return self._tab

    def __getattr__(self, name: str):  # only for names LazyTab itself lacks
        return getattr(self.get(), name)


class LazyTabview(ctk.CTkTabview):
    """A tab view that builds a LazyTab when it is selected, by code or by a click."""

    def __init__(self, master, **options):
        self.lazy_tabs: dict[str, LazyTab] = {}
        user_command = options.pop("command", None)

        def shown() -> None:
            self._build_current()
            if user_command is not None:
                user_command()

        super().__init__(master, command=shown, **options)

    def add_lazy(self, name: str, make: Callable[[object], object]) -> LazyTab:
        frame = self.add(name)
        tab = LazyTab(lambda: make(frame))
        self.lazy_tabs[name] = tab
        return tab

    def set(self, name: str) -> None:
        super().set(name)
        self._build_current()

    def _build_current(self) -> None:
        tab = self.lazy_tabs.get(self.get())
        if tab is not None:
            tab.get()
