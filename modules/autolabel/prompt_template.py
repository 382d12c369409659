"""The prompt template of a labelling run: text with `{name}` (the image's file name without its
suffix) and `{caption}` (its caption now, "" where none); `{{` and `}}` are literal braces."""

from __future__ import annotations

import string
from pathlib import Path

from modules.errors import UserError

PLACEHOLDERS = ("name", "caption")


def check_template(template: str, option: str = "--prompt") -> str:
    """The template, or one message naming the placeholder or brace that is wrong."""
    try:
        fields = [field for _, field, spec, _ in string.Formatter().parse(template) if field is not None]
    except ValueError as error:
        raise UserError(f"{template!r}: {error} (write {{{{ and }}}} for literal braces)", field=option) from None
    for field in fields:
        if field not in PLACEHOLDERS:
            raise UserError(f"unknown placeholder {{{field}}} in {template!r} (known: "
                            f"{', '.join('{' + name + '}' for name in PLACEHOLDERS)})", field=option)
    return template


def fill(template: str, image: Path, caption: str) -> str:
    return template.format(name=image.stem, caption=caption)
