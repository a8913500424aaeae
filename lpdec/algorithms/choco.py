r"""CHOCO-SGD (seed 002, Algorithm 3): gossip of compressed model differences.

Each node keeps a public copy :math:`\hat x_i` of its model that every
neighbour can reconstruct, sends :math:`q_i = Q(\tilde x_i - \hat x_i)` (which
shrinks as the nodes converge) and moves toward its neighbours' public copies:

.. math::

  q_i = Q(\tilde x_i - \hat x_i),\qquad
  \hat x_j \mathrel{+}= q_j \;\; (j \in N(i) \cup \{i\}),\qquad
  x_i^{+} = \tilde x_i + \gamma \sum_j W_{ij} (\hat x_j - \hat x_i)

with :math:`\tilde x_i = x_i + u_i` the local step. The public copies start at
0 (as in the paper), which every node knows, so nodes may start from different
parameters.

Memory, in model-sized float32 buffers per node, whatever the degree:
``replicas="sum"`` (default) keeps :math:`\hat x_i` and
:math:`s_i = \sum_{j \ne i} W_{ij} \hat x_j`: 2 buffers. ``replicas="per_peer"``
keeps one replica of each in-neighbour's public copy, as Bagua does: 1 + k
buffers (k = number of edge classes), bit-identical to the owners' copies; it
exists to make that property testable and for debugging.
"""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from lpdec import gossip
from lpdec.algorithms import _common
from lpdec.compress import base as compress_base
from lpdec.topology import Topology

REPLICAS = ("sum", "per_peer")


class ChocoState(NamedTuple):
    """State of `choco`.

    Attributes:
      count: shape=(), dtype=int32; steps taken.
      key: shape=(2,), dtype=uint32; shared by all nodes (`_common.node_key`).
      x_hat: float32 tree; this node's public copy.
      neighbors: float32 tree s_i = sum_{j != i} W_ij x_hat_j ("sum"), or a
        tuple of one replica tree per edge class ("per_peer").
      health: non-finite counters.
    """

    count: jax.Array
    key: jax.Array
    x_hat: Any
    neighbors: Any
    health: _common.Health


def init(
    params: optax.Params, *, topology: Topology, replicas: str, seed: int, axis_name: str
) -> ChocoState:
    zeros = _common.zeros_f32(params, axis_name)
    if replicas == "sum":
        neighbors = zeros
    else:
        neighbors = tuple(zeros for _ in topology.rounds[0].edge_classes)
    return ChocoState(
        count=jnp.zeros((), jnp.int32),
        key=_common.key_from_seed(seed),
        x_hat=zeros,
        neighbors=neighbors,
        health=_common.init_health(axis_name),
    )


def step(
    updates: optax.Updates,
    state: ChocoState,
    params: optax.Params,
    *,
    topology: Topology,
    compressor: compress_base.Compressor,
    gamma: float,
    replicas: str,
    axis_name: str,
) -> tuple[optax.Updates, ChocoState]:
    """One CHOCO step; must run under the named axis `axis_name`."""
    gossip.check_topology(topology, axis_name)
    round_ = topology.rounds[0]
    me = gossip.node_index(axis_name)
    # q_i = Q(x~_i - x^_i), sent along every edge class. x~ = x + u is formed inside
    # the encoder's loops and never stored: the step reads each buffer as few times
    # as it can (see the step-time table in BENCHMARKS.md).
    key = _common.node_key(state.key, state.count, me)
    diff = jax.tree.map(
        lambda p, u, h: (p.astype(jnp.float32) + u) - h, params, updates, state.x_hat
    )
    payload = _common.encode(compressor, diff, key)
    received = gossip.exchange(payload, round_, axis_name=axis_name)

    # A local update holding NaN/Inf makes q_i non-finite (every compressor flags
    # it): the node then takes no local step and keeps x^_i, and every receiver
    # drops q_i too, so the public copies stay consistent.
    sent_ok = gossip.payload_is_finite(compressor, payload)
    health = state.health._replace(
        nonfinite_updates=state.health.nonfinite_updates + jnp.where(sent_ok, 0, 1)
    )
    q = _common.decode(compressor, payload, diff, key=key)
    x_hat = jax.tree.map(lambda h, d: jnp.where(sent_ok, h + d, h), state.x_hat, q)

    def sender_key(sender):
        return _common.node_key(state.key, state.count, sender)

    if replicas == "sum":
        # s_i += sum_{j != i} W_ij q_j.
        neighbors, skipped = gossip.accumulate(
            compressor, received, state.neighbors, sender_key=sender_key
        )
        neighbor_sum = neighbors
    else:
        neighbors, skipped = [], jnp.int32(0)
        for c, replica in enumerate(state.neighbors):
            one = received._replace(
                payloads=[received.payloads[c]],
                weights=[jnp.float32(1)],
                senders=[received.senders[c]],
            )
            replica, s = gossip.accumulate(compressor, one, replica, sender_key=sender_key)
            neighbors.append(replica)
            skipped = skipped + s
        neighbors = tuple(neighbors)
        neighbor_sum = jax.tree.map(
            lambda *rs: sum(w * r for w, r in zip(received.weights, rs, strict=True)),
            *neighbors,
        )
    health = _common.count_received(health, skipped)

    # x+ - x = u + gamma sum_j W_ij (x^_j - x^_i), and for a row-stochastic W
    # sum_j W_ij (x^_j - x^_i) = s_i - (1 - W_ii) x^_i.
    off_diagonal = 1.0 - received.self_weight

    def update(u, s, h, p):
        u = jnp.where(sent_ok, u, jnp.zeros_like(u))
        return (u + gamma * (s - off_diagonal * h)).astype(p.dtype)

    new_updates = jax.tree.map(update, updates, neighbor_sum, x_hat, params)
    new_state = ChocoState(state.count + 1, state.key, x_hat, neighbors, health)
    return new_updates, new_state


