"""Keeping one non-finite step from costing a node for ever, and chains in the right order.

lpdec's algorithms drop a non-finite local update (the node takes no local step
and `Health` counts it), but by then the NaN has gone through the local
optimizer: momentum or Adam moments hold it, every later update of that node is
non-finite and dropped too, and the node stops learning while its neighbours
go on. `local_apply_if_finite` wraps the local (communication-free) optimizer:
on a node whose incoming gradient or resulting update is not finite it keeps
the optimizer state of the last good step and passes on a zero update, so the
node skips that one step and recovers.

Only the local part may be wrapped. A per-node conditional around a transform
that communicates (`optax.apply_if_finite` around a chain that holds a gossip
transform) is unsafe: under `vmap` it reverts one node's gossip state while
its neighbours keep their copies of it, and under `shard_map` it cannot trace
(check_vma) or deadlocks in a collective that one node skips. The select here
is element-wise (`jnp.where`), never a branch, and the wrapped transform must
not communicate.

`chain(local, *algorithms)` is `optax.chain(local_apply_if_finite(local),
*algorithms)`: the order the algorithms need (they gossip the local update and
read `params`), with the guard built in. `check_chain(opt_state)` finds, in an
initialised state, the misuses a state shows (`lpdec.init_nodes` runs it): a
gossip algorithm before a stateful local optimizer, and a per-node guard
(`optax.apply_if_finite`, `local_apply_if_finite`) around a transform that
communicates.
"""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from lpdec import gossip
from lpdec.algorithms import _common
from lpdec.algorithms import choco
from lpdec.algorithms import clipped_gossip
from lpdec.algorithms import compressed_mean
from lpdec.algorithms import d2
from lpdec.algorithms import dcd
from lpdec.algorithms import deepsqueeze
from lpdec.algorithms import diloco
from lpdec.algorithms import dpsgd
from lpdec.algorithms import health as health_lib
from lpdec.algorithms import local_mean
from lpdec.algorithms import master_weights
from lpdec.algorithms import moniqua
from lpdec.algorithms import naive_quantized
from lpdec.algorithms import quant_sgp
from lpdec.algorithms import sparse_push

PyTree = Any


class LocalIfFiniteState(NamedTuple):
    """State of `local_apply_if_finite`.

    Attributes:
      inner_state: the wrapped optimizer's state after the last finite step.
      health: `Health`; `nonfinite_updates` counts the steps this node skipped.
    """

    inner_state: PyTree
    health: health_lib.Health


def _varying_axes(tree: PyTree) -> tuple[str, ...]:
    """The manual mesh axes any leaf of `tree` varies over (none outside shard_map)."""
    axes: set[str] = set()
    for leaf in jax.tree.leaves(tree):
        axes |= set(jax.typeof(leaf).manual_axis_type.varying)
    return tuple(sorted(axes))


