r"""D² (Tang et al. 2018; seed 003, section 5): decentralized SGD robust to non-IID data.

D-PSGD's nodes disagree at a constant step size in proportion to how much
their local gradients differ. D² adds the previous step's correction, so each
node's stationary point is the global optimum:

.. math::

  x_{k+1/2} = 2 x_k - x_{k-1} + u_k - u_{k-1},\qquad
  x_{k+1} = \sum_j W_{ij} x_{j,k+1/2},

with :math:`u_k` the incoming update (:math:`-\alpha_k g_k` for SGD),
:math:`x_{-1} = x_0` and :math:`u_{-1} = 0`, so the first step is
:math:`x_0 + u_0`. With a compressor, the half-step models are exchanged
compressed and the mixing becomes Moniqua's consensus step

.. math::

  x_{k+1} = x_{k+1/2} + \sum_j W_{ij} (\hat x_{j,k+1/2} - \hat x_{i,k+1/2}),

where :math:`\hat x` are decodes of what was sent; a modulo compressor decodes
against the receiver's own :math:`x_{k+1/2}`, as in Moniqua.

The recursion is stable only when :math:`\lambda_{\min}(W) > -1/3` (Tang et
al.); `d2` checks it when it is built. Memory: two model-sized float32
buffers (:math:`x_{k-1}` and :math:`u_{k-1}`).

Full-precision mixing is computed as :math:`x_{i,k+1/2} + \sum_j W_{ij}
(x_{j,k+1/2} - x_{i,k+1/2})`, not :math:`\sum_j W_{ij} x_{j,k+1/2}`: the
node average of D² is a double integrator (:math:`\bar x_{k+1} - \bar x_k =
\bar x_k - \bar x_{k-1} + \bar u_k - \bar u_{k-1}`), so the float32 rounding
of a weighted sum of models, of the order of an ulp of the models and not
zero on average over the nodes, would accumulate into a velocity error and
the models would drift linearly in the step count (2e-4 after 2k steps and
4e-3 after 20k on a quadratic). In the difference form the rounding scales
with the disagreement between nodes, which vanishes at D²'s fixed point.
"""

from __future__ import annotations

import dataclasses
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
from lpdec.algorithms import moniqua
from lpdec.compress import Identity
from lpdec.compress import base as compress_base
from lpdec.compress import tree as compress_tree
from lpdec.topology import Topology

# Tang et al. (2018) need every eigenvalue of W above -1/3. ring(n) with even n
# sits exactly on the boundary; its eigenvalue comes out within a few ulps of it.
_LAMBDA_MIN_BOUND = -1.0 / 3.0
_LAMBDA_TOLERANCE = 1e-9


class D2State(NamedTuple):
    """State of `d2`.

    Attributes:
      count: shape=(), dtype=int32; steps taken.
      key: shape=(2,), dtype=uint32; shared by all nodes (`_common.node_key`).
      prev_params: float32 tree; x_{k-1}, the model before the last step
        (x_0 before the first).
      prev_update: float32 tree; u_{k-1}, the last incoming update (0 before
        the first step).
      health: non-finite counters (`lpdec.Health`).
    """

    count: jax.Array  # type: ignore[assignment]  # a field shadowing tuple.count, as in optax
    key: jax.Array
    prev_params: Any
    prev_update: Any
    health: health_lib.Health


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hyperparams:
    """`d2`'s arguments, validated on construction; `init` and `step` read them."""

    topology: Topology
    compressor: compress_base.Compressor | None = None
    axis_name: gossip.AxisName = "nodes"
    seed: int = 0

    def __post_init__(self):
        _common.check_topology(self.topology, "d2", require=("doubly_stochastic", "symmetric"))
        if self.topology.period != 1:
            # Tang et al.'s stability condition and analysis are for one fixed W.
            raise ValueError(
                f"d2 needs a static topology (its stability condition is on one fixed W); "
                f"{self.topology!r} changes every step (period {self.topology.period})."
            )
        check_lambda_min(self.topology, "d2")
        if self.compressor is None:
            # None means plain D2: the models travel as they are.
            object.__setattr__(self, "compressor", Identity())
        _common.check_compressor(self.compressor, "d2", "lpdec.modulo(8), or None")


def init(params: optax.Params, hp: Hyperparams) -> D2State:
    """The state at step 0 (x_{-1} = x_0, u_{-1} = 0); must run under `axis_name`."""
    gossip.require_axis(hp.axis_name, "d2's init", topology=hp.topology)
    return D2State(
        count=jnp.zeros((), jnp.int32),
        key=_common.key_from_seed(hp.seed),
        prev_params=_common.own_f32(params, hp.axis_name),
        prev_update=_common.zeros_f32(params, hp.axis_name),
        health=health_lib.init(hp.axis_name),
    )


