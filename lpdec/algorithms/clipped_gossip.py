r"""ClippedGossip: Byzantine-robust gossip by self-centred clipping.

Each node takes its local step, then moves toward every neighbour by at most a
radius :math:`\tau_i` around its own model, so a neighbour that sends garbage
(a finite adversarial model) moves it by at most :math:`\gamma W_{ij} \tau_i` a step:

.. math::

  x_i^{t+1/2} = x_i^t + u_i,\qquad
  x_i^{t+1} = x_i^{t+1/2}
    + \gamma \sum_j W_{ij}\, \mathrm{CLIP}(x_j^{t+1/2} - x_i^{t+1/2}, \tau_i),\qquad
  \mathrm{CLIP}(z, \tau) = \min(1, \tau / \lVert z \rVert)\, z

with :math:`\lVert \cdot \rVert` the Euclidean norm over the WHOLE model (all
leaves together): a neighbour is clipped as one vector, not leaf by leaf.

Adaptive radius (the paper's rule). Node i has weight :math:`\delta_i` on
Byzantine neighbours at most. It orders itself (distance 0) and its
neighbours by :math:`d_{ij} = \lVert x_j^{t+1/2} - x_i^{t+1/2} \rVert`, takes
the closest ones holding weight :math:`1 - \delta_i` (the last one counted in
part) as its regular neighbours :math:`R_i`, and sets

.. math::

  \tau_i^2 = \frac{1}{\delta_i} \sum_{j \in R_i} W_{ij}\, d_{ij}^2,

the paper's choice :math:`\tau_i^2 = \delta_i^{-1} \sum_{j\ \mathrm{regular}}
W_{ij} \mathbb{E} \lVert x_i - x_j \rVert^2` with the unknown regular set
replaced by the closest :math:`1 - \delta_i` of the weight. With
``byzantine_weight=None``, :math:`\delta_i` is the largest weight node i gives
one neighbour (one Byzantine neighbour tolerated); on a ring every node then
clips its farther neighbour to the nearer one's distance, attacked or not.
Weights that differ by less than 1e-6 count as equal, so a boundary that
falls between two neighbours in exact arithmetic (1 - 1/3 - 1/3 - 1/3 = 0 on
a ring) is not moved by float rounding, and a neighbour within a relative
1e-5 of the radius counts as inside it (not clipped, not counted).

The price of robustness: the adaptive radius clips honest neighbours too, so
on heterogeneous data the nodes reach a neighbourhood of the optimum of size
O(delta zeta^2) (the paper's theorem), not the optimum itself. On
tests/test_algorithms.py's heterogeneous quadratic (8-node ring, step size
halving every 50 steps, 600 steps) the error mean_i |x_i - x*|^2 / d stalls
at 1.5e-3 where D-PSGD reaches 6e-9 and ``radius=float("inf")`` 3e-9.

With a compressor, each node keeps a public copy :math:`\hat x_i` of its
model, sends :math:`q_i = Q(x_i^{t+1/2} - \hat x_i)` and keeps one replica of
each in-neighbour's public copy (CHOCO-SGD's ``replicas="per_peer"``; 1 + k
float32 model-sized buffers for k edge classes), and clips the public copies'
differences:

.. math::

  \hat x_j \mathrel{+}= q_j,\qquad
  x_i^{t+1} = x_i^{t+1/2}
    + \gamma \sum_j W_{ij}\, \mathrm{CLIP}(\hat x_j - \hat x_i, \tau_i)

with the distances of the radius rule taken between public copies too. Why
:math:`\hat x_j - \hat x_i` and not :math:`\hat x_j - x_i^{t+1/2}`: both sides
then carry the same compression lag, so a distance measures how far the
models disagree and not node i's own quantization residual (which for top-k
can exceed the disagreement and would push every neighbour over the radius
alike); with no neighbour clipped the step is exactly CHOCO-SGD, whose
convergence under compression (with :math:`\gamma < 1`) is known; and
:math:`\sum_{ij} W_{ij} (\hat x_j - \hat x_i) = 0` for a doubly stochastic
W, so unclipped gossip keeps the nodes' average, while
:math:`\sum_{ij} W_{ij} (\hat x_j - x_i^{t+1/2})` is minus the sum of the
nodes' lags and would drift it. A Byzantine node sets its replicas at its
neighbours to anything, but what a replica adds to its holder's step is
clipped like any neighbour's difference. With the
identity compressor, :math:`\hat x_j = x_j^{t+1/2}` (to float32 rounding) and
the rule above is the paper's. Without a
compressor (``compressor=None``) the float32 models :math:`x_j^{t+1/2}`
themselves travel and no copies are kept.

Every collective runs on every node every step (a clipped neighbour is scaled,
never skipped), so the transform is safe under ``shard_map``. A message whose
squared distance is not finite in float32 (NaN/Inf, or entries beyond about
1e19) is not used: its weight goes to the node's own model, and it is counted
in ``Health.nonfinite_received``. `ClippedGossipState.clipped` counts the
neighbour messages clipped so far and `ClippedGossipState.radius` holds the
last radius, per node.

To test a defence, a Byzantine node can be simulated by overwriting its
parameters before each step: it then sends (the public-copy increments
towards) whatever model it claims, and its neighbours' replicas stay
consistent with what it sent (tests/test_clipped_gossip.py does this).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lpdec import gossip
from lpdec.algorithms import _common
from lpdec.algorithms import declaration
from lpdec.algorithms import health as health_lib
from lpdec.compress import base as compress_base
from lpdec.compress import tree as compress_tree
from lpdec.topology import Topology

ADAPTIVE = "adaptive"
# Weights closer than this count as equal in the adaptive rule (float32 sums of 1/3s).
WEIGHT_TOLERANCE = 1e-6
# A neighbour within this relative distance of the radius counts as inside it: on a
# ring the adaptive radius IS the nearer neighbour's distance, up to float rounding.
RADIUS_TOLERANCE = 1e-5


class ClippedGossipState(NamedTuple):
    """State of `clipped_gossip`.

    Attributes:
      count: shape=(), dtype=int32; steps taken.
      key: shape=(2,), dtype=uint32; shared by all nodes (`_common.node_key`).
      x_hat: float32 tree; this node's public copy (``()`` without a compressor).
      replicas: one float32 tree per edge class: the public copy of the node's
        sender in that class (zeros where it receives nothing; ``()`` without a
        compressor).
      radius: shape=(), dtype=float32; the clipping radius tau_i of the last step.
      clipped: shape=(), dtype=int32; neighbour messages clipped so far.
      health: non-finite counters.
    """

    count: jax.Array  # type: ignore[assignment]  # a field shadowing tuple.count, as in optax
    key: jax.Array
    x_hat: Any
    replicas: tuple
    radius: jax.Array
    clipped: jax.Array
    health: health_lib.Health


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hyperparams:
    """`clipped_gossip`'s arguments, validated on construction; `init` and `step` read them."""

    topology: Topology
    compressor: compress_base.Compressor | None = None
    radius: str | _common.Scalar = ADAPTIVE
    byzantine_weight: _common.Scalar | None = None
    gamma: _common.Scalar = 1.0
    axis_name: gossip.AxisName = "nodes"
    seed: int = 0

    def __post_init__(self):
        name = "clipped_gossip"
        _common.check_topology(self.topology, name, require="doubly_stochastic", static=True)
        if self.compressor is not None:
            _common.check_compressor(self.compressor, name, "lpdec.minmax(8), or None")
        _check_radius(self.radius, self.byzantine_weight)
        _common.check_gamma(self.gamma, name)


