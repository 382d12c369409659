"""Widgets bound to the config by dotted path: labelled entry, switch, option menu, combo box,
path picker and multi-line list, each with its validation message under it and a tooltip (the
field's description from TrainConfig); plus section headers and a non-modal error dialog."""

from __future__ import annotations

import tkinter as tk
from tkinter import filedialog
from typing import Callable

import customtkinter as ctk

from ui.state import ConfigState, field_description

ERROR_COLOR = ("#c0392b", "#ff6b6b")
LABEL_WIDTH = 200


class Tooltip:
    """A small popup with `text` while the pointer rests on `widget`."""

    def __init__(self, widget, text: str, delay_ms: int = 500):
        self.widget, self.text, self.delay_ms = widget, text, delay_ms
        self._job = None
        self._window = None
        widget.bind("<Enter>", self._schedule, add="+")
        widget.bind("<Leave>", self._hide, add="+")
        widget.bind("<ButtonPress>", self._hide, add="+")

    def _schedule(self, _event=None):
        self._cancel()
        self._job = self.widget.after(self.delay_ms, self._show)

    def _cancel(self):
        if self._job is not None:
            self.widget.after_cancel(self._job)
            self._job = None

    def _show(self):
        self._job = None
        if self._window is not None or not self.widget.winfo_exists():
            return
        x = self.widget.winfo_rootx() + 10
        y = self.widget.winfo_rooty() + self.widget.winfo_height() + 4
        self._window = window = tk.Toplevel(self.widget)
        window.wm_overrideredirect(True)
        window.wm_geometry(f"+{x}+{y}")
        tk.Label(window, text=self.text, justify="left", wraplength=420, background="#ffffe0",
                 foreground="#222222", relief="solid", borderwidth=1, padx=6, pady=4).pack()

    def _hide(self, _event=None):
        self._cancel()
        if self._window is not None:
            self._window.destroy()
            self._window = None


def pack_in_place(widget, options: dict) -> None:
    """Pack a hidden widget again where it was: before the first later sibling that is packed
    (widgets here are packed in the order they are made)."""
    siblings = widget.master.winfo_children()
    for later in siblings[siblings.index(widget) + 1:]:
        if later.winfo_manager() == "pack":
            widget.pack(before=later, **options)
            return
    widget.pack(**options)


def _page_of(widget):
    """The scrollable tab page a widget sits on, or None."""
    node = widget.master
    while node is not None and not isinstance(node, ctk.CTkScrollableFrame):
        node = node.master
    return node


def forward_wheel_to_page(textbox) -> None:
    """The mouse wheel over a multi-line box scrolls the box while it has more lines than it shows,
    else the page under it (CTkScrollableFrame ignores the wheel over any CTkTextbox)."""
    inner = textbox._textbox

    def wheel(event):
        if inner.yview() != (0.0, 1.0):
            return None  # the box's own scrolling
        page = _page_of(textbox)
        if page is None:
            return None
        up = event.num == 4 or getattr(event, "delta", 0) > 0
        page._parent_canvas.yview_scroll(-1 if up else 1, "units")
        return "break"

    for sequence in ("<Button-4>", "<Button-5>", "<MouseWheel>"):
        inner.bind(sequence, wheel, add="+")


def section(parent, text: str):
    label = ctk.CTkLabel(parent, text=text, font=ctk.CTkFont(size=15, weight="bold"), anchor="w")
    label.pack(fill="x", padx=8, pady=(12, 2))
    return label


def subsection(parent, text: str, tooltip: str | None = None):
    """A framed group with a bold title (a nested part of the config: a concept's captions)."""
    group = ctk.CTkFrame(parent)
    group.pack(fill="x", padx=8, pady=4)
    label = ctk.CTkLabel(group, text=text, font=ctk.CTkFont(weight="bold"), anchor="w")
    label.pack(fill="x", padx=8, pady=(4, 0))
    if tooltip:
        Tooltip(label, tooltip)
    return group


