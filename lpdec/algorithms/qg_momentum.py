r"""Quasi-global momentum (Lin et al. 2021, Algorithm 1, QG-DSGDm): a local optimizer to put first.

With heterogeneous data each node's local momentum follows its own gradients
and pulls the nodes apart. QG-DSGDm instead builds the momentum buffer from the
model's actual displacement, gossip included, which approximates the global
descent direction without extra communication.

Reading of the paper (arXiv 2102.04761, Algorithm 1), for node i at step t:

.. math::

  m_i^{(t)} = g_i^{(t)} + \beta \hat m_i^{(t-1)},\qquad
  x_i^{(t+1/2)} = x_i^{(t)} - \eta_t m_i^{(t)},\qquad
  x_i^{(t+1)} = \text{gossip}(x^{(t+1/2)})_i,

  d_i^{(t)} = (x_i^{(t)} - x_i^{(t+1)}) / \eta_t,\qquad
  \hat m_i^{(t)} = \mu \hat m_i^{(t-1)} + (1 - \mu) d_i^{(t)},

with :math:`\hat m^{(-1)} = 0` and :math:`\mu = \beta` (the paper's default).
The Nesterov variant steps by :math:`-\eta_t (g_i^{(t)} + \beta m_i^{(t)})`.
Since :math:`d^{(t)}` needs :math:`x^{(t+1)}`, which a transform first sees as
`params` at step t + 1, :math:`\hat m` is updated at the start of the next
step from the previous parameters and learning rate kept in the state; the
arithmetic is the paper's. The decentralized transform later in the chain does
the gossip (any of lpdec's: the paper pairs QGM with D-PSGD, seed 002 with
CHOCO), and :math:`d` measures whatever it did; lpdec's D-PSGD gossips
:math:`x^{(t)}` and then adds the step (combine-then-adapt) where the paper
gossips :math:`x^{(t+1/2)}`, and :math:`d` includes either.

Memory: 2 model-sized buffers per node (the previous parameters in their own
dtype, :math:`\hat m` in float32). No communication.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lpdec.algorithms import _common
from lpdec.algorithms import declaration


class QGMomentumState(NamedTuple):
    """State of `qg_momentum`.

    Attributes:
      count: shape=(), dtype=int32; steps taken (the schedules' argument).
      prev_params: tree like params, in their dtype; x^(t-1), the parameters
        the previous step received (a copy: the state owns its buffers).
      prev_lr: shape=(), dtype=float32; eta_(t-1).
      m_hat: float32 tree; the quasi-global buffer. After step t it holds
        m_hat^(t-1); step t + 1 first folds in d^(t), which needs its params.
    """

    count: jax.Array  # type: ignore[assignment]  # a field shadowing tuple.count, as in optax
    prev_params: Any
    prev_lr: jax.Array
    m_hat: Any


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hyperparams:
    """`qg_momentum`'s arguments, validated on construction; `init` and `step` read them."""

    learning_rate: _common.Scalar
    momentum: _common.Scalar = 0.9
    nesterov: bool = False

    def __post_init__(self):
        lr = _known(self.learning_rate, "learning_rate")
        if lr is not None and not (math.isfinite(lr) and lr >= 0):
            raise ValueError(
                "qg_momentum: learning_rate must be a finite number "
                f">= 0; got {self.learning_rate!r}."
            )
        beta = _known(self.momentum, "momentum")
        if beta is not None and not 0 <= beta < 1:
            raise ValueError(f"qg_momentum: momentum must be in [0, 1); got {self.momentum!r}.")
        if not isinstance(self.nesterov, bool):
            raise TypeError(f"qg_momentum: nesterov must be True or False; got {self.nesterov!r}.")


def init(params: optax.Params, hp: Hyperparams) -> QGMomentumState:
    """The state at step 0 (m_hat = 0); runs anywhere, as it does not communicate."""
    return QGMomentumState(
        count=jnp.zeros((), jnp.int32),
        prev_params=jax.tree.map(lambda p: jnp.array(p, copy=True), params),
        prev_lr=jnp.zeros((), jnp.float32),
        # zeros_like keeps the parameters' sharding type (varying over the nodes).
        m_hat=jax.tree.map(lambda p: jnp.zeros_like(p, jnp.float32), params),
    )


def step(
    updates: optax.Updates,
    state: QGMomentumState,
    params: optax.Params,
    hp: Hyperparams,
) -> tuple[optax.Updates, QGMomentumState]:
    """One QG-DSGDm step: `updates` are the gradients g, `params` are x^(t).

    `learning_rate` and `momentum` are numbers, scalar arrays or schedules of
    `state.count`.
    """
    lr = _common.at_step(hp.learning_rate, state.count)
    beta = mu = _common.at_step(hp.momentum, state.count)

    # d^(t-1) = (x^(t-1) - x^(t)) / eta_(t-1) exists from the second step on, and only
    # after a step that moved (a schedule warming up from 0 has eta_0 = 0).
    moved = (state.count > 0) & (state.prev_lr != 0)
    safe_lr = jnp.where(moved, state.prev_lr, 1.0)

    def buffer(m_hat, prev, x):
        d = (prev.astype(jnp.float32) - x.astype(jnp.float32)) / safe_lr
        return jnp.where(moved, mu * m_hat + (1 - mu) * d, m_hat)

    m_hat = jax.tree.map(buffer, state.m_hat, state.prev_params, params)

    def direction(grad, h):
        g = grad.astype(jnp.float32)
        m = g + beta * h
        return (-lr * (g + beta * m if hp.nesterov else m)).astype(grad.dtype)

    new_updates = jax.tree.map(direction, updates, m_hat)
    return new_updates, QGMomentumState(state.count + 1, params, lr, m_hat)


def _known(value: _common.Scalar, field: str) -> float | None:
    """The value of a number or concrete scalar array now; None for a schedule or a tracer."""
    if callable(value):
        return None
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, np.ndarray, jax.Array)):
        raise ValueError(
            f"qg_momentum: {field} must be a number, a scalar array or a schedule; got {value!r}."
        )
    if np.ndim(value) != 0:
        raise ValueError(f"qg_momentum: {field} must be a scalar; got shape {np.shape(value)}.")
    try:
        return float(value)
    except jax.errors.ConcretizationTypeError:
        return None  # traced: optax.inject_hyperparams passes hyperparameters inside jit


