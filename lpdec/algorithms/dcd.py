r"""DCD-PSGD (seed 000, Bagua's low-precision decentralized SGD): gossip of compressed model moves.

Every node keeps replicas :math:`\hat x_j` of its in-neighbours' models and
sends the compressed difference between where gossip plus its local step would
take it and where it is:

.. math::

  z_i = \sum_j W_{ij} \hat x_j + u_i - x_i,\qquad
  x_i^{+} = x_i + Q(z_i),\qquad
  \hat x_j \mathrel{+}= Q(z_j)

with :math:`u_i` the incoming update (seed 000's :math:`-\gamma g_i`) and Q
the compressor followed by its decoder. A node moves by exactly the decoded
message its neighbours add to their replicas of it, so its own replica is its
model, :math:`\hat x_i \equiv x_i`, and only the neighbours' replicas are kept.

Memory, in model-sized float32 buffers per node: ``replicas="sum"`` (default)
keeps :math:`s_i = \sum_{j \ne i} W_{ij} \hat x_j`: 1 buffer whatever the
degree. ``replicas="per_peer"`` keeps one replica per edge class, as Bagua
does: k buffers (k = number of edge classes, the degree for regular graphs).

Exactness: for float32 parameters, `optax.apply_updates` adds the same decoded
float32 message the neighbours add, so every replica equals its owner's
parameters bit for bit (``per_peer`` makes this observable). Parameters in a
narrower dtype are rounded to it after each move while the replicas are not,
so an owner and its replicas then differ by that rounding (at most half an
ulp of the parameter dtype per step).
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
from lpdec.compress import Modulo
from lpdec.compress import base as compress_base
from lpdec.compress import tree as compress_tree
from lpdec.kernels_pallas import rounded
from lpdec.topology import Topology

REPLICAS = ("sum", "per_peer")


class DCDState(NamedTuple):
    """State of `dcd`.

    Attributes:
      count: shape=(), dtype=int32; steps taken.
      key: shape=(2,), dtype=uint32; shared by all nodes (`_common.node_key`).
      neighbors: ("sum") float32 tree r_i = sum_{j != i} W_ij x_hat_j - (1 - W_ii) x_i,
        the consensus residual, so that z_i = r_i + u_i reads one buffer; or
        ("per_peer") a tuple of one replica tree per edge class, x_hat of that
        class's sender (zeros where the node receives nothing in the class).
      health: non-finite counters (`lpdec.Health`).
    """

    count: jax.Array  # type: ignore[assignment]  # a field shadowing tuple.count, as in optax
    key: jax.Array
    neighbors: Any
    health: health_lib.Health


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hyperparams:
    """`dcd`'s arguments, validated on construction; `init` and `step` read them."""

    topology: Topology
    compressor: compress_base.Compressor
    axis_name: gossip.AxisName = "nodes"
    replicas: str = "sum"
    seed: int = 0

    def __post_init__(self):
        _common.check_topology(self.topology, "dcd", require="doubly_stochastic", static=True)
        if self.replicas not in REPLICAS:
            raise ValueError(f"dcd: replicas must be 'sum' or 'per_peer'; got {self.replicas!r}.")
        _common.check_compressor(self.compressor, "dcd", "lpdec.minmax(8)")
        if isinstance(self.compressor, Modulo):
            raise ValueError(
                "dcd sends differences z, which modulo cannot decode (it decodes against the "
                "receiver's own model); use lpdec.moniqua for modulo quantization."
            )


def init(params: optax.Params, hp: Hyperparams) -> DCDState:
    """Builds the replicas from the neighbours' initial parameters (one full-precision exchange).

    Must run under the named axis `axis_name`: nodes may start from different
    parameters, and the replicas must be exactly those.
    """
    gossip.require_axis(hp.axis_name, "dcd's init", topology=hp.topology)
    received = gossip.exchange(params, hp.topology.rounds[0], axis_name=hp.axis_name)
    own = _common.f32(params)
    health = health_lib.init(hp.axis_name)
    # A neighbour starting from NaN/Inf never sends a finite message; its replica
    # stands still at the receiver's own start instead of poisoning the receiver.
    copies, skipped = [], jnp.int32(0)
    for payload in received.payloads:
        ok = _common.all_finite(payload)
        copies.append(
            jax.tree.map(lambda y, x, ok=ok: jnp.where(ok, y.astype(jnp.float32), x), payload, own)
        )
        skipped = skipped + jnp.where(ok, 0, 1).astype(jnp.int32)
    health = health_lib.count_received(health, skipped)
    if hp.replicas == "sum":
        off_diagonal = 1.0 - received.self_weight
        neighbors = jax.tree.map(
            lambda s, x: s - rounded(off_diagonal * x),
            _weighted_sum(received.weights, copies, own),
            own,
        )
    else:
        neighbors = tuple(copies)
    return DCDState(
        count=jnp.zeros((), jnp.int32),
        key=_common.key_from_seed(hp.seed),
        neighbors=neighbors,
        health=health,
    )


def _weighted_sum(weights: list[jax.Array], trees: list[Any], like: Any) -> Any:
    """sum_c weights[c] * trees[c] in float32, class by class (zeros shaped like `like`).

    Each product is rounded before it is added (no fused multiply-add), so the sum
    has the same bits in every program.
    """
    total = jax.tree.map(jnp.zeros_like, like)
    for weight, tree in zip(weights, trees, strict=True):
        total = jax.tree.map(lambda a, r, w=weight: a + rounded(w * r), total, tree)
    return total


