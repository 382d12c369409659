"""A tagged section of the config (the optimizer, the training method; modules/config/tagged.py)
in a tab: a choice of its `type`, then the chosen member's own fields, rebuilt when the type changes."""

from __future__ import annotations

import customtkinter as ctk

from modules.config.tagged import TaggedUnion


def retyped(union: TaggedUnion, current, kind: str) -> dict:
    """The section once `kind` is chosen: the new member's defaults, with what the loader's rule
    keeps of the old settings (TaggedUnion.retype) on top."""
    defaults = union.config_class(kind)().model_dump(mode="json")
    return {**defaults, **union.retype(current if isinstance(current, dict) else {}, kind), "type": kind}


class UnionSection:
    def __init__(self, tab, union: TaggedUnion, label: str, tooltip: str):
        self.tab, self.union, self.path = tab, union, union.section
        self.type_field = tab.field(tab, f"{self.path}.type", label, "choice", widget="option",
                                    values=union.names(), tooltip=tooltip)
        tab.cfg.set_hooks[f"{self.path}.type"] = self._chosen
        self.frame = ctk.CTkFrame(tab, fg_color="transparent")
        self.frame.pack(fill="x")
        self._shown = None
        self._fields()
        tab.cfg.reload_listeners.append(self._fields)

    def _chosen(self, kind) -> bool:
        """Another member: the settings it declares alike kept, its own at their defaults."""
        current = self.tab.cfg.data.get(self.path)
        if kind not in self.union.members() or (isinstance(current, dict) and current.get("type") == kind):
            return False
        self.tab.cfg.data[self.path] = retyped(self.union, current, kind)
        self.tab.cfg.refresh()  # rebuilds the member's fields (reload listener), then validates
        return True

    def _fields(self) -> None:
        kind = self.tab.cfg.get(f"{self.path}.type")
        if kind == self._shown or kind not in self.union.members():
            return
        self._shown = kind
        for child in self.frame.winfo_children():
            child.destroy()  # only this frame's fields, and so only their bindings
        self.tab.form(self.frame, self.union.config_class(kind), self.path, exclude={"type"})