def qg_momentum(
    learning_rate: _common.Scalar,
    momentum: _common.Scalar = 0.9,
    nesterov: bool = False,
) -> optax.GradientTransformationExtraArgs:
    r"""Quasi-global momentum SGD (QG-DSGDm): momentum built from the gossiped model's moves.

    .. math::

      \hat m \leftarrow \mu \hat m + (1 - \mu) \frac{x^{(t-1)} - x^{(t)}}{\eta_{t-1}},\quad
      m = g + \beta \hat m,\quad
      u = -\eta_t m \;\;\text{or (nesterov)}\;\; u = -\eta_t (g + \beta m)

    g is the incoming gradient, :math:`x^{(t)}` the params at this step,
    :math:`\eta_t` is `learning_rate` (at step t for a schedule),
    :math:`\beta = \mu` is `momentum`. The :math:`\hat m` update is skipped at
    t = 0 and after a step with :math:`\eta_{t-1} = 0`.

    A local optimizer: it does not communicate. Put it FIRST in the chain,
    before the decentralized transform, whose effect it measures through the
    parameters.

    Args:
      learning_rate: :math:`\eta` >= 0: a number, a scalar array or an optax
        schedule; works with ``optax.inject_hyperparams``.
      momentum: :math:`\beta = \mu` in [0, 1): a number, a scalar array or a
        schedule, like `learning_rate`.
      nesterov: step by g + beta m instead of m.

    Returns:
      An optax transform; `update` needs `params`.

    Example:
      >>> tx = optax.chain(
      ...     lpdec.qg_momentum(0.1, momentum=0.9, nesterov=True),
      ...     lpdec.dpsgd(lpdec.ring(8), axis_name="nodes"),
      ... )

    References:
      Lin et al., Quasi-Global Momentum: Accelerating Decentralized Deep
      Learning on Heterogeneous Data, ICML 2021, https://arxiv.org/abs/2102.04761
    """
    hp = Hyperparams(**locals())

    def init_fn(params):
        return init(params, hp)

    def update_fn(updates, state, params=None, **extra_args):
        del extra_args
        return step(updates, state, _common.require_params(params, "qg_momentum"), hp)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


DECLARATION = declaration.Declaration(qg_momentum, "local", (QGMomentumState,), Hyperparams)
