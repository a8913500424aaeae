r"""A fixed gradient delay: the stale updates of asynchronous training, simulated synchronously.

.. math::

  \mathrm{out}_k = u_{k-\tau} \quad (k \ge \tau), \qquad \mathrm{out}_k = 0 \quad (k < \tau)

A local transform: put it after the local optimizer and before the
decentralized algorithm, ``optax.chain(optax.sgd(lr), lpdec.delay(tau),
lpdec.moniqua(lpdec.random_matching(n, seed), ...))``. Each node then applies
at step k the update it computed at step k - τ (from the model it held
then), which is how AD-PSGD (seed 003, section 5) perturbs the model:
gradients of staleness τ. With ``random_matching`` (a fresh random pairwise
matching each step as W_k) this is the synchronous stand-in for AD-PSGD.

What it simulates: stale gradients of one fixed staleness τ for every node
and step, each step's averaging over a random matching, all nodes still
advancing together in synchronous rounds. What it does not: true
asynchrony, delays that vary over time or differ between nodes, workers
running at different speeds, and the single-worker-update iteration that
AD-PSGD's analysis counts (one random worker updates per iteration).
It is the cheap approximation: `lpdec.async_sim` simulates AD-PSGD and Moniqua on
AD-PSGD exactly as Theorem 5 counts them (one worker, one edge, one gradient of
its own staleness per iteration; speeds; delays that vary), at the price of
one compiled scan step per gradient.

Memory: τ update-sized buffers (a FIFO ring of the last τ updates).
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from lpdec.algorithms import declaration


class DelayState(NamedTuple):
    """State of `delay`.

    Attributes:
      head: shape=(), dtype=int32; the ring slot holding the oldest update,
        the one returned next.
      buffer: a tree like the updates, in the parameters' dtypes, with a
        leading axis of size τ: the last τ updates (zeros before any
        arrived), oldest at `head`.
    """

    head: jax.Array
    buffer: Any


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hyperparams:
    """`delay`'s arguments, validated on construction; `init` and `step` read them."""

    steps: int

    def __post_init__(self):
        if isinstance(self.steps, jax.Array):
            raise TypeError(
                "delay: steps sets the buffer's shape, so it must be a Python int, not an array; "
                "under optax.inject_hyperparams use optax.inject_hyperparams(lpdec.delay, "
                f"static_args=('steps',)); got {self.steps!r}."
            )
        if isinstance(self.steps, bool):
            raise TypeError(f"delay: steps must be an integer >= 0; got {self.steps!r}.")
        try:
            steps = operator.index(self.steps)
        except TypeError:
            raise TypeError(f"delay: steps must be an integer >= 0; got {self.steps!r}.") from None
        if steps < 0:
            raise ValueError(f"delay: steps must be >= 0; got {steps}.")
        object.__setattr__(self, "steps", steps)


def init(params: optax.Params, hp: Hyperparams) -> DelayState:
    """An empty FIFO of τ = `steps` >= 1 updates; runs anywhere, as it does not communicate."""
    # zeros_like keeps the leaves' varying-ness under shard_map, like the updates'.
    buffer = jax.tree.map(lambda p: jnp.zeros_like(p, shape=(hp.steps, *p.shape)), params)
    return DelayState(head=jnp.zeros((), jnp.int32), buffer=buffer)


def step(
    updates: optax.Updates,
    state: DelayState,
    hp: Hyperparams,
) -> tuple[optax.Updates, DelayState]:
    """Returns the update from τ = `steps` steps ago and stores this one in its slot."""
    oldest = jax.tree.map(lambda b, u: b[state.head].astype(u.dtype), state.buffer, updates)
    buffer = jax.tree.map(
        lambda b, u: b.at[state.head].set(u.astype(b.dtype)), state.buffer, updates
    )
    return oldest, DelayState(head=(state.head + 1) % hp.steps, buffer=buffer)


def delay(steps: int) -> optax.GradientTransformationExtraArgs:
    r"""Returns the incoming update from `steps` steps ago (zeros for the first `steps` steps).

    .. math::

      \mathrm{out}_k = u_{k-\tau}\;(k \ge \tau),\qquad \mathrm{out}_k = 0\;(k < \tau)

    with τ = `steps` and :math:`u_k` the update this transform receives at
    step k. Simulates gradients of fixed staleness τ in synchronous rounds
    (not true asynchrony, not variable or per-node delays; see the module
    docstring; `lpdec.async_sim` is the exact AD-PSGD simulation). Memory: τ
    update-sized buffers. No communication.

    Args:
      steps: τ >= 0, a Python int (it sets the buffer's shape: under
        ``optax.inject_hyperparams`` pass ``static_args=("steps",)``); 0 is
        the identity.

    Returns:
      An optax transform to put after the local optimizer and before the
      decentralized algorithm.

    Example:
      >>> tx = optax.chain(
      ...     optax.sgd(0.1),
      ...     lpdec.delay(2),
      ...     lpdec.moniqua(lpdec.random_matching(8, seed=0), lpdec.modulo(8, 0.5)),
      ... )

    References:
      Lian et al., Asynchronous Decentralized Parallel Stochastic Gradient
      Descent, ICML 2018, https://arxiv.org/abs/1710.06952
    """
    hp = Hyperparams(**locals())
    if hp.steps == 0:
        return optax.with_extra_args_support(optax.identity())

    def init_fn(params):
        return init(params, hp)

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        return step(updates, state, hp)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


DECLARATION = declaration.Declaration(delay, "local", (DelayState,), Hyperparams)