def init(params: optax.Params, hp: Hyperparams) -> ClippedGossipState:
    """The state at step 0 (public copies x_hat = 0); must run under `axis_name`."""
    gossip.require_axis(hp.axis_name, "clipped_gossip's init", topology=hp.topology)
    x_hat, replicas = (), ()
    if hp.compressor is not None:
        x_hat = _common.zeros_f32(params, hp.axis_name)
        replicas = tuple(x_hat for _ in hp.topology.rounds[0].edge_classes)
    return ClippedGossipState(
        count=jnp.zeros((), jnp.int32),
        key=_common.key_from_seed(hp.seed),
        x_hat=x_hat,
        replicas=replicas,
        radius=gossip.to_varying(jnp.zeros((), jnp.float32), hp.axis_name),
        clipped=gossip.to_varying(jnp.zeros((), jnp.int32), hp.axis_name),
        health=health_lib.init(hp.axis_name),
    )


def adaptive_radius(
    distances: jax.Array, weights: jax.Array, self_weight: jax.Array, byzantine_weight: jax.Array
) -> jax.Array:
    r"""tau_i: sqrt(sum of W_ij d_ij^2 over the closest (1 - delta_i) of the weight / delta_i).

    Args:
      distances: float32[k], d_ij per edge class (finite).
      weights: float32[k], W_ij per edge class (0 where nothing arrived).
      self_weight: W_ii; node i itself counts at distance 0.
      byzantine_weight: delta_i > 0.
    """
    d = jnp.concatenate([jnp.zeros((1,), jnp.float32), distances])
    w = jnp.concatenate([jnp.reshape(self_weight, (1,)), weights])
    order = jnp.argsort(d)
    d, w = d[order], w[order]
    # The weight still to fill when each entry is reached; it takes what it can.
    room = (jnp.sum(w) - byzantine_weight) - (jnp.cumsum(w) - w)
    share = jnp.where(room > WEIGHT_TOLERANCE, jnp.minimum(room, w), 0.0)
    return jnp.sqrt(jnp.sum(share * jnp.square(d)) / byzantine_weight)


