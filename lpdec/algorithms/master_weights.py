"""Low-precision parameters, float32 training: a float32 master copy of the model.

With bfloat16 (or float16) parameters, every step's ``params + updates`` is
rounded to 8 significant bits. Gossip moves that are smaller than half a unit in
the last place of a parameter are lost, and the algorithms' float32 buffers
(CHOCO's public copies, DCD's replicas, error-feedback residuals) track a model
that moved by the unrounded amount: the two drift apart, and consensus stalls
several units in the last place apart (a spread of 5e-2 for CHOCO on a model of
magnitude 1, against 3e-6 in float32).

`master_weights(inner)` keeps the model in float32 inside the optimizer state
and runs `inner` (the local optimizer and the algorithm) on it: `inner` sees
float32 gradients and float32 `params`, and every sum happens in float32. The
returned update moves the caller's low-precision parameters to the float32
model rounded to their dtype; the forward and backward passes run at that
rounding, as in mixed-precision training. Float32 parameters need no copy:
then `master_weights(inner)` is `inner`, state included.

Memory: one float32 copy of the low-precision leaves (4 bytes per element).
"""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from lpdec.algorithms import _common
from lpdec.algorithms import declaration

PyTree = Any


class MasterWeightsState(NamedTuple):
    """State of `master_weights` (only for parameters that are not all float32).

    Attributes:
      master: float32 tree like the parameters: the model itself; the caller's
        parameters are this rounded to their dtype.
      inner_state: the wrapped transform's state, built on `master`.
    """

    master: PyTree
    inner_state: PyTree


def _all_float32(params: PyTree) -> bool:
    return all(jnp.result_type(x) == jnp.float32 for x in jax.tree.leaves(params))


def master_weights(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """Runs `inner` on a float32 copy of low-precision parameters.

    Wrap the whole chain (local optimizer and algorithm): the algorithm must read
    the float32 model as its `params`. `lpdec.chain` does this for you.

    Args:
      inner: the transform to run in float32, e.g. ``optax.chain(optax.sgd(0.1),
        lpdec.choco(...))``.

    Returns:
      A transform whose state is `MasterWeightsState` when some parameter leaf is
      not float32, and `inner`'s own state (and update) when all are.

    Example:
      >>> tx = lpdec.master_weights(
      ...     optax.chain(optax.sgd(0.1), lpdec.choco(lpdec.ring(8), lpdec.minmax(8)))
      ... )
      >>> # params in bfloat16; tx keeps the float32 model in its state
    """
    inner = optax.with_extra_args_support(inner)

    def init_fn(params):
        _common.check_float_params(params, "master_weights")
        if _all_float32(params):
            return inner.init(params)
        master = jax.tree.map(lambda p: jnp.array(p, dtype=jnp.float32, copy=True), params)
        return MasterWeightsState(master, inner.init(master))

    def update_fn(updates, state, params=None, **extra_args):
        if not isinstance(state, MasterWeightsState):
            return inner.update(updates, state, params, **extra_args)
        params = _common.require_params(params, "master_weights")
        new_updates, inner_state = inner.update(
            _common.f32(updates), state.inner_state, state.master, **extra_args
        )
        master = jax.tree.map(lambda m, u: m + u.astype(jnp.float32), state.master, new_updates)
        # params + this lands on `master` rounded to the parameters' dtype (up to the
        # rounding of the difference itself); `master` stays the model, so nothing drifts.
        to_master = jax.tree.map(
            lambda m, p: (m - p.astype(jnp.float32)).astype(p.dtype), master, params
        )
        return to_master, MasterWeightsState(master, inner_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


DECLARATION = declaration.Declaration(master_weights, "wrapper", (MasterWeightsState,))
