"""The errors a run reports to its user in one line, and the config's flat field names.

Kept free of jax, flax and lpdec: `train.py` checks its flags, refuses processes that
do not fit together and supervises elastic machines before it imports any of them
(seconds of a process's start; a refused process never pays them).
"""

from __future__ import annotations

from typing import Any


class RunError(Exception):
    """A problem the user must fix before the run can go on; its message is one line.

    `train.py` prints it as `error: <message>` and exits with status 2.
    """


class ConfigError(RunError, ValueError):
    """A config value that cannot work, with a message naming the field."""


def flatten_config(config) -> dict[str, Any]:
    """Every field of `config` as {"a.b": value}, tuples as lists (as JSON gives them back)."""
    return _flatten(config.to_dict() if hasattr(config, "to_dict") else dict(config))


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, name + "."))
        else:
            # JSON has no tuples: compare what a round trip through the meta file gives.
            out[name] = list(value) if isinstance(value, tuple) else value
    return out
