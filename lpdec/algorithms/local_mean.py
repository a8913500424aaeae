r"""Full-precision mean of the updates over a named axis: data parallelism, e.g. within a node.

The uncompressed, single-round counterpart of `compressed_mean`: one
all-reduce. On a 2-axis mesh it averages the gradients of a node's
accelerators before a decentralized algorithm gossips between the nodes.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from lpdec import gossip
from lpdec.algorithms import _common
from lpdec.algorithms import declaration
from lpdec.algorithms import health as health_lib


class LocalMeanState(NamedTuple):
    """State of `local_mean`.

    Attributes:
      health: non-finite counters (`lpdec.Health`); updates dropped on this
        rank (``nonfinite_updates``) and on the other ranks
        (``nonfinite_received``).
    """

    health: health_lib.Health


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hyperparams:
    """`local_mean`'s arguments, validated on construction; `init` and `step` read them."""

    axis_name: gossip.AxisName

    def __post_init__(self):
        if not _common.is_axis_name(self.axis_name):
            raise TypeError(
                "local_mean: axis_name must be an axis name or a tuple of distinct axis names; "
                f"got {self.axis_name!r}."
            )


def init(params: optax.Params, hp: Hyperparams) -> LocalMeanState:
    """The state at step 0; must run under `axis_name`."""
    del params
    gossip.require_axis(hp.axis_name, "local_mean's init")
    return LocalMeanState(health=health_lib.init(hp.axis_name))


def step(
    updates: optax.Updates,
    state: LocalMeanState,
    hp: Hyperparams,
) -> tuple[optax.Updates, LocalMeanState]:
    """The mean of `updates` over `axis_name`; must run under that named axis."""
    size = gossip.require_axis(hp.axis_name, "local_mean")
    updates, ok, health = _common.guard_updates(updates, state.health)
    # A rank with NaN/Inf sends zeros and is left out of the count, so the others'
    # mean is unaffected; sum and count travel in one all-reduce.
    total, contributors = gossip.local_sum(
        (_common.f32(updates), ok.astype(jnp.float32)), axis_name=hp.axis_name
    )
    scale = 1.0 / jnp.maximum(contributors, 1.0)
    mean = jax.tree.map(lambda t, u: (t * scale).astype(u.dtype), total, updates)
    dropped = (size - contributors).astype(jnp.int32) - jnp.where(ok, 0, 1).astype(jnp.int32)
    return mean, LocalMeanState(health_lib.count_received(health, dropped))


def local_mean(*, axis_name: gossip.AxisName) -> optax.GradientTransformationExtraArgs:
    r"""Mean of the incoming updates over the named axis `axis_name`, in full precision.

    .. math::

      \bar u = \frac{1}{|F|} \sum_{l \in F} u_l

    :math:`u_l` is the update of rank l along `axis_name` (over all its axes,
    for a tuple) and F the ranks whose update is finite (all of them,
    normally: then it is `lax.pmean`). Every rank gets the same :math:`\bar u`.

    Put it FIRST in the chain, on the gradients. It must run under
    `axis_name` (`jax.shard_map` or `jax.vmap(axis_name=...)`).

    Args:
      axis_name: the named axis to average over (e.g. the accelerators of a
        node on a 2-axis mesh), or a tuple of axis names to average over all
        of them at once (``("machines", "workers")``: every device of a 2-D
        layout; ``("nodes", "local")``: every node of a nested one).

    Returns:
      An optax transform whose `init` and `update` must run under
      `axis_name`; `update` ignores `params`.

    Example:
      >>> tx = optax.chain(
      ...     lpdec.local_mean(axis_name="local"),
      ...     optax.sgd(0.1),
      ...     lpdec.dpsgd(lpdec.ring(4), axis_name="nodes"),
      ... )
    """
    hp = Hyperparams(**locals())

    def init_fn(params):
        _common.check_float_params(params, "local_mean")
        return init(params, hp)

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        return step(updates, state, hp)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


DECLARATION = declaration.Declaration(local_mean, "mean", (LocalMeanState,), Hyperparams)
