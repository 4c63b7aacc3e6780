"""The metaclass every config Struct shares, and where a moved key went."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from ..errors import ConfigError


class Settings(msgspec.StructMeta):
    """The metaclass of the config Structs: a keyword a Struct does not have, a missing required
    one or a positional argument is a ``ConfigError`` naming the Struct and its keys (msgspec's
    ``__init__`` raises ``TypeError``), like every other config mistake."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().__call__(*args, **kwargs)
        except TypeError as err:
            keys = ", ".join(getattr(cls, "__struct_fields__", ()))
            raise ConfigError(f"{cls.__name__}: {err}{moved_hint(cls, kwargs)}; its keys are {keys}") from err


def moved_hint(cls: type, given: Mapping[str, Any] | object) -> str:
    """Where the keys of ``given`` that ``cls`` no longer has went (its ``moved_keys``), as
    the tail of an error message; empty when none did."""
    moved: dict[str, str] = getattr(cls, "moved_keys", {})
    if not isinstance(given, Mapping):
        return ""
    found = [f"{key} is now {cls.__name__}.{moved[key]}" for key in given if key in moved]
    return f" ({'; '.join(found)})" if found else ""
