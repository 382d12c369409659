"""Declared unions: the config's `type`-tagged choices (adapter algorithm, training method,
optimizer), each member declared in its own file.

A member is a pydantic config class whose `type` is `Literal[<its name>]`, the implementation
that config drives (a "module:attr" string, imported only when a run needs it, so the config
stays torch-free; or the object itself, for a member defined at runtime), and its traits: what
the member supports, as a frozen dataclass the union declares, so the rest of the code asks a
trait and never tests a member's name. Built-in members sit one per file in a package of this
one (modules/config/adapters/, methods/, optimizers/); every module there is imported the first
time the union's members are read, and each registers itself on import.

A union validates its section by its `type` at validation time (no schema is rebuilt when a
member is added), serializes the member with its own fields, and gives the JSON schema a
`oneOf` of the members. `retype` is the one rule for what survives a change of `type` (the
loader's layers, `--set`, the GUI's choices).
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticCustomError, PydanticKnownError, core_schema

from modules.util.did_you_mean import did_you_mean


@dataclass(frozen=True)
class Member:
    name: str
    config_class: type[BaseModel]
    implementation: Any  # "module:attr" or the object itself
    traits: Any  # an instance of the union's traits dataclass

    def load(self) -> Any:
        """The implementation, imported on first use."""
        if not isinstance(self.implementation, str):
            return self.implementation
        module, _, attr = self.implementation.partition(":")
        return getattr(importlib.import_module(module), attr)


class TaggedUnion:
    """The members of one tagged section (`adapter`, `method`, `optimizer`). Used as pydantic
    metadata: `Annotated[Base, UNION]` validates and serializes by the registered members."""

    def __init__(self, section: str, *, base: type[BaseModel], default: str, traits: type, package: str):
        self.section, self.base, self.default = section, base, default
        self.traits_class = traits  # a frozen dataclass with a default for every trait
        self.package = package  # the built-in members' files, imported on first read
        self._members: dict[str, Member] = {}
        self._found = False

    # --- registration ---------------------------------------------------------------------

    def register(self, config_class: type[BaseModel], implementation: Any, **traits: Any) -> type[BaseModel]:
        """Declare a member; returns the config class (so a file can assign it)."""
        field = config_class.model_fields.get("type")
        name = field.default if field is not None else None
        if not isinstance(name, str) or not name or not issubclass(config_class, self.base):
            raise TypeError(f"{config_class.__name__}: a {self.section} member subclasses {self.base.__name__} "
                            f"and declares `type: Literal[<name>] = <name>` (got type default {name!r})")
        taken = self._members.get(name)
        if taken is not None and taken.config_class is not config_class:
            raise TypeError(f"{config_class.__name__}: {self.section}.type {name!r} is taken by "
                            f"{taken.config_class.__name__}")
        try:
            declared = self.traits_class(**traits)
        except TypeError as error:
            known = ", ".join(f.name for f in dataclasses.fields(self.traits_class))
            raise TypeError(f"{config_class.__name__}: {error} (the {self.section} traits: {known})") from None
        self._members[name] = Member(name, config_class, implementation, declared)
        return config_class

    def unregister(self, name: str) -> None:
        """Remove a member (a test's own)."""
        self._members.pop(name, None)

    # --- reading --------------------------------------------------------------------------

    def members(self) -> dict[str, Member]:
        """Every member by name, the default first, then in the order they registered."""
        if not self._found:
            self._found = True
            package = importlib.import_module(self.package)
            for info in pkgutil.iter_modules(package.__path__):
                importlib.import_module(f"{self.package}.{info.name}")
        return dict(sorted(self._members.items(), key=lambda item: item[0] != self.default))

    def names(self) -> list[str]:
        return list(self.members())

    def member(self, name: str) -> Member:
        members = self.members()
        if name not in members:
            raise ValueError(f"{self.section}.type: unknown type {name!r} (known: {', '.join(members)})")
        return members[name]

    def config_class(self, name: str) -> type[BaseModel]:
        return self.member(name).config_class

    def traits(self, name: str) -> Any:
        return self.member(name).traits

    def default_config(self) -> BaseModel:
        return self.config_class(self.default)()

    # --- a change of type -----------------------------------------------------------------

    def retype(self, section: Any, new_type: Any) -> Any:
        """`section` (a dict of this union) once its type becomes `new_type`: the settings the new
        member declares as the old one does (same type and default: a LoRA's rank for LoKr, AdamW's
        betas for Lion) are kept, the rest dropped (OFT has no rank; Prodigy's lr is a multiplier,
        not AdamW's lr). Anything not a known change of type is returned as it is."""
        members = self.members()
        if not isinstance(section, dict) or new_type not in members:
            return section
        old_type = section.get("type", self.default)
        if old_type == new_type or old_type not in members:
            return section
        old = members[old_type].config_class.model_fields
        new = members[new_type].config_class.model_fields
        kept = {key: value for key, value in section.items()
                if key != "type" and key in new and key in old and _declared_alike(old[key], new[key])}
        return {"type": new_type, **kept}

    # --- pydantic -------------------------------------------------------------------------

    def validate(self, data: Any) -> BaseModel:
        members = self.members()
        if isinstance(data, BaseModel):
            if any(type(data) is m.config_class for m in members.values()):
                return data
            data = data.model_dump()
        if not isinstance(data, dict):
            raise PydanticKnownError("dict_type")
        kind = data.get("type", self.default)
        if kind not in members:
            raise ValidationError.from_exception_data(self.section, [{
                "type": PydanticCustomError("unknown_type", "unknown type {kind}{suggestion} (known: {known})",
                                            {"kind": repr(kind), "known": ", ".join(members),
                                             "suggestion": self._suggestion(kind, members)}),
                "loc": ("type",), "input": kind}])
        return members[kind].config_class.model_validate(data)

    def _suggestion(self, kind: Any, members: dict[str, Member]) -> str:
        """What an unknown `type` may have meant: a member's option of that name (DoRA is LoRA's
        `dora`), else the nearest member's name."""
        if not isinstance(kind, str):
            return ""
        for name, member in members.items():
            if kind != "type" and kind in member.config_class.model_fields:
                return f"; {kind} is an option of type {name!r} ({self.section}.{kind})"
        return did_you_mean(kind, members)

    def __get_pydantic_core_schema__(self, _source: Any, _handler: Any) -> core_schema.CoreSchema:
        def serialize(value: BaseModel, info: Any) -> Any:
            return value.model_dump(mode=info.mode, by_alias=info.by_alias, exclude_unset=info.exclude_unset,
                                    exclude_defaults=info.exclude_defaults, exclude_none=info.exclude_none,
                                    round_trip=info.round_trip)

        return core_schema.no_info_plain_validator_function(
            self.validate, serialization=core_schema.plain_serializer_function_ser_schema(serialize, info_arg=True))

    def __get_pydantic_json_schema__(self, _schema: Any, handler: Any) -> dict:
        return {"oneOf": [handler(m.config_class.__pydantic_core_schema__) for m in self.members().values()]}

    def __repr__(self) -> str:
        return f"TaggedUnion({self.section!r})"


def _declared_alike(old: Any, new: Any) -> bool:
    """Whether two members declare a field alike: the same type and the same default."""
    return (old.annotation == new.annotation and old.default == new.default
            and old.default_factory == new.default_factory)
