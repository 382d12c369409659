"""One readable line per config problem, each naming its dotted path (`concepts[0].repeats: must be >= 1`)."""

from __future__ import annotations

import re
import types
import typing
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticCustomError

from modules.config.tagged import TaggedUnion
from modules.errors import UserError
from modules.util.did_you_mean import did_you_mean


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
        expected = str(ctx.get("expected"))
        near = did_you_mean(value, re.findall(r"'([^']*)'", expected)) if isinstance(value, str) else ""
        return f"must be one of {expected} (got {value!r}{near})"
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


def known_keys(annotation: Any, steps: tuple[Any, ...], data: Any = None, metadata: tuple[Any, ...] = ()) -> set[str]:
    """The keys the object at location `steps` below a value of `annotation` takes, for the "did
    you mean" of an unknown key; `data` (the value validated) picks a tagged section's member by
    its `type`. Empty where the walk cannot tell."""
    def below(step: Any) -> Any:
        try:
            return data[step]
        except (KeyError, IndexError, TypeError):
            return None

    for meta in metadata:
        if isinstance(meta, TaggedUnion):
            tag = data.get("type", meta.default) if isinstance(data, dict) else meta.default
            member = meta.members().get(tag)
            return known_keys(member.config_class, steps, data) if member is not None else set()
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return known_keys(args[0], steps, data, tuple(args[1:]) + metadata)
    if origin in (typing.Union, types.UnionType):
        return {key for arg in args for key in known_keys(arg, steps, data, metadata)}
    if origin in (list, tuple) and args and steps and isinstance(steps[0], int):
        return known_keys(args[0], steps[1:], below(steps[0]))
    if origin is dict and len(args) == 2 and steps and isinstance(steps[0], str):
        return known_keys(args[1], steps[1:], below(steps[0]))
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        if not steps:
            return set(annotation.model_fields)
        field = annotation.model_fields.get(steps[0]) if isinstance(steps[0], str) else None
        if field is None:
            return set()
        return known_keys(field.annotation, steps[1:], below(steps[0]), tuple(field.metadata))
    return set()


def format_validation_error(error: ValidationError, model: type[BaseModel] | None = None,
                            data: Any = None) -> list[str]:
    """`model`, the class validated (and `data`, what it was given), lets an unknown key name the
    nearest known one ("did you mean")."""
    lines = []
    for e in error.errors():
        loc = tuple(e["loc"]) + tuple((e.get("ctx") or {}).get("at", ()) if e["type"] == "located" else ())
        message = _message(e)
        if e["type"] == "extra_forbidden" and model is not None and loc and isinstance(loc[-1], str):
            message += did_you_mean(loc[-1], known_keys(model, loc[:-1], data))
        lines.append(f"{dotted_path(loc)}: {message}")
    return lines
