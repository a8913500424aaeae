r"""Sparse-Push (seed 002, Algorithm 4): Deep-Squeeze with push-sum, for directed graphs.

Extra memory: two model-sized float32 buffers per node (the biased model
:math:`x_i` and the error :math:`\delta_i`) and one float32 scalar (the
push-sum weight :math:`w_i`), whatever the degree.

Deep-Squeeze's gossip :math:`\sum_j (W_{ij} - I_{ij})\, c_j` preserves the sum
of the models whenever W is column stochastic (every sender splits all of its
mass among itself and its out-neighbours), but on a directed graph whose nodes
have different out-degrees W is not also row stochastic, and the models agree
on a weighted, not the plain, average. Push-sum fixes this: every node runs
the same gossip on a scalar weight :math:`w_i` (starting at 1), which ends up
biased exactly like the models, and evaluates gradients at the de-biased model
:math:`z_i = x_i / w_i`:

.. math::

  \tilde x_i = x_i + u_i,\quad
  v_i = \tilde x_i + \delta_i,\quad
  c_i = C[v_i],\quad
  \delta_i \leftarrow v_i - c_i,

  x_i^{+} = \tilde x_i + \gamma \sum_j (W_{ij} - I_{ij})\, c_j,\qquad
  w_i^{+} = w_i + \gamma \sum_j (W_{ij} - I_{ij})\, w_j,\qquad
  z_i^{+} = x_i^{+} / w_i^{+}.

The node's parameters are :math:`z_i` (u is computed there); :math:`x_i`,
:math:`w_i` and :math:`\delta_i` live in the state. :math:`w_j` crosses the
wire uncompressed, as 4 more bytes per edge. The seed calls the push-sum weight
u; here it is `push_weight`, as u is the incoming update.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from lpdec import gossip
from lpdec.algorithms import _common
from lpdec.algorithms import declaration
from lpdec.algorithms import health as health_lib
from lpdec.compress import base as compress_base
from lpdec.compress import tree as compress_tree
from lpdec.topology import Round
from lpdec.topology import Topology


class SparsePushState(NamedTuple):
    """State of `sparse_push`.

    Attributes:
      count: shape=(), dtype=int32; steps taken (picks the round of a
        time-varying topology and the value of a gamma schedule).
      key: shape=(2,), dtype=uint32; shared by all nodes (`_common.node_key`).
      x: float32 tree; the biased model x_i (params are z_i = x_i / w_i).
      push_weight: shape=(), dtype=float32; the push-sum weight w_i.
      error: float32 tree; delta_i, the compression error carried to the next
        step (v_i - C[v_i]).
      health: non-finite counters (`lpdec.Health`).
    """

    count: jax.Array  # type: ignore[assignment]  # a field shadowing tuple.count, as in optax
    key: jax.Array
    x: Any
    push_weight: jax.Array
    error: Any
    health: health_lib.Health


def init_push_weight(axis_name: gossip.AxisName) -> jax.Array:
    """w_i = 1, varying over `axis_name` (it differs between nodes after one step)."""
    return gossip.to_varying(jnp.ones((), jnp.float32), axis_name)


def exchange_with_weight(
    payload: Any, push_weight: jax.Array, round_: Round, *, axis_name: gossip.AxisName
) -> tuple[gossip.Received, list[jax.Array]]:
    """Sends (payload, w_i) along `round_`'s edges in one ppermute per edge class.

    Returns:
      (what arrived, with the payloads alone, and the neighbours' w_j per class).
    """
    received = gossip.exchange((payload, push_weight), round_, axis_name=axis_name)
    payloads = [p for p, _ in received.payloads]
    neighbor_weights = [w for _, w in received.payloads]
    return received._replace(payloads=payloads), neighbor_weights


def self_coefficient(received: gossip.Received, usable: Sequence[jax.Array]) -> jax.Array:
    """W_ii - 1 plus the weights of the messages that are not used.

    A message that is not used counts as the receiver's own value, so
    sum_j (W_ij - I_ij) y_j = self_coefficient * y_i + sum_{usable j} W_ij y_j
    keeps the row sum of W - I.
    """
    coefficient = received.self_weight - 1.0
    for weight, ok in zip(received.weights, usable, strict=True):
        coefficient = coefficient + jnp.where(ok, 0.0, weight)
    return coefficient


def push_weight_correction(
    push_weight: jax.Array,
    received: gossip.Received,
    neighbor_weights: Sequence[jax.Array],
    usable: Sequence[jax.Array],
) -> jax.Array:
    """sum_j (W_ij - I_ij) w_j, with w_i standing in for every message not used."""
    correction = self_coefficient(received, usable) * push_weight
    for weight, w, ok in zip(received.weights, neighbor_weights, usable, strict=True):
        correction = correction + jnp.where(ok, weight * w, 0.0)
    return correction


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hyperparams:
    """`sparse_push`'s arguments, validated on construction; `init` and `step` read them."""

    topology: Topology
    compressor: compress_base.Compressor
    gamma: _common.Scalar = 1.0
    axis_name: gossip.AxisName = "nodes"
    seed: int = 0

    def __post_init__(self):
        _common.check_topology(self.topology, "sparse_push", require="column_stochastic")
        _common.check_gamma(self.gamma, "sparse_push")
        _common.check_compressor(self.compressor, "sparse_push", "lpdec.top_k(0.1)")


def init(params: optax.Params, hp: Hyperparams) -> SparsePushState:
    """The state at step 0 (x = params, w = 1, delta = 0); must run under `axis_name`."""
    gossip.require_axis(hp.axis_name, "sparse_push's init", topology=hp.topology)
    return SparsePushState(
        count=jnp.zeros((), jnp.int32),
        key=_common.key_from_seed(hp.seed),
        x=_common.own_f32(params, hp.axis_name),
        push_weight=init_push_weight(hp.axis_name),
        error=_common.zeros_f32(params, hp.axis_name),
        health=health_lib.init(hp.axis_name),
    )


def step(
    updates: optax.Updates,
    state: SparsePushState,
    params: optax.Params,
    hp: Hyperparams,
) -> tuple[optax.Updates, SparsePushState]:
    """One Sparse-Push step; must run under the named axis `axis_name`."""
    gossip.require_axis(hp.axis_name, "sparse_push", topology=hp.topology)
    gamma = _common.at_step(hp.gamma, state.count)
    me = gossip.node_index(hp.axis_name)
    updates, _, health = _common.guard_updates(updates, state.health)
    # The update was computed at z_i = params, but it moves the biased model x_i.
    x_tilde = jax.tree.map(lambda x, u: x + u.astype(jnp.float32), state.x, updates)

    # v_i = x~_i + delta_i; c_i = C[v_i]; delta_i = v_i - c_i.
    key = _common.node_key(state.key, state.count, me)
    v = jax.tree.map(jnp.add, x_tilde, state.error)
    payload = compress_tree.encode_tree(hp.compressor, v, key)
    c = _common.decode(hp.compressor, payload, v, key=key)
    error = jax.tree.map(jnp.subtract, v, c)

    def sender_key(sender):
        return _common.node_key(state.key, state.count, sender)

    def consensus_step(round_):
        received, neighbor_weights = exchange_with_weight(
            payload, state.push_weight, round_, axis_name=hp.axis_name
        )
        # (c_j, w_j) is used whole or not at all, so that x_i and w_i stay biased alike.
        usable = [
            gossip.payload_is_finite(hp.compressor, p) & jnp.isfinite(w)
            for p, w in zip(received.payloads, neighbor_weights, strict=True)
        ]
        coefficient = self_coefficient(received, usable)
        own = jax.tree.map(lambda ci: coefficient * ci, c)
        # A refused message's share is already in `own`; weight 0 keeps it out of the sum.
        weights = [jnp.where(ok, w, 0.0) for w, ok in zip(received.weights, usable, strict=True)]
        correction, _ = gossip.accumulate(
            hp.compressor, received._replace(weights=weights), own, sender_key=sender_key
        )
        w_correction = push_weight_correction(state.push_weight, received, neighbor_weights, usable)
        skipped = sum((1 - ok.astype(jnp.int32) for ok in usable), jnp.int32(0))
        return correction, w_correction, skipped

    correction, w_correction, skipped = gossip.in_round(hp.topology, state.count, consensus_step)
    health = health_lib.count_received(health, skipped)
    x = jax.tree.map(lambda xt, d: xt + gamma * d, x_tilde, correction)
    push_weight = state.push_weight + gamma * w_correction
    z = jax.tree.map(lambda xi: xi / push_weight, x)
    new_state = SparsePushState(state.count + 1, state.key, x, push_weight, error, health)
    return _common.as_updates(z, params), new_state


def sparse_push(
    topology: Topology,
    compressor: compress_base.Compressor,
    *,
    gamma: _common.Scalar = 1.0,
    axis_name: gossip.AxisName = "nodes",
    seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
    r"""Sparse-Push: Deep-Squeeze's error-compensated gossip with push-sum de-biasing.

    .. math::

      v_i = x_i + u_i + \delta_i,\quad
      \delta_i \leftarrow v_i - C[v_i],\quad
      x_i^{+} = x_i + u_i + \gamma \sum_j (W_{ij} - I_{ij})\, C[v_j],

      w_i^{+} = w_i + \gamma \sum_j (W_{ij} - I_{ij})\, w_j,\qquad
      z_i^{+} = x_i^{+} / w_i^{+}

    :math:`u_i` is the incoming update (computed at the parameters
    :math:`z_i`), C is `compressor`, :math:`\gamma` is `gamma`, W is
    `topology`'s mixing matrix of the step; :math:`x_i` (starting at the
    parameters), :math:`w_i` (starting at 1) and :math:`\delta_i` (starting at
    0) are kept in the state. The returned update lands the parameters on
    :math:`z_i^{+}`. Extra memory: two model-sized float32 buffers and a
    scalar. Communication per step: one payload of the model and a float32
    scalar per edge class.

    Args:
      topology: a column-stochastic `Topology` (each node splits its mass
        among itself and its out-neighbours), static or time-varying; it need
        not be row stochastic, so directed graphs with different out-degrees
        work.
      compressor: C, any `lpdec` compressor (e.g. ``lpdec.top_k(0.1)``,
        ``lpdec.minmax(8)``).
      gamma: consensus step size in (0, 1]; 1 without compression, smaller for
        aggressive compression. A number, a scalar array, or a schedule
        ``count -> gamma``; works with ``optax.inject_hyperparams``.
      axis_name: the named axis whose instances are the nodes; `init` and
        `update` must run under it (`jax.shard_map` or `jax.vmap(axis_name=...)`).
      seed: seeds the shared key for stochastic rounding / random-k.

    Returns:
      An optax transform to put last in the chain; `update` needs `params`.

    Example:
      >>> tx = optax.chain(
      ...     optax.sgd(0.1, momentum=0.9, nesterov=True),
      ...     lpdec.sparse_push(lpdec.directed_ring(8), lpdec.top_k(0.1), gamma=0.2),
      ... )

    References:
      Aketi et al., Sparse-Push: Communication- & Energy-Efficient
      Decentralized Distributed Learning over Directed & Time-Varying Graphs
      with non-IID Datasets, 2021, https://arxiv.org/abs/2102.05715

      Assran et al., Stochastic Gradient Push for Distributed Deep Learning,
      ICML 2019, https://arxiv.org/abs/1811.10792

      Aketi et al., Low Precision Decentralized Distributed Training over IID
      and non-IID Data, 2021, https://arxiv.org/abs/2111.09389 (Algorithm 4)
    """
    hp = Hyperparams(**locals())

    def init_fn(params):
        _common.check_float_params(params, "sparse_push")
        return init(params, hp)

    def update_fn(updates, state, params=None, **extra_args):
        del extra_args
        return step(updates, state, _common.require_params(params, "sparse_push"), hp)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


DECLARATION = declaration.Declaration(sparse_push, "gossip", (SparsePushState,), Hyperparams)