def _squared_distance(a: Any, b: Any) -> jax.Array:
    """||a - b||^2 over every leaf together, in float32."""
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return sum((jnp.sum(jnp.square(x - y)) for x, y in pairs), jnp.float32(0))


def _clipped_sum(own, neighbours, weights, self_weight, radius, byzantine_weight, count):
    """sum_c W_c CLIP(neighbour_c - own, tau) over the edge classes, float32 trees.

    Returns:
      (the sum, tau, neighbour messages clipped, messages not used as not finite).
    """
    if not neighbours:
        return jax.tree.map(jnp.zeros_like, own), jnp.float32(0), jnp.int32(0), jnp.int32(0)
    squared = jnp.stack([_squared_distance(n, own) for n in neighbours])
    weights = jnp.stack(weights)
    usable = jnp.isfinite(squared)
    present = weights > 0
    # A message that is not usable stands for the node's own model: distance 0.
    distances = jnp.where(usable, jnp.sqrt(jnp.where(usable, squared, 0.0)), 0.0)
    if isinstance(radius, str):
        if byzantine_weight is None:
            delta = jnp.max(weights)
        else:
            delta = _common.at_step(byzantine_weight, count)
        tau = adaptive_radius(distances, weights, self_weight, delta)
    else:
        tau = _common.at_step(radius, count)
    clip = distances > tau * (1.0 + RADIUS_TOLERANCE)
    scale = jnp.where(clip, tau / jnp.where(clip, distances, 1.0), 1.0)
    coefficients = jnp.where(usable, weights * scale, 0.0)

    def leaf_sum(x, *ys):
        return sum(jnp.where(usable[c], coefficients[c] * (y - x), 0.0) for c, y in enumerate(ys))

    total = jax.tree.map(leaf_sum, own, *neighbours)
    clipped = jnp.sum(present & usable & clip).astype(jnp.int32)
    not_finite = jnp.sum(present & ~usable).astype(jnp.int32)
    return total, tau, clipped, not_finite


