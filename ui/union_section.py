"""A discriminated union of the config (the optimizer, the training method) in a tab: a choice of
its `type`, then the chosen member's own fields, rebuilt when the type changes."""

from __future__ import annotations

import typing

import customtkinter as ctk


def union_members(union) -> dict[str, type]:
    """The union's members by their `type` tag (the schema's discriminator)."""
    inner = typing.get_args(union)[0]  # Annotated[Union[...], Field] -> Union[...] (or the one member)
    return {m.model_fields["type"].default: m for m in (typing.get_args(inner) or (inner,))}


class UnionSection:
    def __init__(self, tab, path: str, union, label: str, tooltip: str):
        self.tab, self.path = tab, path
        self.members = union_members(union)
        self.type_field = tab.field(tab, f"{path}.type", label, "choice", widget="option",
                                    values=list(self.members), tooltip=tooltip)
        tab.cfg.set_hooks[f"{path}.type"] = self._chosen
        self.frame = ctk.CTkFrame(tab, fg_color="transparent")
        self.frame.pack(fill="x")
        self._shown = None
        self._fields()
        tab.cfg.reload_listeners.append(self._fields)

    def _chosen(self, kind) -> bool:
        """Another member: its own fields at their defaults (the old ones do not fit it)."""
        current = self.tab.cfg.data.get(self.path)
        if kind not in self.members or (isinstance(current, dict) and current.get("type") == kind):
            return False
        self.tab.cfg.data[self.path] = self.members[kind]().model_dump(mode="json")
        self.tab.cfg.refresh()  # rebuilds the member's fields (reload listener), then validates
        return True

    def _fields(self) -> None:
        kind = self.tab.cfg.get(f"{self.path}.type")
        if kind == self._shown or kind not in self.members:
            return
        self._shown = kind
        for child in self.frame.winfo_children():
            child.destroy()  # only this frame's fields, and so only their bindings
        self.tab.form(self.frame, self.members[kind], self.path, exclude={"type"})
