r"""Moniqua (seed 003, Algorithm 1): D-PSGD with modulo-quantized models, no extra memory.

If two nodes' models are known to differ by less than :math:`\theta` in every
coordinate, a node can recover its neighbour's model from that model modulo
:math:`B_\theta`, quantized on the unit circle (Lemma 1-2). Each node sends

.. math::

  q_i = Q_\delta\big((x_i / B_\theta) \bmod 1\big),\qquad
  B_\theta = \frac{2\theta}{1 - 2\delta},

and node i decodes every model it sees, its own included, against its own
:math:`x_i`:

.. math::

  \hat x_{j|i} = (q_j B_\theta - x_i) \bmod B_\theta + x_i,\qquad
  x_i^{+} = x_i + \sum_j W'_{ij} (\hat x_{j|i} - \hat x_{i|i}) + u_i,

with :math:`u_i` the incoming update (combine-then-adapt, as `dpsgd`) and
:math:`W' = \alpha W + (1 - \alpha) I` (Theorem 3's slack matrix, α = `slack`).
Subtracting the node's own decoded term :math:`\hat x_{i|i}` (Algorithm 1,
lines 4 and 6) keeps quantization noise out of the averaged model: while
Lemma 2's premise holds, :math:`\hat x_{j|i}` does not depend on the receiver
i, so with a doubly stochastic W the corrections sum to zero over the nodes.

The :math:`j = i` term of the sum is zero, so
:math:`\sum_j W'_{ij} (\hat x_{j|i} - \hat x_{i|i}) = \alpha \sum_j W_{ij}
(\hat x_{j|i} - \hat x_{i|i})`: a number α is folded into the weights of
:math:`W'`; a traced α (``optax.inject_hyperparams``) or a schedule scales the
sum instead.

Lemma 2: if :math:`|x_j - x_i| < \theta` elementwise, :math:`|\hat x_{j|i} -
x_j| \le \delta B_\theta`. Where the bound is violated the decode is off by a
multiple of :math:`B_\theta`: the model jumps. θ must therefore bound the
disagreement between neighbours, which shrinks with the step size (Theorem 2
takes θ proportional to it); a schedule step -> θ may follow a decaying step
size.

Memory: none beyond D-PSGD (a step counter, a key and the health counters);
no replicas, no error feedback (seed 003, Table 1). Wire: per leaf of d
elements and per edge, ceil(d * bits / 8) code bytes plus one flag byte that
marks a non-finite model (`lpdec.modulo`'s payload); one bit per parameter
needs `slack` < 1 (Theorem 3). With one bit and nearest rounding
:math:`\hat x_{j|i} - \hat x_{i|i} \in \{0, \pm 2\theta\}`: nodes inside the
same code cell (2θ wide) do not pull each other, so 1-bit Moniqua keeps
neighbours within θ but does not bring them closer than that.

Choosing θ. Theorem 2 takes :math:`\theta_k = 2 \alpha_k G_\infty C_\alpha
\log(16 n) / (1 - \rho)` (step size :math:`\alpha_k`, :math:`G_\infty` a bound on
the gradients' largest entry, ρ the second-largest eigenvalue modulus of W,
:math:`C_\alpha = 1` for a constant step): proportional to the step size, and
loose. In practice measure the neighbours' largest elementwise distance in a
short run (D-PSGD, or Moniqua with a generous θ) and take twice it:
`suggest_theta(stacked_params, topology)`. While the run goes, every node
counts in `Health.theta_warnings` the neighbour payloads with an element that
decoded further than θ/2 + δB from its own model (beyond the decode error
δB of Lemma 2: the models are then more than θ/2 apart): none while θ keeps a
2x margin over the distances; they appear as the models drift towards θ,
before a decode wraps (a wrap needs a distance beyond θ). Blind spot: two models that
jump more than 1.5θ apart in one step decode within θ/2 again, wrapped.

AD-PSGD (seed 003, section 5) is simulated, not run asynchronously, by
``optax.chain(local_optimizer, lpdec.delay(tau), moniqua(random_matching(n, seed), ...))``:
each step every node averages with one random peer (a fresh random pairwise
matching per step plays the role of :math:`W_k`) and applies the update it
computed tau steps earlier (gradients of fixed staleness tau). Everything
still advances in synchronous rounds. Not simulated: true asynchrony, delays
that vary over time or between nodes, workers running at different speeds,
and the single-worker-update iteration in which AD-PSGD's analysis counts
steps: `lpdec.async_sim` simulates those exactly (`run(..., compressor=modulo(...))`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
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
from lpdec.compress import Modulo
from lpdec.compress import base as compress_base
from lpdec.topology import Topology

PyTree = Any


class MoniquaState(NamedTuple):
    """State of `moniqua`: no model-sized buffer at all.

    Attributes:
      count: shape=(), dtype=int32; steps taken (picks the round of a
        time-varying topology and the argument of a θ or α schedule).
      key: shape=(2,), dtype=uint32; shared by all nodes (`_common.node_key`),
        drawn from by stochastic rounding.
      health: non-finite counters (`lpdec.Health`).
    """

    count: jax.Array  # type: ignore[assignment]  # a field shadowing tuple.count, as in optax
    key: jax.Array
    health: health_lib.Health


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hyperparams:
    """`moniqua`'s arguments, validated on construction; `init` and `step` read them.

    A number θ is folded into the compressor (its own θ) and `theta` is then None;
    a scalar array or a schedule stays in `theta` and overrides the compressor's θ
    at every encode and decode.
    """

    topology: Topology
    compressor: Modulo
    theta: _common.Scalar | None = None
    slack: _common.Scalar = 1.0
    axis_name: gossip.AxisName = "nodes"
    seed: int | jax.Array = 0

    def __post_init__(self):
        _common.check_topology(self.topology, "moniqua", require="doubly_stochastic")
        if not isinstance(self.compressor, Modulo):
            raise TypeError(
                "moniqua sends its models modulo B_theta: its compressor must be "
                f"lpdec.modulo(bits, theta) (e.g. lpdec.modulo(8, 0.5)); got {self.compressor!r}."
            )
        _common.check_scalar(
            self.slack,
            "moniqua",
            "slack",
            low=0.0,
            high=1.0,
            what=" (alpha in W' = alpha W + (1 - alpha) I)",
        )
        if self.theta is not None:
            theta = _check_theta(self.theta)
            if isinstance(theta, float):
                # A number is the compressor's own θ, which it then never needs passed.
                compressor = dataclasses.replace(self.compressor, theta=theta)
                object.__setattr__(self, "compressor", compressor)
                object.__setattr__(self, "theta", None)


def init(params: optax.Params, hp: Hyperparams) -> MoniquaState:
    """The state at step 0; must run under `axis_name`."""
    del params
    gossip.require_axis(hp.axis_name, "moniqua's init", topology=hp.topology)
    return MoniquaState(
        count=jnp.zeros((), jnp.int32),
        key=_common.key_from_seed(hp.seed),
        health=health_lib.init(hp.axis_name),
    )


def _leaf_kwargs(theta: jax.Array | None) -> dict:
    # Only the modulo compressor takes a θ override; others must not see the keyword.
    return {} if theta is None else {"theta": theta}


def _encode(
    compressor: compress_base.Compressor,
    tree: PyTree,
    key: jax.Array,
    *,
    theta: jax.Array | None = None,
) -> PyTree:
    """`lpdec.compress.tree.encode_tree` (one key per leaf, split from `key`), with a θ override."""
    leaves, treedef = jax.tree.flatten(tree)
    keys = list(jax.random.split(key, len(leaves)))
    kwargs = _leaf_kwargs(theta)
    return jax.tree.unflatten(
        treedef, [compressor.encode(x, k, **kwargs) for x, k in zip(leaves, keys, strict=True)]
    )


def consensus_step(
    compressor: compress_base.Compressor,
    received: gossip.Received,
    x_hat: PyTree,
    *,
    reference: PyTree,
    theta: jax.Array | None = None,
    sender_key: Callable[[jax.Array], jax.Array] | None = None,
    warn_beyond: jax.Array | float | None = None,
) -> tuple[PyTree, jax.Array, jax.Array]:
    r"""sum_j W_ij (x^_j - x^_i): the consensus step of Moniqua (and of D² with compression).

    Each neighbour's payload is decoded against `reference` (the receiver's
    own model, for the modulo compressor; others ignore it) and the node's own
    decoded term `x_hat` is subtracted neighbour by neighbour, so the float32
    rounding scales with the differences between models, not with the models.
    A payload that is not finite stands for x^_i: it adds nothing.

    Args:
      compressor: how the payloads were encoded.
      received: `gossip.exchange`'s output for this step's round.
      x_hat: float32 tree, the node's own payload decoded the same way.
      reference: float32 tree, the receiver's model that decodes are relative to.
      theta: a traced θ for the modulo compressor (None: its own constant).
      sender_key: maps a sender's index to the key it encoded with, for
        compressors whose decoders need it (random-k).
      warn_beyond: count the finite payloads with an element decoded further
        than this from `reference` (None: count nothing).

    Returns:
      (the float32 sum, number of non-finite payloads not used, number of
      payloads beyond `warn_beyond`; both int32 scalars).
    """
    own, treedef = jax.tree.flatten(x_hat)
    refs = compress_base.flatten_up_to(treedef, reference)
    n = len(own)
    kwargs = _leaf_kwargs(theta)
    acc = [jnp.zeros_like(x) for x in own]
    skipped = beyond = jnp.int32(0)
    for payload, weight, sender in zip(
        received.payloads, received.weights, received.senders, strict=True
    ):
        keys = [None] * n if sender_key is None else list(jax.random.split(sender_key(sender), n))
        ok = gossip.payload_is_finite(compressor, payload)
        decoded = [
            compressor.decode(p, reference=r, key=k, **kwargs).astype(jnp.float32)
            for p, r, k in zip(
                compress_base.flatten_up_to(treedef, payload), refs, keys, strict=True
            )
        ]
        acc = [
            a + weight * jnp.where(ok, y - x, 0.0)
            for a, y, x in zip(acc, decoded, own, strict=True)
        ]
        skipped = skipped + jnp.where(ok, 0, 1).astype(jnp.int32)
        if warn_beyond is not None:
            far = jnp.any(
                jnp.stack(
                    [
                        jnp.any(jnp.abs(y - r) > warn_beyond)
                        for y, r in zip(decoded, refs, strict=True)
                    ]
                )
            )
            beyond = beyond + (ok & far).astype(jnp.int32)
    return jax.tree.unflatten(treedef, acc), skipped, beyond


def step(
    updates: optax.Updates,
    state: MoniquaState,
    params: optax.Params,
    hp: Hyperparams,
) -> tuple[optax.Updates, MoniquaState]:
    """One Moniqua step; must run under the named axis `hp.axis_name`.

    Args:
      updates: u_i, the incoming update.
      state: the state from `init` or the previous step.
      params: x_i, this node's model.
      hp: W (`topology`, before the slack), Q_delta (`compressor`), a θ
        override (`theta`: None, a scalar array or a schedule of
        `state.count`), α (`slack`) and the nodes' axis.

    Returns:
      (the update that lands the node on x_i^+, the next state).
    """
    gossip.require_axis(hp.axis_name, "moniqua", topology=hp.topology)
    me = gossip.node_index(hp.axis_name)
    updates, _, health = _common.guard_updates(updates, state.health)
    x = _common.f32(params)
    theta_t = None if hp.theta is None else _common.at_step(hp.theta, state.count)
    alpha: float | jax.Array
    if isinstance(hp.slack, (int, float)):
        # A known α goes into the weights, rounded once as W' itself.
        mixing, alpha = hp.topology.with_slack(hp.slack), 1.0
    else:
        # sum_j W'_ij (x^_j - x^_i) = α sum_j W_ij (x^_j - x^_i): the j = i term is zero.
        mixing, alpha = hp.topology, _common.at_step(hp.slack, state.count)

    # q_i = Q((x_i / B) mod 1), and the own biased term x^_i = decode(q_i, reference=x_i).
    key = _common.node_key(state.key, state.count, me)
    payload = _encode(hp.compressor, x, key, theta=theta_t)
    kwargs = _leaf_kwargs(theta_t)
    x_hat = jax.tree.map(
        lambda p, r: hp.compressor.decode(p, reference=r, **kwargs).astype(jnp.float32),
        payload,
        x,
        is_leaf=compress_base.is_payload,
    )

    # A decode is within delta B of the true model (Lemma 2): beyond theta/2 + delta B the
    # two models are certainly more than theta/2 apart (or the decode wrapped).
    theta_now = hp.compressor.theta if theta_t is None else theta_t
    half_theta = 0.5 * theta_now + hp.compressor.delta * hp.compressor.modulus(theta_t)

    def combine(round_):
        received = gossip.exchange(payload, round_, axis_name=hp.axis_name)
        return consensus_step(
            hp.compressor, received, x_hat, reference=x, theta=theta_t, warn_beyond=half_theta
        )

    correction, skipped, warnings = gossip.in_round(mixing, state.count, combine)
    # x_i^+ = x_i + sum_j W'_ij (x^_{j|i} - x^_{i|i}) + u_i.
    new = jax.tree.map(
        lambda xi, c, u: xi + alpha * c + u.astype(jnp.float32), x, correction, updates
    )
    health = health_lib.count_theta_warnings(health_lib.count_received(health, skipped), warnings)
    return _common.as_updates(new, params), MoniquaState(state.count + 1, state.key, health)


def _check_theta(theta: _common.Scalar) -> _common.Scalar:
    """θ > 0: a number (returned as a float), a scalar array or a schedule step -> θ."""
    if isinstance(theta, bool) or not (
        callable(theta) or isinstance(theta, (int, float, np.ndarray, jax.Array))
    ):
        raise TypeError(
            "moniqua: theta must be a number > 0, a scalar array or a schedule step -> theta; "
            f"got {theta!r}."
        )
    theta = _common.check_scalar(
        theta, "moniqua", "theta", low=0.0, what=" (the a-priori bound on |x_i - x_j|)"
    )
    return float(theta) if isinstance(theta, (int, float)) else theta


def moniqua(
    topology: Topology,
    compressor: Modulo,
    *,
    theta: _common.Scalar | None = None,
    slack: _common.Scalar = 1.0,
    axis_name: gossip.AxisName = "nodes",
    seed: int | jax.Array = 0,
) -> optax.GradientTransformationExtraArgs:
    r"""Moniqua: D-PSGD that sends each model modulo B_θ, quantized (`lpdec.modulo`).

    .. math::

      q_i = Q_\delta\big((x_i / B_\theta) \bmod 1\big),\quad
      \hat x_{j|i} = (q_j B_\theta - x_i) \bmod B_\theta + x_i,\quad
      x_i^{+} = x_i + \sum_j W'_{ij} (\hat x_{j|i} - \hat x_{i|i}) + u_i

    :math:`x_i` is params, :math:`u_i` the incoming update, :math:`Q_\delta`
    rounds onto the :math:`2^{bits}` points of the unit circle (`compressor`'s
    bits and rounding; :math:`\delta = 2^{-(bits+1)}` nearest, :math:`2^{-bits}`
    stochastic), :math:`B_\theta = 2\theta/(1 - 2\delta)` with θ the
    compressor's (or `theta`, which overrides it), and
    :math:`W' = \alpha W + (1-\alpha) I` with α = `slack` and W `topology`'s
    mixing matrix. Decoding is exact up to :math:`\delta B_\theta` while
    neighbours differ by less than θ elementwise (Lemma 2); beyond it a model
    jumps by multiples of :math:`B_\theta`.

    Extra memory: none (a step counter and a key). Wire per edge and per leaf
    of d elements: ceil(d * bits / 8) + 1 bytes (codes plus a non-finite flag
    byte). AD-PSGD is simulated by putting ``lpdec.delay(tau)`` before this
    transform and using ``lpdec.random_matching``: see the module docstring
    for what that does and does not model.

    Args:
      topology: a doubly stochastic `Topology` (seed 003, (A2)); static or
        time-varying (``random_matching``, ``one_peer_exponential``).
      compressor: Q_δ, ``lpdec.modulo(bits, theta, rounding)``: the code width
        (1..8), θ > 0 (the a-priori bound on |x_i - x_j|) and the rounding,
        "nearest" or "stochastic". Stochastic one-bit codes (seed 003's
        experiments) are unbiased only where two neighbours lie within one
        half-cell (`lpdec.modulo`), and their decode error can reach B/2 = 2θ,
        so `Health.theta_warnings` (threshold θ/2 + δB) never fires for them.
      theta: None (the compressor's θ), or θ > 0 overriding it: a number, a
        scalar array, or a schedule step -> θ (evaluated on the step count,
        traced); works with ``optax.inject_hyperparams``.
      slack: α in (0, 1]; 1 uses W itself, smaller values the lazier W' of
        Theorem 3, which 1-bit codes need: each 1-bit correction moves a model
        by 2θ W'_ij, which must not push neighbours θ apart. A number, a scalar
        array or a schedule, like `theta`.
      axis_name: the named axis whose instances are the nodes; `init` and
        `update` must run under it (`jax.shard_map` or
        `jax.vmap(axis_name=...)`).
      seed: seeds the shared key for stochastic rounding (an int or an int
        scalar array).

    Returns:
      An optax transform to put last in the chain; `update` needs `params`.

    Example:
      >>> tx = optax.chain(
      ...     optax.sgd(0.1),
      ...     lpdec.moniqua(lpdec.ring(8), lpdec.modulo(1, 0.5), slack=0.2, axis_name="nodes"),
      ... )
      >>> scheduled = optax.inject_hyperparams(lpdec.moniqua)(
      ...     lpdec.ring(8), lpdec.modulo(8), theta=optax.linear_schedule(0.5, 0.1, 1000)
      ... )

    References:
      Lu & De Sa, Moniqua: Modulo Quantized Communication in Decentralized
      SGD, ICML 2020, https://arxiv.org/abs/2002.11787
    """
    hp = Hyperparams(**locals())

    def init_fn(params):
        _common.check_float_params(params, "moniqua")
        return init(params, hp)

    def update_fn(updates, state, params=None, **extra_args):
        del extra_args
        return step(updates, state, _common.require_params(params, "moniqua"), hp)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def suggest_theta(params: PyTree, topology: Topology, *, margin: float = 2.0) -> float:
    """θ for `moniqua` from observed models: `margin` x the neighbours' largest distance.

    Args:
      params: per-node models, every leaf with a leading node axis of n (e.g. the
        parameters of a short D-PSGD run, or of Moniqua run with a generous θ).
      topology: the topology Moniqua will use; distances are taken over its
        edges (every round of a time-varying one).
      margin: > 1; 2 keeps the observed distances at θ/2, where
        `Health.theta_warnings` starts counting.

    Returns:
      margin * max over edges (i, j) and elements of |x_i - x_j|, a Python float.
    """
    if not isinstance(margin, (int, float)) or isinstance(margin, bool) or not margin > 1:
        raise ValueError(f"suggest_theta: margin must be a number > 1; got {margin!r}")
    n = topology.num_nodes
    leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(params)]
    for x in leaves:
        if x.ndim < 1 or x.shape[0] != n:
            raise ValueError(
                f"suggest_theta: every leaf needs a leading node axis of {n} (the topology's "
                f"nodes); got shape {x.shape}"
            )
    pairs = {pair for r in topology.rounds for pair in r.edges if pair[0] != pair[1]}
    if not pairs or not leaves:
        raise ValueError("suggest_theta: needs a topology with edges and at least one array")
    src, dst = (np.array(side) for side in zip(*sorted(pairs), strict=True))
    widest = max(float(np.abs(x[src] - x[dst]).max()) for x in leaves)
    return margin * widest


DECLARATION = declaration.Declaration(
    moniqua, "gossip", (MoniquaState,), Hyperparams, also=(suggest_theta,)
)