def step(
    updates: optax.Updates,
    state: ClippedGossipState,
    params: optax.Params,
    hp: Hyperparams,
) -> tuple[optax.Updates, ClippedGossipState]:
    """One ClippedGossip step; must run under the named axis `axis_name`."""
    gossip.require_axis(hp.axis_name, "clipped_gossip", topology=hp.topology)
    gamma = _common.at_step(hp.gamma, state.count)
    round_ = hp.topology.rounds[0]

    if hp.compressor is None:
        updates, sent_ok, health = _common.guard_updates(updates, state.health)
        x_tilde = jax.tree.map(lambda p, u: p.astype(jnp.float32) + u, params, updates)
        received = gossip.exchange(x_tilde, round_, axis_name=hp.axis_name)
        own, neighbours, x_hat, replicas = x_tilde, received.payloads, (), ()
        skipped = jnp.int32(0)
    else:
        # q_i = Q(x~_i - x^_i), as in CHOCO; a non-finite local step makes q_i
        # non-finite, and then the node neither moves nor updates its public copy.
        me = gossip.node_index(hp.axis_name)
        key = _common.node_key(state.key, state.count, me)
        diff = jax.tree.map(
            lambda p, u, h: (p.astype(jnp.float32) + u) - h, params, updates, state.x_hat
        )
        payload = compress_tree.encode_tree(hp.compressor, diff, key)
        received = gossip.exchange(payload, round_, axis_name=hp.axis_name)
        sent_ok = gossip.payload_is_finite(hp.compressor, payload)
        health = health_lib.count_update(state.health, sent_ok)
        q = _common.decode(hp.compressor, payload, diff, key=key)
        q = jax.tree.map(lambda d: jnp.where(sent_ok, d, jnp.zeros_like(d)), q)
        x_hat = jax.tree.map(jnp.add, state.x_hat, q)

        def sender_key(sender):
            return _common.node_key(state.key, state.count, sender)

        replicas, skipped = gossip.accumulate_per_class(
            hp.compressor, received, state.replicas, sender_key=sender_key
        )
        own, neighbours = x_hat, list(replicas)

    consensus, tau, clipped, not_finite = _clipped_sum(
        own,
        neighbours,
        received.weights,
        received.self_weight,
        hp.radius,
        hp.byzantine_weight,
        state.count,
    )

    def move(u, c, p):
        # x+ - x = u + gamma sum_j W_ij CLIP(...), the local step dropped if not finite.
        u = jnp.where(sent_ok, u, jnp.zeros_like(u))
        return (u + gamma * c).astype(p.dtype)

    new_updates = jax.tree.map(move, updates, consensus, params)
    health = health_lib.count_received(health, skipped + not_finite)
    new_state = ClippedGossipState(
        count=state.count + 1,
        key=state.key,
        x_hat=x_hat,
        replicas=replicas,
        radius=gossip.to_varying(tau, hp.axis_name),
        clipped=state.clipped + clipped,
        health=health,
    )
    return new_updates, new_state


def _check_radius(radius, byzantine_weight):
    name = "clipped_gossip"
    if isinstance(radius, str):
        if radius != ADAPTIVE:
            raise ValueError(
                f"{name}: radius must be 'adaptive', a positive number, a scalar array or a "
                f"schedule (count -> radius); got {radius!r}."
            )
    else:
        _common.check_scalar(radius, name, "radius", low=0.0, high=math.inf)
        if byzantine_weight is not None:
            raise ValueError(
                f"{name}: byzantine_weight only sets the adaptive radius; drop it or use "
                f"radius='adaptive' (got radius={radius!r})."
            )
    if byzantine_weight is None or callable(byzantine_weight):
        return
    if isinstance(byzantine_weight, bool) or not isinstance(
        byzantine_weight, (int, float, np.ndarray, jax.Array)
    ):
        raise ValueError(
            f"{name}: byzantine_weight must be a number in (0, 1), a scalar array, a schedule "
            f"(count -> weight) or None; got {byzantine_weight!r}."
        )
    if np.ndim(byzantine_weight) != 0:
        raise ValueError(
            f"{name}: byzantine_weight must be a scalar; got shape {np.shape(byzantine_weight)}."
        )
    try:
        value = float(byzantine_weight)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
        return  # traced (optax.inject_hyperparams): taken as it is
    if not 0.0 < value < 1.0:
        raise ValueError(f"{name}: byzantine_weight must be in (0, 1); got {byzantine_weight!r}.")


