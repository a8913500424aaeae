r"""Deep-Squeeze (seed 002, Algorithm 2): gossip of error-compensated compressed models.

Extra memory: one model-sized float32 buffer per node (the error
:math:`\delta_i`), whatever the degree.

Each node compresses its local step plus the compression error it has not yet
sent, keeps the new error, and moves by the consensus step toward what it and
its neighbours sent:

.. math::

  v_i = \tilde x_i + \delta_i,\qquad
  c_i = C[v_i],\qquad
  \delta_i \leftarrow v_i - c_i,\qquad
  x_i^{+} = \tilde x_i + \gamma \sum_j (W_{ij} - I_{ij})\, c_j

with :math:`\tilde x_i = x_i + u_i` the local step and :math:`\delta_i = 0`
at the start. The node sends the model itself (compressed), not a difference,
so no node keeps any copy of a neighbour and the topology may change every
step. A column-stochastic W makes :math:`\sum_j (W_{ij} - I_{ij})` sum to 0
over i, so the node average is preserved; a row-stochastic W makes the models
agree: W must be doubly stochastic (use `sparse_push` on directed graphs).
"""

from __future__ import annotations

import dataclasses
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
from lpdec.topology import Topology


class DeepSqueezeState(NamedTuple):
    """State of `deepsqueeze`.

    Attributes:
      count: shape=(), dtype=int32; steps taken (picks the round of a
        time-varying topology and the value of a gamma schedule).
      key: shape=(2,), dtype=uint32; shared by all nodes (`_common.node_key`).
      error: float32 tree; delta_i, the compression error carried to the next
        step (v_i - C[v_i]).
      health: non-finite counters (`lpdec.Health`).
    """

    count: jax.Array  # type: ignore[assignment]  # a field shadowing tuple.count, as in optax
    key: jax.Array
    error: Any
    health: health_lib.Health


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hyperparams:
    """`deepsqueeze`'s arguments, validated on construction; `init` and `step` read them."""

    topology: Topology
    compressor: compress_base.Compressor
    gamma: _common.Scalar = 1.0
    axis_name: gossip.AxisName = "nodes"
    seed: int = 0

    def __post_init__(self):
        _common.check_topology(self.topology, "deepsqueeze", require="doubly_stochastic")
        _common.check_gamma(self.gamma, "deepsqueeze")
        _common.check_compressor(self.compressor, "deepsqueeze", "lpdec.top_k(0.1)")


def init(params: optax.Params, hp: Hyperparams) -> DeepSqueezeState:
    """The state at step 0 (no error carried yet, delta = 0); must run under `axis_name`."""
    gossip.require_axis(hp.axis_name, "deepsqueeze's init", topology=hp.topology)
    return DeepSqueezeState(
        count=jnp.zeros((), jnp.int32),
        key=_common.key_from_seed(hp.seed),
        error=_common.zeros_f32(params, hp.axis_name),
        health=health_lib.init(hp.axis_name),
    )


def step(
    updates: optax.Updates,
    state: DeepSqueezeState,
    params: optax.Params,
    hp: Hyperparams,
) -> tuple[optax.Updates, DeepSqueezeState]:
    """One Deep-Squeeze step; must run under the named axis `axis_name`."""
    gossip.require_axis(hp.axis_name, "deepsqueeze", topology=hp.topology)
    gamma = _common.at_step(hp.gamma, state.count)
    me = gossip.node_index(hp.axis_name)
    updates, _, health = _common.guard_updates(updates, state.health)
    x_tilde = jax.tree.map(lambda p, u: p.astype(jnp.float32) + u, params, updates)

    # v_i = x~_i + delta_i; c_i = C[v_i]; delta_i = v_i - c_i.
    key = _common.node_key(state.key, state.count, me)
    v = jax.tree.map(jnp.add, x_tilde, state.error)
    payload = compress_tree.encode_tree(hp.compressor, v, key)
    c = _common.decode(hp.compressor, payload, v, key=key)
    error = jax.tree.map(jnp.subtract, v, c)

    def sender_key(sender):
        return _common.node_key(state.key, state.count, sender)

    def consensus_step(round_):
        received = gossip.exchange(payload, round_, axis_name=hp.axis_name)
        # sum_j (W_ij - I_ij) c_j = (W_ii - 1) c_i + sum_{j != i} W_ij c_j. A non-finite c_j
        # counts as c_i, so the row still sums to 0 and the node is not pulled anywhere by it.
        own = jax.tree.map(lambda ci: (received.self_weight - 1.0) * ci, c)
        return gossip.accumulate(hp.compressor, received, own, sender_key=sender_key, substitute=c)

    correction, skipped = gossip.in_round(hp.topology, state.count, consensus_step)
    health = health_lib.count_received(health, skipped)
    new = jax.tree.map(lambda xt, d: xt + gamma * d, x_tilde, correction)
    new_state = DeepSqueezeState(state.count + 1, state.key, error, health)
    return _common.as_updates(new, params), new_state


def deepsqueeze(
    topology: Topology,
    compressor: compress_base.Compressor,
    *,
    gamma: _common.Scalar = 1.0,
    axis_name: gossip.AxisName = "nodes",
    seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
    r"""Deep-Squeeze: gossip of compressed models with error feedback.

    .. math::

      v_i = \tilde x_i + \delta_i,\quad
      \delta_i \leftarrow v_i - C[v_i],\quad
      x_i^{+} = \tilde x_i + \gamma \sum_j (W_{ij} - I_{ij})\, C[v_j]

    :math:`\tilde x_i` is params + the incoming update, C is `compressor`,
    :math:`\gamma` is `gamma`, W is `topology`'s mixing matrix of the step and
    :math:`\delta_i` (starting at 0) is kept in the state. Extra memory: one
    model-sized float32 buffer. Communication per step: one payload of the
    model per edge class.

    Args:
      topology: a doubly stochastic `Topology`, static or time-varying.
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
      ...     lpdec.deepsqueeze(lpdec.ring(8), lpdec.top_k(0.1), gamma=0.2, axis_name="nodes"),
      ... )

    References:
      Tang et al., DeepSqueeze: Decentralization Meets Error-Compensated
      Compression, 2019, https://arxiv.org/abs/1907.07346
    """
    hp = Hyperparams(**locals())

    def init_fn(params):
        _common.check_float_params(params, "deepsqueeze")
        return init(params, hp)

    def update_fn(updates, state, params=None, **extra_args):
        del extra_args
        return step(updates, state, _common.require_params(params, "deepsqueeze"), hp)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


DECLARATION = declaration.Declaration(deepsqueeze, "gossip", (DeepSqueezeState,), Hyperparams)