class Field(ctk.CTkFrame):
    """A label, an input bound to `path`, and the path's validation message under it.

    widget: entry | switch | option | combo | path | lines | images. For `path`, `path_mode` is dir,
    file, save or file_or_dir; `images` (a list of image files, ui/image_list.py) takes `images(state)`:
    (fewest, most, family label) or None. `choices(state)` gives the choices of an option/combo from the machine or
    the family (None: keep `values`, the schema's). `visible(sibling, value)` says whether the
    field applies now; when not, it is hidden (and shown again in its place when it does).

    The Field owns its bindings: destroying it releases them, and nothing else does.
    """

    def __init__(self, parent, state: ConfigState, path: str, label: str, kind: str = "str",
                 widget: str = "entry", values: list[str] | None = None, path_mode: str = "dir",
                 tooltip: str | None = None, width: int | None = None, filetypes=None,
                 unit: tuple[str, list[str]] | None = None, choices: Callable | None = None,
                 visible: Callable | None = None, registry: dict | None = None, images: Callable | None = None):
        super().__init__(parent, fg_color="transparent")
        self.cfg, self.path, self.kind = state, path, kind
        self.widget_kind = widget
        self.values = list(values or [])
        self.choices, self.visible_rule, self.registry = choices, visible, registry
        self.bindings = []
        self.shown = True
        self.columnconfigure(1, weight=1)
        self.label = ctk.CTkLabel(self, text=label, width=LABEL_WIDTH, anchor="w", justify="left",
                                  wraplength=LABEL_WIDTH)
        self.label.grid(row=0, column=0, sticky="w", padx=(8, 4))
        self.var = tk.BooleanVar(self) if kind == "bool" else tk.StringVar(self)
        self.filetypes = filetypes
        numeric = kind in ("int", "optint", "float", "optfloat", "fraction", "intword")
        width = width or (160 if numeric else 320)
        self.unit_var = None
        if widget == "entry" and unit:
            # a number with its unit (a cadence: value + steps/epochs/minutes), both bound
            self.input = ctk.CTkFrame(self, fg_color="transparent")
            ctk.CTkEntry(self.input, textvariable=self.var, width=width).pack(side="left")
            self.unit_var = tk.StringVar(self)
            ctk.CTkOptionMenu(self.input, variable=self.unit_var, values=unit[1], width=120).pack(side="left", padx=(6, 0))
        elif widget == "entry":
            self.input = ctk.CTkEntry(self, textvariable=self.var, width=width)
        elif widget == "switch":
            self.input = ctk.CTkSwitch(self, text="", variable=self.var, onvalue=True, offvalue=False)
        elif widget == "option":
            self.input = ctk.CTkOptionMenu(self, variable=self.var, values=self._choices() or [""], width=width)
        elif widget == "combo":
            self.input = ctk.CTkComboBox(self, variable=self.var, values=self._choices(), width=width)
        elif widget == "path":
            self.input = ctk.CTkFrame(self, fg_color="transparent")
            self.entry = ctk.CTkEntry(self.input, textvariable=self.var, width=width)
            self.entry.pack(side="left", fill="x", expand=True)
            modes = ["dir", "file"] if path_mode == "file_or_dir" else [path_mode]
            for mode in modes:
                text = {"dir": "Folder…", "file": "File…", "save": "Browse…"}[mode]
                ctk.CTkButton(self.input, text=text, width=70,
                              command=lambda m=mode: self._browse(m)).pack(side="left", padx=(4, 0))
        elif widget == "lines":
            self.input = ctk.CTkTextbox(self, height=64, width=width)
            # A named method that takes no event, not a lambda: tkinter names Tcl commands
            # id + __name__, and CTkTextbox's scrollbar loop (after(..., lambda: ...)) left
            # pending by a destroyed textbox fires a "<id><lambda>" name that a new lambda
            # at the freed address would answer, with no event.
            self.input.bind("<KeyRelease>", self._text_to_var)
            self.input.bind("<FocusOut>", self._text_to_var)
            self.var.trace_add("write", lambda *_: self._var_to_text())
            forward_wheel_to_page(self.input)
        elif widget == "images":
            from ui.image_list import ImageList

            self.input = ImageList(self, self.var, lambda: images(self.cfg) if images is not None else None)
        else:
            raise ValueError(f"unknown widget {widget!r}")
        stretch = widget in ("path", "lines", "images") or (widget == "entry" and not numeric and not unit)
        self.input.grid(row=0, column=1, sticky="ew" if stretch else "w", padx=4, pady=2)
        self.error = ctk.CTkLabel(self, text="", text_color=ERROR_COLOR, anchor="w", justify="left", wraplength=520)
        text = tooltip or field_description(path)
        self.tooltip_text = text
        if text:
            Tooltip(self.label, text)
        self._messages: dict[str, str | None] = {}
        self.binding = state.bind(path, kind, self.var, lambda m: self._validated(path, m))
        self.bindings.append(self.binding)
        if unit:
            self.unit_binding = state.bind(unit[0], "choice", self.unit_var, lambda m: self._message(unit[0], m))
            self.bindings.append(self.unit_binding)
        if registry is not None:
            registry[path] = self
            if unit:
                registry[unit[0]] = self
        if widget == "lines":
            self._var_to_text()

    def place_in(self, **pack) -> "Field":
        self._pack = {"fill": "x", "pady": 1, **pack}
        self.pack(**self._pack)
        self._apply_visibility()
        return self

    def _show_in_place(self) -> None:
        pack_in_place(self, self._pack)

    def destroy(self):
        for binding in self.bindings:
            self.cfg.release(binding)
        self.bindings = []
        if self.registry is not None:
            for path in [p for p, field in self.registry.items() if field is self]:
                del self.registry[path]
        super().destroy()

    # --- choices and visibility, refreshed after each validation ------------------------------------

    def _choices(self) -> list[str]:
        offered = self.choices(self.cfg) if self.choices is not None else None
        return list(offered) if offered is not None else list(self.values)

    def _validated(self, path: str, message: str | None) -> None:
        self._message(path, message)
        if self.widget_kind in ("option", "combo") and self.choices is not None:
            values = self._choices()
            if list(self.input.cget("values")) != values:
                self.input.configure(values=values)
        if self.widget_kind == "images":  # the family's limits (and files come and gone)
            self.input.refresh()
        self._apply_visibility()

    def is_visible(self) -> bool:
        if self.visible_rule is None:
            return True
        prefix = self.path.rsplit(".", 1)[0] if "." in self.path else ""

        def sibling(name):
            return self.cfg.get(f"{prefix}.{name}" if prefix else name)

        try:
            return bool(self.visible_rule(sibling, self.cfg.get))
        except Exception:  # a value of the wrong type while the user types: keep the field shown
            return True

    def _apply_visibility(self) -> None:
        if not hasattr(self, "_pack") or not self.winfo_exists():
            return
        show = self.is_visible()
        if show and not self.shown:
            self._show_in_place()
        elif not show and self.shown:
            self.pack_forget()
        self.shown = show

    # --- the validation message --------------------------------------------------------------

    def _message(self, path: str, message: str | None) -> None:
        if not self.winfo_exists():
            return
        self._messages[path] = message
        shown = [m for m in self._messages.values() if m]
        self.show_error("\n".join(shown) if shown else None)

    def show_error(self, message: str | None) -> None:
        if not self.winfo_exists() or (message or "") == self.error.cget("text"):
            return  # unchanged: configuring the label would redraw it for nothing
        # grid and grid_forget, never grid_remove: CTk re-applies a widget's last grid() call when the
        # UI scale changes, which would bring back every hidden (empty) message line
        if message:
            self.error.configure(text=message)
            self.error.grid(row=1, column=1, sticky="w", padx=6)
        else:
            self.error.configure(text="")
            self.error.grid_forget()

    @property
    def error_text(self) -> str:
        return self.error.cget("text")

    def set_values(self, values: list[str]) -> None:
        """New choices for an option menu or combo box; the current value stays selected."""
        self.values = list(values)
        self.input.configure(values=list(values))

    # --- helpers -------------------------------------------------------------------------------

    def _browse(self, mode: str) -> None:
        current = self.var.get()
        if mode == "dir":
            chosen = filedialog.askdirectory(parent=self, initialdir=current or None)
        elif mode == "file":
            chosen = filedialog.askopenfilename(parent=self, initialfile=current or None,
                                                filetypes=self.filetypes or [("all files", "*")])
        else:
            chosen = filedialog.asksaveasfilename(parent=self, initialfile=current or None,
                                                  filetypes=self.filetypes or [("all files", "*")])
        if chosen:
            self.var.set(chosen)

    def _text_to_var(self, _event=None) -> None:
        text = self.input.get("1.0", "end-1c")
        if text != self.var.get():
            self.var.set(text)

    def _var_to_text(self) -> None:
        text = self.var.get()
        if self.input.get("1.0", "end-1c") != text:
            self.input.delete("1.0", "end")
            self.input.insert("1.0", text)


