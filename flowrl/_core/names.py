"""The rule every model (pool) name follows.

A model's name becomes part of stage names (``policy.forward_step``), Ray actor names,
Prometheus labels and checkpoint file names (``<name>.model.bin``), so it is confined to a
small set of characters: no path separator, no dot (the stage-name separator, and so never
``.`` or ``..``), no ``#`` (the separator of a model's second call in a flow), no space.
"""

from __future__ import annotations

import re

from .errors import ConfigError

NAME_RULE = "1 to 128 characters among letters, digits, '_' and '-', not starting with '-'"
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]{0,127}")


def check_name(name: object, where: str) -> str:
    """``name`` if it follows the rule; else a ConfigError naming ``where`` and the rule."""
    if not isinstance(name, str) or _NAME.fullmatch(name) is None:
        raise ConfigError(f"{where}: a model name must be {NAME_RULE} (e.g. 'policy', 'reward_2'), got {name!r}")
    return name