def local_apply_if_finite(
    inner: optax.GradientTransformation,
) -> optax.GradientTransformationExtraArgs:
    """Runs `inner` where its input and output are finite; otherwise keeps its last state.

    Use it around the local optimizer only (see the module docstring); `chain`
    does so for you.

    Args:
      inner: a transform that does not communicate (a local optimizer).

    Returns:
      A transform whose update is `inner`'s, or zeros on a node whose incoming
      updates or `inner`'s output hold NaN/Inf; that node's `inner` state stays
      as it was, and `health.nonfinite_updates` counts the skipped step.

    Example:
      >>> tx = optax.chain(
      ...     lpdec.local_apply_if_finite(optax.sgd(0.1, momentum=0.9)),
      ...     lpdec.choco(lpdec.ring(8), lpdec.minmax(8), gamma=0.5),
      ... )
    """
    inner = optax.with_extra_args_support(inner)

    def init_fn(params):
        # Under shard_map the state must vary over the axes the parameters vary over:
        # a per-node select makes it vary, and lax.scan needs the same type in and out.
        axes = _varying_axes(params)
        zero = jnp.zeros((), jnp.int32)
        state = LocalIfFiniteState(inner.init(params), health_lib.Health(zero, zero, zero))
        return gossip.to_varying(state, axes) if axes else state

    def update_fn(updates, state, params=None, **extra_args):
        new_updates, new_inner = inner.update(updates, state.inner_state, params, **extra_args)
        ok = _common.all_finite(updates) & _common.all_finite(new_updates)
        inner_state = jax.tree.map(
            lambda new, old: jnp.where(ok, new, old), new_inner, state.inner_state
        )
        new_updates = jax.tree.map(lambda u: jnp.where(ok, u, jnp.zeros_like(u)), new_updates)
        health = health_lib.count_update(state.health, ok)
        return new_updates, LocalIfFiniteState(inner_state, health)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def chain(
    local: optax.GradientTransformation, *algorithms: optax.GradientTransformation
) -> optax.GradientTransformationExtraArgs:
    """The local optimizer, guarded, then lpdec's algorithm(s), on a float32 model.

    `optax.chain(lpdec.choco(...), optax.adam(...))` (gossip first) is accepted by
    optax but gossips raw gradients and lets Adam rescale the consensus step:
    consensus was 253x worse in a test. Here the local optimizer comes first and
    is wrapped in `local_apply_if_finite`. Low-precision (e.g. bfloat16)
    parameters get a float32 master copy (`master_weights`): without it gossip
    moves below a bfloat16 unit in the last place are lost and consensus stalls.

    Args:
      local: the local optimizer (must not communicate).
      *algorithms: lpdec transforms applied to its update, e.g. `lpdec.choco(...)`.

    Returns:
      `master_weights(optax.chain(local_apply_if_finite(local), *algorithms))`;
      with float32 parameters that is the chain itself, state included.
    """
    return master_weights.master_weights(optax.chain(local_apply_if_finite(local), *algorithms))


# The states of the transforms that gossip the model: they come after the local
# optimizer, on its update, and read `params`.
GOSSIP_STATES = (
    choco.ChocoState,
    choco.ChocoPerPeerState,
    clipped_gossip.ClippedGossipState,
    d2.D2State,
    dcd.DCDState,
    deepsqueeze.DeepSqueezeState,
    dpsgd.DPSGDState,
    moniqua.MoniquaState,
    naive_quantized.NaiveQuantizedState,
    quant_sgp.QuantSGPState,
    sparse_push.SparsePushState,
)
# The states of the centralized transforms: they come first, on gradients.
MEAN_STATES = (compressed_mean.CompressedMeanState, local_mean.LocalMeanState)
# Whole optimizers that communicate (they hold their local optimizer inside).
WHOLE_STATES = (diloco.DiLoCoState,)
_COMMUNICATING = GOSSIP_STATES + MEAN_STATES + WHOLE_STATES
# Per-node guards: a communicating transform inside one is the unsafe wrapping.
_GUARDS = {
    optax.ApplyIfFiniteState: "optax.apply_if_finite",
    LocalIfFiniteState: "lpdec.local_apply_if_finite",
}
# Fields through which optax's wrappers hold the state of the transform they wrap.
_INNER_FIELDS = ("inner_state", "inner_opt_state", "inner_states", "inner")


def _parts(state: PyTree, where: str):
    """(kind, name, where) for each transform's state in chain order.

    kind is "gossip", "mean", "whole", "local" (a non-lpdec state holding
    arrays) or "stateless"; a communicating state inside a per-node guard
    raises here.
    """
    if isinstance(state, _COMMUNICATING):
        kind = (
            "gossip"
            if isinstance(state, GOSSIP_STATES)
            else "mean"
            if isinstance(state, MEAN_STATES)
            else "whole"
        )
        yield kind, type(state).__name__, where
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
    in README "Composing with optax".

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