def centre_over(window, master, width: int | None = None, height: int | None = None) -> None:
    """Place `window` over `master`, centred and a third from its top, kept on the screen; with a
    size, the window gets that size too (CTk scales the size by the window scaling, not the position)."""
    try:
        window.update_idletasks()
        scale = window._get_window_scaling() if hasattr(window, "_get_window_scaling") else 1.0
        w = round(width * scale) if width else window.winfo_reqwidth()
        h = round(height * scale) if height else window.winfo_reqheight()
        x = master.winfo_rootx() + (master.winfo_width() - w) // 2
        y = master.winfo_rooty() + (master.winfo_height() - h) // 3
        x = min(max(0, x), max(0, window.winfo_screenwidth() - w))
        y = min(max(0, y), max(0, window.winfo_screenheight() - h))
        window.geometry(f"{width}x{height}+{x}+{y}" if width and height else f"+{x}+{y}")
    except tk.TclError:
        if width and height:
            window.geometry(f"{width}x{height}")


def show_picture(label, picture) -> None:
    """Show a CTkImage in a CTkLabel, or none (picture None). CTkLabel.configure(image=None) leaves
    the Tk label pointing at the old photo image, which is deleted with its CTkImage: the next
    redraw of the label fails with 'image "pyimageN" doesn't exist'. So the Tk label is cleared
    too, before the caller drops the old picture."""
    label.configure(image=picture)
    if picture is None:
        label._label.configure(image="")


