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
``replicas="sum"`` (default) keeps 2 buffers, the lag
:math:`e_i = x_i - \hat x_i` and the consensus term
:math:`c_i = \sum_j W_{ij} (\hat x_j - \hat x_i)`, which is all a step reads:
:math:`\tilde x_i - \hat x_i = e_i + u_i` and :math:`x_i^+ - x_i = u_i + \gamma
c_i^+`, with :math:`c_i^+ = c_i + \sum_{j \ne i} W_{ij} q_j - (1 - W_{ii}) q_i`
(a row-stochastic W) and :math:`e_i^+ = e_i + (x_i^+ - x_i) - q_i =
(\tilde x_i - \hat x_i - q_i) + \gamma c_i^+`. Reading
two buffers instead of the parameters, :math:`\hat x_i` and the neighbour sum
makes the step markedly cheaper (BENCHMARKS.md); the price is that
:math:`x_i - e_i` equals the exact public copy only up to float32 rounding of
the parameters (float32 parameters recommended). ``replicas="per_peer"`` keeps
:math:`\hat x_i` and one replica of each in-neighbour's public copy, as Bagua
does: 1 + k buffers (k = number of edge classes), bit-identical to the owners'
copies; it exists to make that property testable and for debugging.
"""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import NamedTuple
from typing import cast

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

REPLICAS = ("sum", "per_peer")


class ChocoState(NamedTuple):
    """State of `choco` with ``replicas="sum"``.

    Attributes:
      count: shape=(), dtype=int32; steps taken.
      key: shape=(2,), dtype=uint32; shared by all nodes (`_common.node_key`).
      lag: float32 tree e_i = x_i - x_hat_i, how far the model is ahead of its
        public copy.
      consensus: float32 tree c_i = sum_j W_ij (x_hat_j - x_hat_i).
      health: non-finite counters.
    """

    count: jax.Array  # type: ignore[assignment]  # a field shadowing tuple.count, as in optax
    key: jax.Array
    lag: Any
    consensus: Any
    health: health_lib.Health


class ChocoPerPeerState(NamedTuple):
    """State of `choco` with ``replicas="per_peer"``.

    Attributes:
      count: shape=(), dtype=int32; steps taken.
      key: shape=(2,), dtype=uint32; shared by all nodes.
      x_hat: float32 tree; this node's public copy.
      replicas: one float32 tree per edge class: the public copy of the node's
        sender in that class (zeros where it receives nothing in the class).
      health: non-finite counters.
    """

    count: jax.Array  # type: ignore[assignment]  # a field shadowing tuple.count, as in optax
    key: jax.Array
    x_hat: Any
    replicas: tuple
    health: health_lib.Health


@dataclasses.dataclass(frozen=True)
class Hyperparams:
    """`choco`'s arguments, validated on construction; `init` and `step` read them."""

    topology: Topology
    compressor: compress_base.Compressor
    gamma: _common.Scalar = 1.0
    axis_name: gossip.AxisName = "nodes"
    replicas: str = "sum"
    seed: int = 0

    def __post_init__(self):
        _common.check_topology(self.topology, "choco", require="doubly_stochastic", static=True)
        _common.check_gamma(self.gamma, "choco")
        if self.replicas not in REPLICAS:
            raise ValueError(f"choco: replicas must be 'sum' or 'per_peer'; got {self.replicas!r}.")
        _common.check_compressor(self.compressor, "choco", "lpdec.minmax(8)")


def init(params: optax.Params, hp: Hyperparams) -> ChocoState | ChocoPerPeerState:
    """The state at step 0 (public copies x_hat = 0); must run under `axis_name`."""
    gossip.require_axis(hp.axis_name, "choco's init", topology=hp.topology)
    zeros = _common.zeros_f32(params, hp.axis_name)
    count, key = jnp.zeros((), jnp.int32), _common.key_from_seed(hp.seed)
    health = health_lib.init(hp.axis_name)
    if hp.replicas == "sum":
        # x_hat = 0 everywhere: the lag is the model itself and there is no consensus term.
        return ChocoState(count, key, _common.own_f32(params, hp.axis_name), zeros, health)
    copies = tuple(zeros for _ in hp.topology.rounds[0].edge_classes)
    return ChocoPerPeerState(count, key, zeros, copies, health)


