r"""Local steps with an outer optimizer: DiLoCo, its delayed (streaming) form, over any exchange.

Each node takes H steps of its own inner optimizer; every H-th step it turns
the distance it travelled since the last synchronisation into a
pseudo-gradient and hands it to the outer transform, which exchanges it and
takes one outer optimizer step on the synchronised parameters (the anchor):

.. math::

  \Delta_i = a - x_i^{(H)}, \qquad a^{+} = a + \mathrm{outer}(\Delta_i), \qquad x_i \leftarrow a^{+}

The exchange is part of `outer`, written as an optax chain in lpdec's usual
order:

- a mean exchange FIRST, on the pseudo-gradients, then the outer optimizer:
  ``optax.chain(lpdec.local_mean(...) or lpdec.compressed_mean(...),
  optax.sgd(0.7, momentum=0.9, nesterov=True))`` is DiLoCo (Douillard et al.)
  with a full-precision or compressed all-reduce;
- a gossip algorithm LAST, on the anchors: ``optax.chain(optax.sgd(0.7,
  momentum=0.9, nesterov=True), lpdec.choco(topology, ...))`` lets each node
  take its outer step with its own pseudo-gradient and then gossip its anchor
  with its neighbours: with ``lpdec.dpsgd(lpdec.random_matching(n, seed))``
  one random peer per round, in the spirit of NoLoCo (whose modified Nesterov
  step this does not reproduce); compressed on a static graph with
  ``lpdec.choco``, whose replicas keep the compression error out of the
  anchors.

Communication happens only on exchange rounds: the outer transform runs
under a ``lax.cond`` on the step counter, which is the same on every node, so
the compiled program's collectives sit inside the conditional's exchange
branch and nothing crosses the wire on the H - 1 other steps. (Simulated
nodes that share a device are mapped with `jax.vmap`, which turns the
conditional into a select of both branches; that costs compute but no wire.)

Delayed outer step (``overlap=True``, the idea of Streaming DiLoCo): the
outer update computed at the end of round t is applied at the end of round
t + 1, so the exchange has a whole round of inner steps to complete. Each
node keeps its own, not yet averaged, progress of the last round on top of the
anchor:

.. math::

  \Delta_i^{t} = s_i^{t} - x_i^{t}, \qquad a^{t} = a^{t-1} + o^{t-1}, \qquad
  s_i^{t+1} = a^{t} + (x_i^{t} - s_i^{t}), \qquad o^{t} = \mathrm{outer}(\Delta^{t})

where :math:`s_i^t` and :math:`x_i^t` are node i's parameters at the start
and end of round t and :math:`o^t` the outer update (zero before the first
exchange arrives). Every round's local progress enters the anchor exactly
once, averaged, one round late.

Non-finite values: a node skips an inner step whose gradient, or whose
resulting parameters, hold NaN/Inf (parameters and inner optimizer state stay
as they were; counted in ``health.nonfinite_updates``). Parameters must stay
finite because optax applies updates by addition: no update brings an
infinite parameter back to the anchor. The outer exchange guards its own
inputs as every lpdec exchange does.

The nodes land on the anchor through optax's ``params + (anchor - params)``,
which float rounding can leave one ulp away from the anchor on some nodes; the
anchor itself is kept exactly in the state, so these roundings never
accumulate (the next pseudo-gradient is measured from the anchor).

Memory: the inner and outer states, a float32 anchor, and with `overlap` the
round's start and the pending outer update (two more parameter-sized buffers).
"""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from lpdec import gossip
from lpdec import wire
from lpdec.algorithms import _common
from lpdec.algorithms import declaration
from lpdec.algorithms import health as health_lib

PyTree = Any


