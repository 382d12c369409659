"""One readable line per config problem, each naming its dotted path (`concepts[0].repeats: must be >= 1`)."""

from __future__ import annotations

from modules.errors import UserError

from typing import Any

from pydantic import ValidationError
from pydantic_core import PydanticCustomError


class ConfigError(UserError, ValueError):
    """A config that cannot be used. `problems` holds one line per problem."""

    def __init__(self, problems: list[str], source: str | None = None):
        self.problems = problems
        self.source = source
        head = f"invalid config ({source})" if source else "invalid config"
        super().__init__(head + ":\n" + "\n".join(f"  {p}" for p in problems))


def dotted_path(loc: tuple[Any, ...]) -> str:
    """('concepts', 0, 'repeats') -> 'concepts[0].repeats' (the tagged sections put no tag in a
    location: modules/config/tagged.py validates by `type` itself)."""
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
    return text or "(top level)"


def _message(error: dict[str, Any]) -> str:
    kind = error["type"]
    ctx = error.get("ctx") or {}
    value = error.get("input")
    if kind == "extra_forbidden":
        return "unknown key"
    if kind == "missing":
        return "required"
    if kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        op = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}[kind]
        bound = next(iter(ctx.values()))
        return f"must be {op} {bound} (got {value!r})"
    if kind == "multiple_of":
        return f"must be a multiple of {ctx.get('multiple_of')} (got {value!r})"
    if kind == "literal_error":
        return f"must be one of {ctx.get('expected')} (got {value!r})"
    if kind in ("int_parsing", "int_type", "int_from_float"):
        return f"must be a whole number (got {value!r})"
    if kind in ("float_parsing", "float_type"):
        return f"must be a number (got {value!r})"
    if kind in ("bool_parsing", "bool_type"):
        return f"must be true or false (got {value!r})"
    if kind in ("string_type",):
        return f"must be text (got {value!r})"
    if kind in ("list_type", "tuple_type", "dict_type", "model_type", "model_attributes_type"):
        expected = {"list_type": "a list", "tuple_type": "a list", "dict_type": "an object",
                    "model_type": "an object", "model_attributes_type": "an object"}[kind]
        return f"must be {expected} (got {value!r})"
    if kind == "value_error":
        return str(ctx.get("error", error["msg"]))
    return error["msg"]


def located_error(text: str, *at: str | int) -> PydanticCustomError:
    """An error a validator raises about something below the field it validates: `at` is the
    rest of the path (`located_error("unknown part", "parts", "foo")` in `model` reads
    `model.parts.foo: unknown part`)."""
    return PydanticCustomError("located", "{text}", {"text": text, "at": list(at)})


def format_validation_error(error: ValidationError) -> list[str]:
    lines = []
    for e in error.errors():
        loc = tuple(e["loc"]) + tuple((e.get("ctx") or {}).get("at", ()) if e["type"] == "located" else ())
        lines.append(f"{dotted_path(loc)}: {_message(e)}")
    return lines
