"""Decentralized and compressed-communication algorithms, one module each.

Each module holds its State NamedTuple, its frozen `Hyperparams` record, pure
`init`/`step` functions and an optax factory of the module's name, and ends
with a `DECLARATION` (`lpdec.algorithms.declaration`): this package collects
them (`declarations()`), and `lpdec/__init__.py` exports what they name. The
factories are not imported into this package, so `lpdec.algorithms.choco`
stays the module.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil

from lpdec.algorithms import declaration as declaration_lib

# Modules that are not algorithms (helpers, the declaration itself, the chain rules).
_NOT_ALGORITHMS = frozenset({"declaration", "chain_order", "health"})


@functools.cache
def declarations() -> tuple[declaration_lib.Declaration, ...]:
    """Every algorithm module's `DECLARATION`, sorted by name.

    A public module of this package that is not listed in `_NOT_ALGORITHMS`
    must declare itself: a module without a `DECLARATION` is an error here, not
    an algorithm that quietly goes missing from `lpdec`.
    """
    found = []
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("_") or info.name in _NOT_ALGORITHMS:
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        declared = getattr(module, "DECLARATION", None)
        if not isinstance(declared, declaration_lib.Declaration):
            raise ImportError(f"{module.__name__} has no DECLARATION (see algorithms.declaration)")
        found.append(declared)
    return tuple(sorted(found, key=lambda d: d.name))


def role_of(state_or_factory) -> declaration_lib.Role | None:
    """The declared role of an algorithm's factory or state class (None: not lpdec's)."""
    for declared in declarations():
        if state_or_factory is declared.factory or state_or_factory in declared.states:
            return declared.role
    return None


def exports() -> dict[str, object]:
    """The public names every declaration adds to `lpdec`, name -> object."""
    names: dict[str, object] = {}
    for declared in declarations():
        for name, obj in declared.exports.items():
            if names.setdefault(name, obj) is not obj:
                raise ImportError(f"two algorithm modules export the name {name!r}")
    return names