class DiLoCoState(NamedTuple):
    """State of `diloco`.

    Attributes:
      count: shape=(), dtype=int32; inner steps taken (the same on every node).
      inner: the inner optimizer's state (kept across rounds, as in DiLoCo).
      outer: the outer transform's state (exchange and outer optimizer).
      anchor: float32 tree like the parameters: the synchronised parameters
        of the last applied outer step.
      start: with `overlap`, float32 parameters at the start of this round;
        otherwise ``()`` (the start is the anchor).
      pending: with `overlap`, the outer update computed at the end of the
        last round, applied at the end of this one; otherwise ``()``.
      sync: with ``sync_steps > 0``, the state of the `sync` transform;
        otherwise ``()``.
      health: `lpdec.Health`; ``nonfinite_updates`` counts the inner steps
        this node skipped (a NaN/Inf gradient or resulting parameter).
    """

    count: jax.Array  # type: ignore[assignment]  # a field shadowing tuple.count, as in optax
    inner: PyTree
    outer: PyTree
    anchor: PyTree
    start: PyTree
    pending: PyTree
    sync: PyTree
    health: health_lib.Health


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hyperparams:
    """`diloco`'s arguments, validated on construction; `init` and `step` read them."""

    inner: optax.GradientTransformation
    outer: optax.GradientTransformation
    local_steps: int
    overlap: bool = False
    sync_steps: int = 0
    sync: optax.GradientTransformation | None = None
    axis_name: gossip.AxisName = "nodes"

    def __post_init__(self):
        for name, tx in (("inner", self.inner), ("outer", self.outer)):
            if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
                raise TypeError(f"diloco: {name} must be an optax transform; got {tx!r}.")
        if (
            isinstance(self.local_steps, bool)
            or not isinstance(self.local_steps, int)
            or self.local_steps < 1
        ):
            raise ValueError(f"diloco: local_steps must be an int >= 1; got {self.local_steps!r}.")
        if not isinstance(self.overlap, bool):
            raise TypeError(f"diloco: overlap must be a bool; got {self.overlap!r}.")
        steps = self.sync_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"diloco: sync_steps must be an int >= 0; got {steps!r}.")
        if (self.sync is None) != (steps == 0):
            raise ValueError(
                "diloco: sync (the warm-up's exchange) is needed exactly when sync_steps > 0; "
                f"got sync_steps={steps!r}, sync={self.sync!r}."
            )
        if self.sync is not None:
            if not (callable(getattr(self.sync, "init", None)) and callable(self.sync.update)):
                raise TypeError(f"diloco: sync must be an optax transform; got {self.sync!r}.")
            object.__setattr__(self, "sync", optax.with_extra_args_support(self.sync))
        object.__setattr__(self, "inner", optax.with_extra_args_support(self.inner))
        object.__setattr__(self, "outer", optax.with_extra_args_support(self.outer))


def init(params: optax.Params, hp: Hyperparams) -> DiLoCoState:
    """The state at step 0; must run under `axis_name` when `outer` communicates."""
    anchor = _common.own_f32(params, hp.axis_name)
    state = DiLoCoState(
        count=jnp.zeros((), jnp.int32),
        inner=hp.inner.init(params),
        outer=hp.outer.init(anchor),
        anchor=anchor,
        start=_common.own_f32(params, hp.axis_name) if hp.overlap else (),
        pending=_common.zeros_f32(params, hp.axis_name) if hp.overlap else (),
        sync=hp.sync.init(anchor) if hp.sync is not None else (),
        health=health_lib.init(hp.axis_name),
    )
    # The exchange branch returns state varying over the nodes; the carry must start so.
    return gossip.to_varying(state, hp.axis_name)


def step(
    updates: optax.Updates,
    state: DiLoCoState,
    params: optax.Params,
    hp: Hyperparams,
    **extra_args,
) -> tuple[optax.Updates, DiLoCoState]:
    """One inner step; then the warm-up's exchange (the first `sync_steps` steps), or on
    every `local_steps`-th step after them, the exchange and the outer step."""
    inner_updates, inner_state = hp.inner.update(updates, state.inner, params, **extra_args)
    local = jax.tree.map(
        lambda p, u: p.astype(jnp.float32) + u.astype(jnp.float32), params, inner_updates
    )
    # A NaN/Inf gradient or step: this node skips the inner step (parameters and
    # optimizer state as they were). Parameters must stay finite: optax applies
    # updates by addition, and no update brings an infinite parameter back.
    ok = _common.all_finite(updates) & _common.all_finite(local)
    health = health_lib.count_update(state.health, ok)
    inner_state = _select(ok, inner_state, state.inner)
    local = _select(ok, local, _common.f32(params))
    count = state.count + 1

    def keep(carry):
        return gossip.to_varying(carry, hp.axis_name)

    def exchange(carry):
        local, inner_state, outer_state, anchor, start, pending, sync_state, health = carry
        begun = start if hp.overlap else anchor
        delta = jax.tree.map(jnp.subtract, begun, local)
        # The wire meter averages over steps: this round's bytes are spent once per H steps.
        with wire.share(1.0 / hp.local_steps):
            out, outer_state = hp.outer.update(delta, outer_state, anchor)
        out = _common.f32(out)
        if hp.overlap:
            anchor = jax.tree.map(jnp.add, anchor, pending)
            local = jax.tree.map(lambda a, x, s: a + (x - s), anchor, local, start)
            start, pending = local, out
        else:
            anchor = jax.tree.map(jnp.add, anchor, out)
            local = anchor
        carry = (local, inner_state, outer_state, anchor, start, pending, sync_state, health)
        return gossip.to_varying(carry, hp.axis_name)

    def synchronise(carry):
        # The warm-up: every step ends on the anchor `sync` moves (an exact mean and a
        # plain step of 1 make it data-parallel training), before any round begins.
        local, inner_state, outer_state, anchor, start, pending, sync_state, health = carry
        delta = jax.tree.map(jnp.subtract, anchor, local)
        # Not in the per-step meter: the warm-up's share of a run depends on its length.
        with wire.share(0.0):
            out, sync_state = hp.sync.update(delta, sync_state, anchor)
        anchor = jax.tree.map(jnp.add, anchor, _common.f32(out))
        local = anchor
        start = local if hp.overlap else start
        carry = (local, inner_state, outer_state, anchor, start, pending, sync_state, health)
        return gossip.to_varying(carry, hp.axis_name)

    carry = (
        local, inner_state, state.outer, state.anchor, state.start, state.pending,
        state.sync, health,
    )  # fmt: skip
    if hp.sync is None:
        local, *rest = jax.lax.cond(count % hp.local_steps == 0, exchange, keep, carry)
    else:
        # Rounds count from the warm-up's end: steps sync_steps + H, + 2H, ...
        round_ends = (count - hp.sync_steps) % hp.local_steps == 0
        branch = jnp.where(count <= hp.sync_steps, 2, jnp.where(round_ends, 1, 0))
        local, *rest = jax.lax.switch(branch, (keep, exchange, synchronise), carry)
    return _common.as_updates(local, params), DiLoCoState(count, *rest)