def step(
    updates: optax.Updates,
    state: DCDState,
    params: optax.Params,
    hp: Hyperparams,
) -> tuple[optax.Updates, DCDState]:
    """One DCD step; must run under the named axis `axis_name`.

    Returns:
      (Q(z_i) in each parameter's dtype, the new state).
    """
    gossip.require_axis(hp.axis_name, "dcd", topology=hp.topology)
    round_ = hp.topology.rounds[0]
    me = gossip.node_index(hp.axis_name)
    off_diagonal = 1.0 - gossip.per_node(round_.self_weight, hp.axis_name)
    if hp.replicas == "sum":
        # z_i = sum_j W_ij x_hat_j + u_i - x_i = r_i + u_i: one buffer to read. Keeping
        # r_i rather than s_i saves two reads of x per step (the quantizer reads z twice).
        z = jax.tree.map(lambda r, u: r + u.astype(jnp.float32), state.neighbors, updates)
    else:
        # z_i = (s_i + u_i) - (1 - W_ii) x_i. The product is rounded before the
        # subtraction (no fused multiply-add), so z has the same bits in every program.
        weights = [gossip.per_node(c.recv_weight, hp.axis_name) for c in round_.edge_classes]
        neighbor_sum = _weighted_sum(weights, list(state.neighbors), _common.f32(params))
        z = jax.tree.map(
            lambda s, u, x: (
                (s + u.astype(jnp.float32)) - rounded(off_diagonal * x.astype(jnp.float32))
            ),
            neighbor_sum,
            updates,
            params,
        )
    key = _common.node_key(state.key, state.count, me)
    payload = compress_tree.encode_tree(hp.compressor, z, key)
    received = gossip.exchange(payload, round_, axis_name=hp.axis_name)

    # A non-finite message moves nobody: the receivers drop it, so the sender must too.
    # A local update holding NaN/Inf is caught here (it makes z, hence the payload,
    # non-finite), which saves a separate pass over the update to check it.
    sent_ok = gossip.payload_is_finite(hp.compressor, payload)
    health = health_lib.count_update(state.health, sent_ok)
    q = _common.decode(hp.compressor, payload, z, key=key)
    move = jax.tree.map(lambda d, p: jnp.where(sent_ok, d, 0.0).astype(p.dtype), q, params)

    def sender_key(sender):
        return _common.node_key(state.key, state.count, sender)

    if hp.replicas == "sum":
        # r_i += sum_{j != i} W_ij Q(z_j) - (1 - W_ii) Q(z_i): x_i moves by its own Q(z_i).
        own = jax.tree.map(
            lambda r, d: jnp.where(sent_ok, r - rounded(off_diagonal * d), r), state.neighbors, q
        )
        neighbors, skipped = gossip.accumulate(hp.compressor, received, own, sender_key=sender_key)
    else:
        # x_hat_j += Q(z_j) with weight exactly 1, the same float32 add as the owner's.
        neighbors, skipped = gossip.accumulate_per_class(
            hp.compressor, received, state.neighbors, sender_key=sender_key
        )
    health = health_lib.count_received(health, skipped)
    return move, DCDState(state.count + 1, state.key, neighbors, health)


def dcd(
    topology: Topology,
    compressor: compress_base.Compressor,
    *,
    axis_name: gossip.AxisName = "nodes",
    replicas: str = "sum",
    seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
    r"""DCD-PSGD: each node sends the compressed move toward its gossip-plus-local-step target.

    .. math::

      z_i = \sum_j W_{ij} \hat x_j + u_i - x_i,\quad
      x_i^{+} = x_i + Q(z_i),\quad
      \hat x_j \mathrel{+}= Q(z_j)

    :math:`x_i` is params, :math:`u_i` the incoming update, Q is `compressor`
    (encode then decode), W is `topology`'s mixing matrix and
    :math:`\hat x_j` the replica of neighbour j (:math:`\hat x_i = x_i`). The
    returned update is :math:`Q(z_i)`, the exact float32 message the
    neighbours add, so replicas track float32 parameters bit for bit. A
    message that is not finite is applied by nobody, sender included, and the
    receivers count it in ``health.nonfinite_received``.

    `init` exchanges the initial parameters once in full precision, so nodes
    may start from different parameters; it must run under `axis_name` too.

    Args:
      topology: a static, doubly stochastic `Topology` (directed or not).
      compressor: Q, an `lpdec` compressor other than `modulo` (which decodes
        against the receiver's model, not a difference); seed 000 uses
        ``lpdec.minmax(8)``.
      axis_name: the named axis whose instances are the nodes; `init` and
        `update` must run under it (`jax.shard_map` or `jax.vmap(axis_name=...)`).
      replicas: "sum" (1 model-sized float32 buffer) or "per_peer" (one per
        edge class, each bit-identical to its owner's float32 parameters).
      seed: seeds the shared key for stochastic rounding / random-k.

    Returns:
      An optax transform to put last in the chain; `update` needs `params`.

    Example:
      >>> tx = optax.chain(
      ...     optax.sgd(0.1, momentum=0.9),
      ...     lpdec.dcd(lpdec.ring(8), lpdec.minmax(8, "stochastic"), axis_name="nodes"),
      ... )

    References:
      Tang et al., Communication Compression for Decentralized Training,
      NeurIPS 2018, https://arxiv.org/abs/1803.06443 (DCD-PSGD);
      Bagua's LowPrecisionDecentralizedAlgorithm, https://github.com/BaguaSys/bagua
    """
    hp = Hyperparams(**locals())

    def init_fn(params):
        _common.check_float_params(params, "dcd")
        return init(params, hp)

    def update_fn(updates, state, params=None, **extra_args):
        del extra_args
        return step(updates, state, _common.require_params(params, "dcd"), hp)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


DECLARATION = declaration.Declaration(dcd, "gossip", (DCDState,), Hyperparams)
