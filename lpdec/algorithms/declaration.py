"""What an algorithm module declares once, for the rest of lpdec to derive from.

Every module of `lpdec.algorithms` that defines a transform ends with

    DECLARATION = declaration.Declaration(
        choco, "gossip", (ChocoState, ChocoPerPeerState), Hyperparams
    )

and nothing else in lpdec lists it again: `lpdec.__all__` exports the
factory, the state classes and `also`; `lpdec.check_chain` reads each state's
role; the training registry places the algorithm in the chain by its role; the
API tests check that the factory's signature is its hyperparameter record.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any
from typing import Literal

# Where a transform's state sits in a chain (`lpdec.check_chain`, docs/DESIGN.md):
# - "gossip": after the local optimizer, on its update; reads params; communicates.
# - "mean": before the local optimizer, on gradients; communicates (a centralized mean).
# - "whole": a whole optimizer that holds the local one inside and communicates (DiLoCo).
# - "local": a per-node transform that never communicates.
# - "wrapper": holds another transform's state (`inner...` fields), read through.
Role = Literal["gossip", "mean", "whole", "local", "wrapper"]
ROLES = ("gossip", "mean", "whole", "local", "wrapper")
COMMUNICATING = ("gossip", "mean", "whole")


@dataclasses.dataclass(frozen=True)
class Declaration:
    """An algorithm module's facts, written once in the module.

    Attributes:
      factory: the public factory (``lpdec.<name>``); its name is the algorithm's.
      role: where its state sits in a chain (see `Role`).
      states: its state classes (NamedTuples), exported as ``lpdec.<State>``.
      hyperparams: the frozen record of its hyperparameters that `init`/`step`
        take; the factory's parameters are exactly its fields, with the same
        defaults (tests/test_api.py checks it). None for a wrapper of another
        transform.
      also: further public names of the module (functions or classes), exported too.
    """

    factory: Callable[..., Any]
    role: Role
    states: tuple[type, ...]
    hyperparams: type | None = None
    also: tuple[Any, ...] = ()

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"{self.factory.__name__}: role must be one of {ROLES}")

    @property
    def name(self) -> str:
        return self.factory.__name__

    @property
    def exports(self) -> dict[str, Any]:
        """The public names this declaration adds to `lpdec`."""
        return {obj.__name__: obj for obj in (self.factory, *self.states, *self.also)}
