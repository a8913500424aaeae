"""Keeping one non-finite step from costing a node for ever: a guard for the local optimizer.

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

`lpdec.chain` (`chain_order`) builds chains with the guard in place, and
`lpdec.check_chain` refuses a guard around a transform that communicates.
"""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from lpdec import gossip
from lpdec.algorithms import _common
from lpdec.algorithms import declaration
from lpdec.algorithms import health as health_lib

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


DECLARATION = declaration.Declaration(local_apply_if_finite, "wrapper", (LocalIfFiniteState,))
