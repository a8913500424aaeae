r"""Quant-SGP (seed 002, Algorithm 5): CHOCO-SGD with push-sum, for directed graphs.

Extra memory: three model-sized float32 buffers per node (the biased model
:math:`x_i`, the public copy :math:`\hat x_i` and the neighbour sum
:math:`s_i = \sum_{j \ne i} W_{ij} \hat x_j`) and one float32 scalar (the
push-sum weight :math:`w_i`), whatever the degree.

As in CHOCO, each node sends the compressed difference between its local step
and its public copy, and every in-neighbour adds it to its copy of that public
copy (here only to the weighted sum :math:`s_i`). As in Sparse-Push, a scalar
weight :math:`w_i` (starting at 1) runs the same gossip as the models, and
gradients are evaluated at the de-biased model :math:`z_i = x_i / w_i`:

.. math::

  \tilde x_i = x_i + u_i,\quad
  q_i = C[\tilde x_i - \hat x_i],\quad
  \hat x_j \mathrel{+}= q_j \;\; (j \in N^{in}(i) \cup \{i\}),

  x_i^{+} = \tilde x_i + \gamma \sum_j (W_{ij} - I_{ij})\, \hat x_j
          = \tilde x_i + \gamma \big(s_i + (W_{ii} - 1)\, \hat x_i\big),

  w_i^{+} = w_i + \gamma \sum_j (W_{ij} - I_{ij})\, w_j,\qquad
  z_i^{+} = x_i^{+} / w_i^{+}.

A deliberate deviation from the seed: Algorithm 5 writes the gossip as
:math:`\tilde x_i + \gamma \sum_j (W_{ij} - I_{ij})(\hat x_j - \hat x_i)`,
which equals the form above minus :math:`\gamma (r_i - 1)\, \hat x_i` with
:math:`r_i = \sum_j W_{ij}` the row sum. Push-sum needs only a column-stochastic
W, whose row sums differ from 1 on exactly the graphs it exists for (nodes with
different out-degrees), and there the extra term changes the total mass
:math:`\sum_i x_i` every step while :math:`\sum_i w_i` stays put, so
:math:`z_i = x_i / w_i` no longer tends to the average. The form used here
moves mass only along the columns of W, so it keeps :math:`\sum_i x_i` (and
:math:`\sum_i w_i`) for any column-stochastic W, and it is the seed's form
whenever W is also row stochastic (its directed ring and torus). The tests
simulate both on such a graph.

The public copies and :math:`s_i` start at 0 (every node knows that), and a
payload that is not finite is dropped by its sender and its receivers alike,
so :math:`s_i` always equals the weighted sum of the owners' public copies.
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
from lpdec.algorithms import sparse_push
from lpdec.compress import base as compress_base
from lpdec.compress import tree as compress_tree
from lpdec.topology import Topology


class QuantSGPState(NamedTuple):
    """State of `quant_sgp`.

    Attributes:
      count: shape=(), dtype=int32; steps taken (the argument of a gamma schedule).
      key: shape=(2,), dtype=uint32; shared by all nodes (`_common.node_key`).
      x: float32 tree; the biased model x_i (params are z_i = x_i / w_i).
      push_weight: shape=(), dtype=float32; the push-sum weight w_i.
      x_hat: float32 tree; this node's public copy.
      neighbors: float32 tree; s_i = sum_{j != i} W_ij x_hat_j.
      health: non-finite counters (`lpdec.Health`).
    """

    count: jax.Array  # type: ignore[assignment]  # a field shadowing tuple.count, as in optax
    key: jax.Array
    x: Any
    push_weight: jax.Array
    x_hat: Any
    neighbors: Any
    health: health_lib.Health


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hyperparams:
    """`quant_sgp`'s arguments, validated on construction; `init` and `step` read them."""

    topology: Topology
    compressor: compress_base.Compressor
    gamma: _common.Scalar = 1.0
    axis_name: gossip.AxisName = "nodes"
    seed: int = 0

    def __post_init__(self):
        _common.check_topology(self.topology, "quant_sgp", require="column_stochastic", static=True)
        _common.check_gamma(self.gamma, "quant_sgp")
        _common.check_compressor(self.compressor, "quant_sgp", "lpdec.minmax(8)")


def init(params: optax.Params, hp: Hyperparams) -> QuantSGPState:
    """The state at step 0 (x = params, w = 1, x_hat = s = 0); must run under `axis_name`."""
    gossip.require_axis(hp.axis_name, "quant_sgp's init", topology=hp.topology)
    zeros = _common.zeros_f32(params, hp.axis_name)
    return QuantSGPState(
        count=jnp.zeros((), jnp.int32),
        key=_common.key_from_seed(hp.seed),
        x=_common.own_f32(params, hp.axis_name),
        push_weight=sparse_push.init_push_weight(hp.axis_name),
        x_hat=zeros,
        neighbors=zeros,
        health=health_lib.init(hp.axis_name),
    )


