"""Tables of choices by name: an `Entry` per name, its config fields, its checks.

`registry` (the algorithms, data sets, topologies, compressors) and `optimizers`
(schedules, local optimizers, DiLoCo's outer step) are tables of entries;
`build(config, field, table, ...)` checks and builds the one the config names,
from a view of the config that holds the entry's fields only.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable
from typing import Any

import ml_collections

from train_lib.errors import ConfigError


def fields_view(config, fields: tuple[str, ...]) -> types.SimpleNamespace:
    """The named fields of `config` (a ConfigDict or a dict) as attributes, and no others."""
    return types.SimpleNamespace(**{field: field_value(config, field) for field in fields})


def field_value(config, field: str):
    """`config[field]`; a dotted field ("model_kwargs.vocab_size") it lacks is None."""
    try:
        return config[field]
    except KeyError:
        if "." in field:
            return None
        raise


@dataclasses.dataclass(frozen=True)
class Entry:
    """A choice by name: `build(view, *args)` reads only the config fields in `fields`.

    `check(view)`, if given, raises a ConfigError for values the entry cannot use;
    its view holds `fields` and `check_fields` (fields it checks but `build` does
    not read).
    """

    build: Callable[..., Any]
    fields: tuple[str, ...] = ()
    check: Callable[[types.SimpleNamespace], None] | None = None
    check_fields: tuple[str, ...] = ()


def choose(config: ml_collections.ConfigDict, field: str, table: dict[str, Any]):
    """The entry `table[config[field]]`, or a ConfigError listing the valid names."""
    name = config[field]
    if name not in table:
        raise ConfigError(f"config.{field}={name!r} is not one of: {', '.join(table)}.")
    return table[name]


def check(
    config: ml_collections.ConfigDict,
    field: str,
    table: dict[str, Entry],
    overrides: dict[str, Any] | None = None,
) -> Entry:
    """The entry `table[config[field]]` after its own `check` of the config's values.

    Builds nothing, so `setup` runs it for every choice before any object exists.
    """
    entry = choose(config, field, table)
    if entry.check is not None:
        names = entry.fields + entry.check_fields
        values = {f: field_value(config, f) for f in names} | dict(overrides or {})
        entry.check(fields_view(values, names))
    return entry


def build(
    config: ml_collections.ConfigDict,
    field: str,
    table: dict[str, Entry],
    *args,
    overrides: dict[str, Any] | None = None,
    checked: bool = False,
):
    """Checks and builds `table[config[field]]`; a ValueError/TypeError becomes one ConfigError.

    `overrides` replaces config values the entry reads (a hierarchical run sizes the
    topology to its machines: ``overrides={"num_nodes": machines}``). `checked`: the
    caller ran `check` on these values already (`setup.check_values` checks every
    choice once, before anything is built), so only the build runs.
    """
    entry = choose(config, field, table) if checked else check(config, field, table, overrides)
    values = {f: field_value(config, f) for f in entry.fields} | dict(overrides or {})
    try:
        return entry.build(fields_view(values, entry.fields), *args)
    except ConfigError:
        raise
    except (ValueError, TypeError) as error:
        raise ConfigError(f"config.{field}={config[field]!r}: {error}") from None