def clipped_gossip(
    topology: Topology,
    compressor: compress_base.Compressor | None = None,
    *,
    radius: str | _common.Scalar = ADAPTIVE,
    byzantine_weight: _common.Scalar | None = None,
    gamma: _common.Scalar = 1.0,
    axis_name: gossip.AxisName = "nodes",
    seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
    r"""ClippedGossip: gossip that clips each neighbour's model difference to a radius.

    .. math::

      x_i^{+} = \tilde x_i + \gamma \sum_j W_{ij}\,
        \min\!\Big(1, \frac{\tau_i}{\lVert \tilde x_j - \tilde x_i \rVert}\Big)
        (\tilde x_j - \tilde x_i),\qquad
      \tau_i^2 = \frac{1}{\delta_i} \sum_{j \in R_i} W_{ij}
        \lVert \tilde x_j - \tilde x_i \rVert^2

    :math:`\tilde x_i` is params + the incoming update, W is `topology`'s
    mixing matrix, :math:`\gamma` is `gamma`, the norm runs over the whole
    model, :math:`\tau_i` is `radius` (or the adaptive rule above, with
    :math:`R_i` the closest neighbours, node i included, holding weight
    :math:`1 - \delta_i` and :math:`\delta_i` = `byzantine_weight`). With a
    compressor Q, :math:`\tilde x_j` in the clipped difference and distances
    becomes the public copy :math:`\hat x_j` (``+= Q(\tilde x_j - \hat x_j)``
    each step), as in CHOCO-SGD; see the module docstring.

    Args:
      topology: a static, doubly stochastic `Topology`.
      compressor: None (the float32 models travel) or any `lpdec` compressor
        (e.g. ``lpdec.minmax(8)``; use ``gamma < 1`` for aggressive ones).
      radius: "adaptive" (the paper's rule, recomputed every step), or a
        fixed tau > 0: a number, a scalar array or a schedule ``count ->
        tau``; ``float("inf")`` turns clipping off.
      byzantine_weight: delta_i, the weight a node may give to Byzantine
        neighbours, in (0, 1): a number, a scalar array or a schedule
        ``count -> delta``; None: the largest weight the node gives to one
        neighbour. Only with ``radius="adaptive"``.
      gamma: consensus step size in (0, 1]; a number, a scalar array or a
        schedule ``count -> gamma``.
      axis_name: the named axis whose instances are the nodes; the transform
        must run under it (`jax.shard_map` or `jax.vmap(axis_name=...)`).
      seed: seeds the shared key for stochastic rounding / random-k.

    Returns:
      An optax transform to put last in the chain; `update` needs `params`.

    Example:
      >>> tx = optax.chain(
      ...     optax.sgd(0.1), lpdec.clipped_gossip(lpdec.ring(8), axis_name="nodes")
      ... )

    References:
      He, Karimireddy, Jaggi, Byzantine-Robust Decentralized Learning via
      ClippedGossip, ICLR 2023, https://arxiv.org/abs/2202.01545
    """
    hp = Hyperparams(**locals())

    def init_fn(params):
        _common.check_float_params(params, "clipped_gossip")
        return init(params, hp)

    def update_fn(updates, state, params=None, **extra_args):
        del extra_args
        return step(updates, state, _common.require_params(params, "clipped_gossip"), hp)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


DECLARATION = declaration.Declaration(clipped_gossip, "gossip", (ClippedGossipState,), Hyperparams)