def step(
    updates: optax.Updates,
    state: QuantSGPState,
    params: optax.Params,
    hp: Hyperparams,
) -> tuple[optax.Updates, QuantSGPState]:
    """One Quant-SGP step; must run under the named axis `axis_name`."""
    gossip.require_axis(hp.axis_name, "quant_sgp", topology=hp.topology)
    gamma = _common.at_step(hp.gamma, state.count)
    round_ = hp.topology.rounds[0]
    me = gossip.node_index(hp.axis_name)
    updates, _, health = _common.guard_updates(updates, state.health)
    # The update was computed at z_i = params, but it moves the biased model x_i.
    x_tilde = jax.tree.map(lambda x, u: x + u.astype(jnp.float32), state.x, updates)

    # q_i = C[x~_i - x^_i], sent with w_i along every edge class.
    key = _common.node_key(state.key, state.count, me)
    diff = jax.tree.map(jnp.subtract, x_tilde, state.x_hat)
    payload = compress_tree.encode_tree(hp.compressor, diff, key)
    received, neighbor_weights = sparse_push.exchange_with_weight(
        payload, state.push_weight, round_, axis_name=hp.axis_name
    )

    # x^_i += q_i, unless q_i is not finite: the receivers drop it as well.
    sent_ok = gossip.payload_is_finite(hp.compressor, payload)
    q = _common.decode(hp.compressor, payload, diff, key=key)
    x_hat = jax.tree.map(lambda h, d: jnp.where(sent_ok, h + d, h), state.x_hat, q)

    def sender_key(sender):
        return _common.node_key(state.key, state.count, sender)

    # s_i += sum_{j != i} W_ij q_j.
    neighbors, skipped = gossip.accumulate(
        hp.compressor, received, state.neighbors, sender_key=sender_key
    )
    # q_j and w_j are used independently: s_i must follow the senders' x^_j whatever w_j is.
    usable = [jnp.isfinite(w) for w in neighbor_weights]
    w_correction = sparse_push.push_weight_correction(
        state.push_weight, received, neighbor_weights, usable
    )
    skipped = skipped + sum((1 - ok.astype(jnp.int32) for ok in usable), jnp.int32(0))
    health = health_lib.count_received(health, skipped)

    # sum_j (W_ij - I_ij) x^_j = s_i + (W_ii - 1) x^_i: mass-conserving (module docstring).
    off_diagonal = received.self_weight - 1.0
    x = jax.tree.map(
        lambda xt, s, h: xt + gamma * (s + off_diagonal * h), x_tilde, neighbors, x_hat
    )
    push_weight = state.push_weight + gamma * w_correction
    z = jax.tree.map(lambda xi: xi / push_weight, x)
    new_state = QuantSGPState(state.count + 1, state.key, x, push_weight, x_hat, neighbors, health)
    return _common.as_updates(z, params), new_state


def quant_sgp(
    topology: Topology,
    compressor: compress_base.Compressor,
    *,
    gamma: _common.Scalar = 1.0,
    axis_name: gossip.AxisName = "nodes",
    seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
    r"""Quant-SGP: CHOCO's compressed-difference gossip with push-sum de-biasing.

    .. math::

      q_i = C[x_i + u_i - \hat x_i],\quad
      \hat x_j \mathrel{+}= q_j,\quad
      x_i^{+} = x_i + u_i + \gamma \sum_j (W_{ij} - I_{ij})\, \hat x_j,

      w_i^{+} = w_i + \gamma \sum_j (W_{ij} - I_{ij})\, w_j,\qquad
      z_i^{+} = x_i^{+} / w_i^{+}

    :math:`u_i` is the incoming update (computed at the parameters
    :math:`z_i`), C is `compressor`, :math:`\gamma` is `gamma` and W is
    `topology`'s mixing matrix; :math:`x_i` (starting at the parameters),
    :math:`w_i` (starting at 1), the public copy :math:`\hat x_i` and
    :math:`s_i = \sum_{j \ne i} W_{ij} \hat x_j` (both starting at 0) are kept
    in the state. The returned update lands the parameters on
    :math:`z_i^{+}`. The gossip term is the mass-conserving form of the
    seed's :math:`\sum_j (W_{ij} - I_{ij})(\hat x_j - \hat x_i)`; the two agree
    when W is doubly stochastic (see the module docstring). Extra memory: three
    model-sized float32 buffers and a scalar. Communication per step: one
    payload of the model's change and a float32 scalar per edge class.

    Args:
      topology: a static, column-stochastic `Topology` (each node splits its
        mass among itself and its out-neighbours); it need not be row
        stochastic, so directed graphs with different out-degrees work.
      compressor: C, any `lpdec` compressor (e.g. ``lpdec.minmax(8)``,
        ``lpdec.top_k(0.01)``).
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
      ...     lpdec.quant_sgp(lpdec.directed_ring(8), lpdec.minmax(8), gamma=0.5),
      ... )

    References:
      Taheri et al., Quantized Decentralized Stochastic Learning over
      Directed Graphs, ICML 2020, https://arxiv.org/abs/2002.09964

      Aketi et al., Low Precision Decentralized Distributed Training over IID
      and non-IID Data, 2021, https://arxiv.org/abs/2111.09389 (Algorithm 5)
    """
    hp = Hyperparams(**locals())

    def init_fn(params):
        _common.check_float_params(params, "quant_sgp")
        return init(params, hp)

    def update_fn(updates, state, params=None, **extra_args):
        del extra_args
        return step(updates, state, _common.require_params(params, "quant_sgp"), hp)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


DECLARATION = declaration.Declaration(quant_sgp, "gossip", (QuantSGPState,), Hyperparams)