def step(
    updates: optax.Updates,
    state: D2State,
    params: optax.Params,
    hp: Hyperparams,
) -> tuple[optax.Updates, D2State]:
    """One D² step; must run under the named axis `axis_name`.

    `compressor` is ``lpdec.identity()`` for full-precision mixing.
    """
    gossip.require_axis(hp.axis_name, "d2", topology=hp.topology)
    round_ = hp.topology.rounds[0]
    updates, _, health = _common.guard_updates(updates, state.health)
    x = _common.f32(params)
    u = _common.f32(updates)
    half = jax.tree.map(
        lambda xk, xp, uk, up: 2.0 * xk - xp + uk - up, x, state.prev_params, u, state.prev_update
    )
    me = gossip.node_index(hp.axis_name)
    key = _common.node_key(state.key, state.count, me)
    compressor = hp.compressor
    assert compressor is not None  # __post_init__ put identity() in place of None
    payload = compress_tree.encode_tree(compressor, half, key)
    half_hat = _common.decode(compressor, payload, half, reference=half, key=key)
    received = gossip.exchange(payload, round_, axis_name=hp.axis_name)

    def sender_key(sender):
        return _common.node_key(state.key, state.count, sender)

    correction, skipped, _ = moniqua.consensus_step(
        compressor, received, half_hat, reference=half, sender_key=sender_key
    )
    new = jax.tree.map(jnp.add, half, correction)
    health = health_lib.count_received(health, skipped)
    new_state = D2State(state.count + 1, state.key, x, u, health)
    return _common.as_updates(new, params), new_state


def check_lambda_min(topology: Topology, name: str) -> float:
    """Raises ValueError unless λ_min(W) > -1/3; returns λ_min."""
    lam = float(np.linalg.eigvalsh(topology.mixing_matrix()).min())
    if lam <= _LAMBDA_MIN_BOUND + _LAMBDA_TOLERANCE:
        # alpha = 2 / (3 (1 - lam)) maps lam to alpha lam + 1 - alpha = 1/3.
        alpha = 2.0 / (3.0 * (1.0 - lam))
        raise ValueError(
            f"{name}: topology {topology.name} has lambda_min(W) = {lam:.6g}, but D² needs "
            f"lambda_min(W) > -1/3 (Tang et al., 2018) or its iterates diverge. Use a lazier "
            f"W' = alpha W + (1 - alpha) I, e.g. {topology.name}.with_slack({alpha:.3g}) "
            f"(lambda_min becomes alpha lambda_min + 1 - alpha = 1/3)."
        )
    return lam


def d2(
    topology: Topology,
    compressor: compress_base.Compressor | None = None,
    *,
    axis_name: gossip.AxisName = "nodes",
    seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
    r"""D²: D-PSGD with a correction that removes the bias of heterogeneous local data.

    .. math::

      x_{k+1/2} = 2 x_k - x_{k-1} + u_k - u_{k-1},\qquad
      x_{k+1} = \sum_j W_{ij} x_{j,k+1/2}

    :math:`x_k` is params, :math:`u_k` the incoming update (the local
    optimizer's step, :math:`-\alpha g_k` for SGD), :math:`x_{-1} = x_0`,
    :math:`u_{-1} = 0` and W is `topology`'s mixing matrix. With `compressor` the
    mixing is :math:`x_{k+1/2} + \sum_j W_{ij} (\hat x_{j,k+1/2} - \hat
    x_{i,k+1/2})` with :math:`\hat x` decoded from `compressor` (against the
    receiver's own half step for ``lpdec.modulo``: Moniqua on D², seed 003).

    With a constant step size every node converges to the exact optimum of
    the average objective, where D-PSGD keeps an O(step size) error when local
    objectives differ. Memory: two model-sized float32 buffers.

    Args:
      topology: a static, symmetric, doubly stochastic `Topology` with
        λ_min(W) > -1/3, checked here (``ring(8)`` has exactly -1/3: use
        ``ring(8).with_slack(0.5)``).
      compressor: None for full-precision mixing, or any `lpdec` compressor (e.g.
        ``lpdec.modulo(8, theta=0.5)``).
      axis_name: the named axis whose instances are the nodes; `init` and
        `update` must run under it (`jax.shard_map` or `jax.vmap(axis_name=...)`).
      seed: seeds the shared key for stochastic rounding / random-k.

    Returns:
      An optax transform to put last in the chain; `update` needs `params`.

    Example:
      >>> tx = optax.chain(
      ...     optax.sgd(0.05), lpdec.d2(lpdec.ring(8).with_slack(0.5), axis_name="nodes")
      ... )

    References:
      Tang et al., D²: Decentralized Training over Decentralized Data, ICML
      2018, https://arxiv.org/abs/1803.07068

      Lu & De Sa, Moniqua: Modulo Quantized Communication in Decentralized
      SGD, ICML 2020, https://arxiv.org/abs/2002.11787
    """
    hp = Hyperparams(**locals())

    def init_fn(params):
        _common.check_float_params(params, "d2")
        return init(params, hp)

    def update_fn(updates, state, params=None, **extra_args):
        del extra_args
        return step(updates, state, _common.require_params(params, "d2"), hp)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


DECLARATION = declaration.Declaration(d2, "gossip", (D2State,), Hyperparams)
