r"""Naive quantized gossip (seed 003, eq. 4): average quantized models; a baseline that fails.

.. math::

  x_i^{+} = W_{ii} x_i + \sum_{j \ne i} W_{ij} \, \mathrm{dec}(Q(x_j)) + u_i

Models, unlike gradients, do not shrink near an optimum, so the quantization
error of Q(x_j) does not vanish: with an unbiased quantizer of fixed
resolution δ the expected squared gradient norm stays above
δ²ρ²/(8(1 + ρ²)) at every node and step, whatever the step size (seed 003,
Theorem 1; ρ the smallest non-zero weight of W). lpdec keeps it to show
what Moniqua, CHOCO and DCD fix. Memory: none beyond a step counter and a key.
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
from lpdec.compress import Modulo
from lpdec.compress import base as compress_base
from lpdec.compress import tree as compress_tree
from lpdec.topology import Topology


class NaiveQuantizedState(NamedTuple):
    """State of `naive_quantized`.

    Attributes:
      count: shape=(), dtype=int32; steps taken (picks the round of a
        time-varying topology).
      key: shape=(2,), dtype=uint32; shared by all nodes (`_common.node_key`).
      health: non-finite counters (`lpdec.Health`).
    """

    count: jax.Array  # type: ignore[assignment]  # a field shadowing tuple.count, as in optax
    key: jax.Array
    health: health_lib.Health


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hyperparams:
    """`naive_quantized`'s arguments, validated on construction; `init` and `step` read them."""

    topology: Topology
    compressor: compress_base.Compressor
    axis_name: gossip.AxisName = "nodes"
    seed: int = 0

    def __post_init__(self):
        _common.check_topology(self.topology, "naive_quantized", require="row_stochastic")
        _common.check_compressor(self.compressor, "naive_quantized", "lpdec.minmax(8)")
        if isinstance(self.compressor, Modulo):
            raise TypeError(
                "naive_quantized decodes each Q(x_j) on its own, but lpdec.modulo decodes against "
                "the receiver's model; use lpdec.moniqua for modulo quantization."
            )


def init(params: optax.Params, hp: Hyperparams) -> NaiveQuantizedState:
    """The state at step 0; must run under `axis_name`."""
    del params
    gossip.require_axis(hp.axis_name, "naive_quantized's init", topology=hp.topology)
    return NaiveQuantizedState(
        count=jnp.zeros((), jnp.int32),
        key=_common.key_from_seed(hp.seed),
        health=health_lib.init(hp.axis_name),
    )


def step(
    updates: optax.Updates,
    state: NaiveQuantizedState,
    params: optax.Params,
    hp: Hyperparams,
) -> tuple[optax.Updates, NaiveQuantizedState]:
    """One naive quantized gossip step; must run under the named axis `axis_name`."""
    gossip.require_axis(hp.axis_name, "naive_quantized", topology=hp.topology)
    me = gossip.node_index(hp.axis_name)
    updates, _, health = _common.guard_updates(updates, state.health)
    x = _common.f32(params)
    payload = compress_tree.encode_tree(
        hp.compressor, x, _common.node_key(state.key, state.count, me)
    )

    def sender_key(sender):
        return _common.node_key(state.key, state.count, sender)

    def combine(round_):
        received = gossip.exchange(payload, round_, axis_name=hp.axis_name)
        own = jax.tree.map(lambda v: received.self_weight * v, x)
        # A non-finite neighbour counts as the node's own model: rows of W keep their sums.
        return gossip.accumulate(hp.compressor, received, own, sender_key=sender_key, substitute=x)

    mixed, skipped = gossip.in_round(hp.topology, state.count, combine)
    new = jax.tree.map(lambda m, u: m + u.astype(jnp.float32), mixed, updates)
    health = health_lib.count_received(health, skipped)
    return _common.as_updates(new, params), NaiveQuantizedState(state.count + 1, state.key, health)


def naive_quantized(
    topology: Topology,
    compressor: compress_base.Compressor,
    *,
    axis_name: gossip.AxisName = "nodes",
    seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
    r"""Gossip of quantized models, Q(x_j) used as if it were x_j (seed 003, eq. 4).

    .. math::

      x_i^{+} = W_{ii} x_i + \sum_{j \ne i} W_{ij} \, \mathrm{dec}(Q(x_j)) + u_i

    :math:`x_i` is params, :math:`u_i` the incoming update, Q is `compressor`
    and W `topology`'s mixing matrix. Does not converge to a small gradient
    with a fixed-resolution quantizer (Theorem 1); kept as a baseline.

    Args:
      topology: a row-stochastic `Topology`, static or time-varying.
      compressor: Q, any `lpdec` compressor that decodes on its own
        (``lpdec.minmax(8, "stochastic")``, ``lpdec.identity()`` gives D-PSGD);
        not ``lpdec.modulo``, which decodes against the receiver's model (that
        is `moniqua`).
      axis_name: the named axis whose instances are the nodes; `init` and
        `update` must run under it (`jax.shard_map` or `jax.vmap(axis_name=...)`).
      seed: seeds the shared key for stochastic rounding / random-k.

    Returns:
      An optax transform to put last in the chain; `update` needs `params`.

    Example:
      >>> tx = optax.chain(
      ...     optax.sgd(0.1),
      ...     lpdec.naive_quantized(lpdec.ring(8), lpdec.minmax(8, "stochastic")),
      ... )

    References:
      Lu & De Sa, Moniqua: Modulo Quantized Communication in Decentralized
      SGD, ICML 2020, https://arxiv.org/abs/2002.11787 (Section 3)
    """
    hp = Hyperparams(**locals())

    def init_fn(params):
        _common.check_float_params(params, "naive_quantized")
        return init(params, hp)

    def update_fn(updates, state, params=None, **extra_args):
        del extra_args
        return step(updates, state, _common.require_params(params, "naive_quantized"), hp)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


DECLARATION = declaration.Declaration(
    naive_quantized, "gossip", (NaiveQuantizedState,), Hyperparams
)
