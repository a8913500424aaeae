"""Chains in the order lpdec's algorithms need, and the check of an initialised chain.

`chain(local, *algorithms, on_gradients=())` puts the local optimizer, wrapped
in `local_apply_if_finite`, between the centralized means (on the gradients)
and the gossip algorithms (on its update, reading `params`): the one place a
chain is assembled (the training registry calls it too). `check_chain(opt_state)`
finds, in an initialised state, the misuses a state shows (`lpdec.init_nodes`
runs it): a gossip algorithm before a stateful local optimizer, and a per-node
guard (`optax.apply_if_finite`, `local_apply_if_finite`) around a transform
that communicates. The role of each state is its module's declaration
(`lpdec.algorithms.declaration`).
"""

from __future__ import annotations

from typing import Any

import jax
import optax

from lpdec import algorithms as algorithms_lib
from lpdec.algorithms import declaration
from lpdec.algorithms import local_apply_if_finite
from lpdec.algorithms import master_weights

PyTree = Any


def chain(
    local: optax.GradientTransformation,
    *algorithms: optax.GradientTransformation,
    on_gradients: tuple[optax.GradientTransformation, ...] = (),
) -> optax.GradientTransformationExtraArgs:
    """The local optimizer, guarded, with lpdec's algorithm(s) in their places, on a float32 model.

    `optax.chain(lpdec.choco(...), optax.adam(...))` (gossip first) is accepted by
    optax but gossips raw gradients and lets Adam rescale the consensus step:
    consensus was 253x worse in a test. Here the local optimizer comes first and
    is wrapped in `local_apply_if_finite`; gossip algorithms follow it, and
    centralized means (`lpdec.local_mean`, `lpdec.compressed_mean`) go before it,
    on the gradients. Low-precision (e.g. bfloat16) parameters get a float32
    master copy (`master_weights`): without it gossip moves below a bfloat16 unit
    in the last place are lost and consensus stalls.

    Args:
      local: the local optimizer (must not communicate).
      *algorithms: lpdec transforms applied to its update, e.g. `lpdec.choco(...)`
        (declared role "gossip", or wrappers of one such as `lpdec.shard_over`).
      on_gradients: transforms applied to the gradients before the local
        optimizer (role "mean"), e.g. ``(lpdec.compressed_mean(...),)``.

    Returns:
      `master_weights(optax.chain(*on_gradients, local_apply_if_finite(local),
      *algorithms))`; with float32 parameters that is the chain itself, state included.
    """
    parts = (*on_gradients, local_apply_if_finite.local_apply_if_finite(local), *algorithms)
    # The guarded optimizer alone is not wrapped in a chain of one (its state stays flat).
    return master_weights.master_weights(optax.chain(*parts) if len(parts) > 1 else parts[0])


# Per-node guards: a communicating transform inside one is the unsafe wrapping.
_GUARDS = {
    optax.ApplyIfFiniteState: "optax.apply_if_finite",
    local_apply_if_finite.LocalIfFiniteState: "lpdec.local_apply_if_finite",
}
# Fields through which optax's wrappers hold the state of the transform they wrap.
_INNER_FIELDS = ("inner_state", "inner_opt_state", "inner_states", "inner")


def _parts(state: PyTree, where: str):
    """(kind, name, where) for each transform's state in chain order.

    kind is "gossip", "mean", "whole", "local" (a non-lpdec state holding
    arrays) or "stateless"; a communicating state inside a per-node guard
    raises here.
    """
    role = algorithms_lib.role_of(type(state))
    if role in declaration.COMMUNICATING:
        yield role, type(state).__name__, where
        return
    guard = _GUARDS.get(type(state))
    if guard is not None:
        inner = state.inner_state
        for kind, name, inner_where in _parts(inner, f"{where}.inner_state"):
            if kind in ("gossip", "mean", "whole"):
                raise ValueError(
                    f"opt_state{inner_where} ({name}) is wrapped in {guard}, a per-node "
                    "conditional around a transform that communicates (a node reverted "
                    "alone leaves its neighbours' copies of it wrong, or a collective "
                    "deadlocks): wrap only the local optimizer, "
                    "lpdec.chain(local_opt, gossip) does."
                )
        yield "local", type(state).__name__, where
        return
    if isinstance(state, dict):
        for key in sorted(state):
            yield from _parts(state[key], f"{where}[{key!r}]")
        return
    fields = getattr(state, "_fields", None)
    if fields is None and isinstance(state, (tuple, list)):
        for i, part in enumerate(state):
            yield from _parts(part, f"{where}[{i}]")
        return
    if fields is not None:
        inner = [f for f in fields if f in _INNER_FIELDS]
        if inner:
            for f in inner:
                yield from _parts(getattr(state, f), f"{where}.{f}")
            return
    kind = "local" if jax.tree.leaves(state) else "stateless"
    yield kind, type(state).__name__, where


def check_chain(opt_state: PyTree) -> None:
    """Raises a one-line ValueError for a chain order or wrapping lpdec can see is wrong.

    Looks at an initialised optimizer state (`lpdec.init_nodes` calls this):

    - a gossip algorithm's state before a local optimizer's that holds arrays
      (``optax.chain(lpdec.choco(...), optax.adam(...))``): gossip then runs on
      raw gradients and the optimizer rescales the consensus step;
    - a transform that communicates inside ``optax.apply_if_finite`` or
      ``lpdec.local_apply_if_finite`` (a per-node conditional around a
      collective).

    It cannot see a stateless transform after gossip (``optax.scale(-lr)`` in
    ``optax.chain(lpdec.dpsgd(...), optax.sgd(lr))``, no momentum): the rule is
    in docs/DESIGN.md, "Conventions every algorithm keeps".

    Args:
      opt_state: the state ``tx.init`` returned (per node or stacked).
    """
    parts = list(_parts(opt_state, ""))
    gossip_seen = None
    for kind, name, where in parts:
        if kind == "gossip" and gossip_seen is None:
            gossip_seen = (name, where)
        elif kind == "local" and gossip_seen is not None:
            raise ValueError(
                f"opt_state{gossip_seen[1]} ({gossip_seen[0]}) comes before "
                f"opt_state{where} ({name}) in the chain: a gossip algorithm must come "
                "after the local optimizer (it gossips the local update and reads params); "
                "build it with lpdec.chain(local_opt, gossip)"
            )