def choco(
    topology: Topology,
    compressor: compress_base.Compressor,
    gamma: float = 1.0,
    *,
    axis_name: str = "nodes",
    replicas: str = "sum",
    seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
    r"""CHOCO-SGD: gossip of compressed differences to public model copies.

    .. math::

      q_i = Q(\tilde x_i - \hat x_i),\quad
      \hat x_j \mathrel{+}= q_j,\quad
      x_i^{+} = \tilde x_i + \gamma \sum_j W_{ij} (\hat x_j - \hat x_i)

    :math:`\tilde x_i` is params + the incoming update, Q is `compressor`,
    :math:`\gamma` is `gamma` and W is `topology`'s mixing matrix.

    Args:
      topology: a static, doubly stochastic `Topology` (the paper's setting).
      compressor: Q, any `lpdec` compressor (e.g. ``lpdec.minmax(8)``,
        ``lpdec.top_k(0.01)``).
      gamma: consensus step size in (0, 1]; 1 without compression, smaller for
        aggressive compression.
      axis_name: the named axis whose instances are the nodes.
      replicas: "sum" (2 model-sized buffers) or "per_peer" (1 + k buffers,
        replicas bit-identical to the owners' public copies).
      seed: seeds the shared key for stochastic rounding / random-k.

    Returns:
      An optax transform to put last in the chain; `update` needs `params`.

    Example:
      >>> tx = optax.chain(
      ...     optax.sgd(0.1, momentum=0.9, nesterov=True),
      ...     lpdec.choco(lpdec.ring(8), lpdec.minmax(8), gamma=0.5, axis_name="nodes"),
      ... )

    References:
      Koloskova et al., Decentralized Deep Learning with Arbitrary
      Communication Compression, ICLR 2020, https://arxiv.org/abs/1907.09356
    """
    _common.check_topology(topology, "choco", require="doubly_stochastic", static=True)
    gamma = _common.check_gamma(gamma, "choco")
    if replicas not in REPLICAS:
        raise ValueError(f"choco: replicas must be 'sum' or 'per_peer'; got {replicas!r}.")
    if not isinstance(compressor, compress_base.Compressor):
        raise TypeError(
            f"choco needs an lpdec compressor (e.g. lpdec.minmax(8)); got {compressor!r}."
        )

    def init_fn(params):
        return init(params, topology=topology, replicas=replicas, seed=seed, axis_name=axis_name)

    def update_fn(updates, state, params=None, **extra_args):
        del extra_args
        params = _common.require_params(params, "choco")
        return step(
            updates,
            state,
            params,
            topology=topology,
            compressor=compressor,
            gamma=gamma,
            replicas=replicas,
            axis_name=axis_name,
        )

    return _common.transform(init_fn, update_fn)