def _select(ok: jax.Array, new: PyTree, old: PyTree) -> PyTree:
    """`new` where the scalar `ok` is true, else `old`, leaf by leaf."""
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


def diloco(
    inner: optax.GradientTransformation,
    outer: optax.GradientTransformation,
    *,
    local_steps: int,
    overlap: bool = False,
    sync_steps: int = 0,
    sync: optax.GradientTransformation | None = None,
    axis_name: gossip.AxisName = "nodes",
) -> optax.GradientTransformationExtraArgs:
    r"""H local steps of `inner`, then an exchange and one step of `outer` (DiLoCo).

    .. math::

      x_i \leftarrow x_i + \mathrm{inner}(g_i) \text{ (H times)}, \qquad
      \Delta_i = a - x_i, \qquad a \leftarrow a + \mathrm{outer}(\Delta_i),
      \qquad x_i \leftarrow a

    :math:`a` is the anchor (the parameters at the last synchronisation) and
    :math:`\Delta_i` the pseudo-gradient. `outer` holds the exchange: a mean
    transform first (``lpdec.local_mean``, ``lpdec.compressed_mean``, with
    ``error_feedback=True`` for low bit widths) or a gossip transform last
    (``lpdec.dpsgd``, ``lpdec.choco``); see the module docstring. Nothing is
    communicated on the H - 1 steps between exchanges. With ``local_steps=1``,
    an exact mean and ``optax.sgd(1.0)`` as the outer optimizer this is plain
    data-parallel training with `inner`.

    Args:
      inner: the local optimizer (DiLoCo: AdamW); its state is kept across rounds.
      outer: the exchange and outer optimizer, an optax chain (DiLoCo:
        ``optax.chain(lpdec.local_mean(axis_name=...), optax.sgd(0.7,
        momentum=0.9, nesterov=True))``).
      local_steps: H >= 1, inner steps per round.
      overlap: apply each round's outer update one round late, so its exchange
        can run during the next round's inner steps (module docstring).
      sync_steps: a synchronous warm-up: the first `sync_steps` steps each end
        with an exchange through `sync` instead of the outer step, and the rounds
        of H steps begin after them (post-local SGD, Lin et al. 2020; the DiLoCo
        paper starts its rounds from a model pretrained data-parallel). The
        warm-up's bytes are not in `lpdec.wire`'s per-step meter (their share
        depends on the run's length): count ``sync_steps`` of `sync`'s exchange.
      sync: with ``sync_steps > 0``, the warm-up's exchange, an optax chain
        applied to the pseudo-gradient of one step as `outer` is
        (``optax.chain(lpdec.local_mean(axis_name=...), optax.sgd(1.0))``: every
        node lands on the exact mean of the nodes' parameters); None otherwise.
      axis_name: the nodes' named axis (the layout's ``axis_name``).

    Returns:
      An optax transform to use as the whole optimizer; `update` needs
      `params` and passes extra arguments on to `inner`.

    Example:
      >>> tx = lpdec.diloco(
      ...     optax.adamw(1e-3),
      ...     optax.chain(
      ...         lpdec.compressed_mean(lpdec.minmax(4), axis_name="nodes", error_feedback=True),
      ...         optax.sgd(0.7, momentum=0.9, nesterov=True),
      ...     ),
      ...     local_steps=50,
      ...     axis_name="nodes",
      ... )

    References:
      Douillard et al., DiLoCo: Distributed Low-Communication Training of
      Language Models, 2023, https://arxiv.org/abs/2311.08105;
      Douillard et al., Streaming DiLoCo with overlapping communication, 2025,
      https://arxiv.org/abs/2501.18512;
      Lin et al., Don't Use Large Mini-Batches, Use Local SGD, ICLR 2020,
      https://arxiv.org/abs/1808.07217 (post-local SGD: the synchronous warm-up)
    """
    hp = Hyperparams(**locals())

    def init_fn(params):
        _common.check_float_params(params, "diloco")
        return init(params, hp)

    def update_fn(updates, state, params=None, **extra_args):
        params = _common.require_params(params, "diloco")
        return step(updates, state, params, hp, **extra_args)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


DECLARATION = declaration.Declaration(diloco, "whole", (DiLoCoState,), Hyperparams)
