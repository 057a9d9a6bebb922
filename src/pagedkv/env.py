"""Environment switches, read and checked one way.

pagedkv's defaults are the routes measured best; a few environment variables switch a route for
comparison or debugging (the README lists them). A typo must not silently select the default, so
each switch names its choices, and any other value is a `ConfigError` naming the variable.
"""

from __future__ import annotations

import os

from pagedkv.errors import ConfigError


def env_choice(name: str, choices: tuple[str, ...], default: str | None = None) -> str | None:
    """The value of environment variable `name` (one of `choices`), or `default` when it is unset or empty."""
    value = os.environ.get(name) or default
    if value is not None and value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return value
