r"""D-PSGD: full-precision gossip averaging, the decentralized baseline.

.. math::

  x_i^{+} = \sum_j W_{ij} x_j + u_i

(combine-then-adapt: the exchange of x does not wait for the gradient, so it
can overlap with the backward pass). Extra memory: none beyond a step counter.
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
from lpdec.topology import Topology


class DPSGDState(NamedTuple):
    """State of `dpsgd`.

    Attributes:
      count: shape=(), dtype=int32; steps taken (picks the round of a
        time-varying topology).
      health: non-finite counters (`lpdec.Health`).
    """

    count: jax.Array  # type: ignore[assignment]  # a field shadowing tuple.count, as in optax
    health: health_lib.Health


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hyperparams:
    """`dpsgd`'s arguments, validated on construction; `init` and `step` read them."""

    topology: Topology
    axis_name: gossip.AxisName = "nodes"

    def __post_init__(self):
        _common.check_topology(self.topology, "dpsgd", require="row_stochastic")


def init(params: optax.Params, hp: Hyperparams) -> DPSGDState:
    """The state at step 0; must run under `axis_name`."""
    del params
    gossip.require_axis(hp.axis_name, "dpsgd's init", topology=hp.topology)
    return DPSGDState(count=jnp.zeros((), jnp.int32), health=health_lib.init(hp.axis_name))


def step(
    updates: optax.Updates,
    state: DPSGDState,
    params: optax.Params,
    hp: Hyperparams,
) -> tuple[optax.Updates, DPSGDState]:
    """One D-PSGD step; must run under the named axis `axis_name`."""
    gossip.require_axis(hp.axis_name, "dpsgd", topology=hp.topology)
    updates, _, health = _common.guard_updates(updates, state.health)
    mixed, skipped = gossip.in_round(
        hp.topology, state.count, lambda r: gossip.mix(params, r, axis_name=hp.axis_name)
    )
    new = jax.tree.map(lambda m, u: m + u.astype(jnp.float32), mixed, updates)
    health = health_lib.count_received(health, skipped)
    return _common.as_updates(new, params), DPSGDState(state.count + 1, health)


def dpsgd(
    topology: Topology, *, axis_name: gossip.AxisName = "nodes"
) -> optax.GradientTransformationExtraArgs:
    r"""D-PSGD: gossip-average the parameters in full precision, then add the local update.

    .. math::

      x_i^{+} = \sum_j W_{ij} x_j + u_i

    where :math:`W` is `topology.mixing_matrix(step)` and :math:`u_i` the
    incoming update (the local optimizer's step). Communication per step: the
    parameters, once per edge class, in their own dtype.

    Args:
      topology: a row-stochastic `Topology` (static or time-varying). With a
        row- but not column-stochastic W the nodes agree on a weighted, not the
        plain, average; use `quant_sgp`/`sparse_push` for such graphs.
      axis_name: the named axis whose instances are the nodes; the transform
        must run under it (`jax.shard_map` or `jax.vmap(axis_name=...)`).

    Returns:
      An optax transform to put last in the chain; `update` needs `params`.

    Example:
      >>> tx = optax.chain(optax.sgd(0.1), lpdec.dpsgd(lpdec.ring(8), axis_name="nodes"))

    References:
      Lian et al., Can Decentralized Algorithms Outperform Centralized
      Algorithms?, NeurIPS 2017, https://arxiv.org/abs/1705.09056
    """
    hp = Hyperparams(**locals())

    def init_fn(params):
        _common.check_float_params(params, "dpsgd")
        return init(params, hp)

    def update_fn(updates, state, params=None, **extra_args):
        del extra_args
        return step(updates, state, _common.require_params(params, "dpsgd"), hp)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


DECLARATION = declaration.Declaration(dpsgd, "gossip", (DPSGDState,), Hyperparams)