def step(
    updates: optax.Updates,
    state: ChocoState | ChocoPerPeerState,
    params: optax.Params,
    hp: Hyperparams,
) -> tuple[optax.Updates, ChocoState | ChocoPerPeerState]:
    """One CHOCO step; must run under the named axis `axis_name`."""
    gossip.require_axis(hp.axis_name, "choco", topology=hp.topology)
    # The state's class follows hp.replicas: read as the one each branch below has.
    summed = cast(ChocoState, state)
    per_peer = cast(ChocoPerPeerState, state)
    compressor, axis_name = hp.compressor, hp.axis_name
    gamma = _common.at_step(hp.gamma, state.count)
    round_ = hp.topology.rounds[0]
    me = gossip.node_index(axis_name)

    # q_i = Q(x~_i - x^_i), sent along every edge class. x~ = x + u is formed inside
    # the encoder's loops and never stored.
    key = _common.node_key(state.key, state.count, me)
    if hp.replicas == "sum":
        diff = jax.tree.map(jnp.add, summed.lag, updates)
    else:
        diff = jax.tree.map(
            lambda p, u, h: (p.astype(jnp.float32) + u) - h, params, updates, per_peer.x_hat
        )
    payload = compress_tree.encode_tree(compressor, diff, key)
    received = gossip.exchange(payload, round_, axis_name=axis_name)

    # A local update holding NaN/Inf makes q_i non-finite (every compressor flags
    # it): the node then takes no local step and keeps x^_i, and every receiver
    # drops q_i too, so the public copies stay consistent.
    sent_ok = gossip.payload_is_finite(compressor, payload)
    health = health_lib.count_update(state.health, sent_ok)
    q = _common.decode(compressor, payload, diff, key=key)
    q = jax.tree.map(lambda d: jnp.where(sent_ok, d, jnp.zeros_like(d)), q)
    off_diagonal = 1.0 - received.self_weight

    def sender_key(sender):
        return _common.node_key(state.key, state.count, sender)

    def move(u, consensus, p):
        # x+ - x = u + gamma sum_j W_ij (x^_j - x^_i), the local step dropped if not finite.
        u = jnp.where(sent_ok, u, jnp.zeros_like(u))
        return (u + gamma * consensus).astype(p.dtype)

    if hp.replicas == "sum":
        # c_i += sum_{j != i} W_ij q_j - (1 - W_ii) q_i.
        own = jax.tree.map(lambda c, d: c - off_diagonal * d, summed.consensus, q)
        consensus, skipped = gossip.accumulate(compressor, received, own, sender_key=sender_key)
        new_updates = jax.tree.map(move, updates, consensus, params)
        # e+ = e + (x+ - x) - q = (x~ - x^ - q) + gamma c+: the quantization residual
        # plus the consensus move; e + gamma c+ when the local step was dropped.
        lag = jax.tree.map(
            lambda e, r, d, c: jnp.where(sent_ok, r - d, e) + gamma * c,
            summed.lag,
            diff,
            q,
            consensus,
        )
        new_state = ChocoState(
            state.count + 1, state.key, lag, consensus, health_lib.count_received(health, skipped)
        )
        return new_updates, new_state

    x_hat = jax.tree.map(jnp.add, per_peer.x_hat, q)
    copies, skipped = gossip.accumulate_per_class(
        compressor, received, per_peer.replicas, sender_key=sender_key
    )
    # sum_j W_ij (x^_j - x^_i) = sum_c w_c replica_c - (1 - W_ii) x^_i (row-stochastic W).
    consensus = jax.tree.map(
        lambda h, *rs: (
            sum(w * r for w, r in zip(received.weights, rs, strict=True)) - off_diagonal * h
        ),
        x_hat,
        *copies,
    )
    new_updates = jax.tree.map(move, updates, consensus, params)
    new_per_peer = ChocoPerPeerState(
        state.count + 1, state.key, x_hat, copies, health_lib.count_received(health, skipped)
    )
    return new_updates, new_per_peer


def choco(
    topology: Topology,
    compressor: compress_base.Compressor,
    *,
    gamma: _common.Scalar = 1.0,
    axis_name: gossip.AxisName = "nodes",
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
        aggressive compression. A number, a scalar array, or a schedule
        ``count -> gamma``; works with ``optax.inject_hyperparams``.
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
    hp = Hyperparams(**locals())

    def init_fn(params):
        _common.check_float_params(params, "choco")
        return init(params, hp)

    def update_fn(updates, state, params=None, **extra_args):
        del extra_args
        return step(updates, state, _common.require_params(params, "choco"), hp)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


DECLARATION = declaration.Declaration(choco, "gossip", (ChocoState, ChocoPerPeerState), Hyperparams)