HEADLINE_CHARS = 400  # the bold line stays a few lines tall; the full text is in the box below


class ErrorDialog(ctk.CTkToplevel):
    """A non-modal window: the title, the error line (`message`) first and in bold, then the
    details (a traceback, a log tail) below it, selectable; the main window stays live. OK sits at
    the bottom whatever the text's length (packed before the box that takes the rest), and Escape
    or Return closes the dialog."""

    def __init__(self, master, title: str, message: str, details: str = ""):
        super().__init__(master)
        self.title(title)
        width, height = 620, 300
        centre_over(self, master, width, height)
        self.message = message + (f"\n\n{details}" if details else "")
        self.headline, self.details = message, details
        ctk.CTkLabel(self, text=title, font=ctk.CTkFont(size=15, weight="bold"),
                     text_color=ERROR_COLOR, anchor="w").pack(fill="x", padx=12, pady=(12, 4))
        self.ok_button = ctk.CTkButton(self, text="OK", width=90, command=self.destroy)
        self.ok_button.pack(side="bottom", pady=(4, 12))
        headline = message if len(message) <= HEADLINE_CHARS else message[:HEADLINE_CHARS - 1] + "…"
        ctk.CTkLabel(self, text=headline, font=ctk.CTkFont(weight="bold"), anchor="w", justify="left",
                     wraplength=width - 24).pack(fill="x", padx=12, pady=(0, 4))
        box = ctk.CTkTextbox(self, wrap="word", height=40)
        box.insert("1.0", self.message)
        box.configure(state="disabled")
        box.pack(fill="both", expand=True, padx=12, pady=4)
        for key in ("<Escape>", "<Return>", "<KP_Enter>"):
            self.bind(key, lambda _event: self.destroy())
        self.after(50, self._raise)

    def _raise(self) -> None:
        if self.winfo_exists():
            self.lift()
            self.focus_force()  # so Escape reaches it


def button_row(parent, buttons: list[tuple[str, Callable[[], None]]], **pack):
    row = ctk.CTkFrame(parent, fg_color="transparent")
    row.pack(fill="x", padx=8, pady=4, **pack)
    made = []
    for text, command in buttons:
        b = ctk.CTkButton(row, text=text, width=110, command=command)
        b.pack(side="left", padx=(0, 6))
        made.append(b)
    return row, made
