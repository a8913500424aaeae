"""The optimizers a config names: the learning-rate schedule, the node's own (local)
optimizer, and DiLoCo's outer step.

Tables as `train_lib.registry`'s (`train_lib.tables`): `make_schedule` and
`make_local_optimizer` are what `setup` calls; `outer(view)` is the outer step the
exchanges of `registry.EXCHANGES` chain after their mean.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import optax

import lpdec
from train_lib.errors import ConfigError
from train_lib.tables import Entry
from train_lib.tables import build

# ----------------------------------------------------------------------------
# Learning-rate schedules: `build(view, total_steps)`; `make_schedule` adds the warmup.
# ----------------------------------------------------------------------------


def _piecewise(c, total_steps: int) -> optax.Schedule:
    # lr_boundaries are fractions of training; x lr_decay at each.
    boundaries = {int(f * total_steps): c.lr_decay for f in c.lr_boundaries}
    return optax.piecewise_constant_schedule(c.learning_rate, boundaries)


SCHEDULES = {
    "constant": Entry(
        lambda c, total: optax.constant_schedule(c.learning_rate), ("learning_rate",)
    ),
    "cosine": Entry(
        lambda c, total: optax.cosine_decay_schedule(
            c.learning_rate, max(1, total - c.warmup_steps)
        ),
        ("learning_rate", "warmup_steps"),
    ),
    "piecewise": Entry(_piecewise, ("learning_rate", "lr_boundaries", "lr_decay")),
}


def make_schedule(config: ml_collections.ConfigDict, total_steps: int) -> optax.Schedule:
    """`config.lr_schedule` over `total_steps`, after a linear warmup of `config.warmup_steps`.

    Builds only: `setup.check_values` checked the entry's values.
    """
    schedule = build(config, "lr_schedule", SCHEDULES, total_steps, checked=True)
    if config.warmup_steps:
        warmup = optax.linear_schedule(0.0, config.learning_rate, config.warmup_steps)
        schedule = optax.join_schedules([warmup, schedule], [config.warmup_steps])
    return schedule


# ----------------------------------------------------------------------------
# The node's own optimizer: `build(view, schedule)`; `make_local_optimizer` adds weight decay.
# ----------------------------------------------------------------------------


def _is_hidden_matrix(path, leaf) -> bool:
    """Muon's leaves: 2-D kernels of dense layers, not the embeddings nor the output head."""
    names = [str(getattr(key, "key", getattr(key, "name", key))) for key in path]
    return (
        getattr(leaf, "ndim", 0) == 2
        and bool(names)
        and names[-1] == "kernel"
        and not any("embed" in name or name == "head" for name in names)
    )


# Muon's quintic Newton-Schulz coefficients (Jordan et al. 2024): five steps take a
# matrix's singular values into about [0.7, 1.2] without computing them.
_NEWTON_SCHULZ = (3.4445, -4.7750, 2.0315)


def orthogonalize(x: jax.Array, steps: int = 5, eps: float = 1e-7) -> jax.Array:
    """About U V^T of the 2-D `x` = U S V^T: Muon's Newton-Schulz iteration, in float32."""
    a, b, c = _NEWTON_SCHULZ
    tall = x.shape[0] > x.shape[1]
    y = x.T if tall else x
    y = y.astype(jnp.float32) / (jnp.linalg.norm(x.astype(jnp.float32)) + eps)
    for _ in range(steps):
        gram = y @ y.T
        y = a * y + (b * gram + c * gram @ gram) @ y
    return (y.T if tall else y).astype(x.dtype)


def scale_by_muon(beta: float = 0.95, steps: int = 5) -> optax.GradientTransformation:
    """Muon's direction for 2-D leaves: Nesterov momentum, orthogonalized, scaled.

    m <- beta m + (1 - beta) g; the update is orthogonalize((1 - beta) g + beta m)
    times sqrt(max(1, rows / cols)), as in Muon's reference implementation.
    """

    def init(params):
        return jax.tree.map(jnp.zeros_like, params)

    def update(updates, momentum, params=None):
        del params
        momentum = jax.tree.map(lambda m, g: beta * m + (1 - beta) * g, momentum, updates)

        def direction(g, m):
            rows, cols = g.shape
            scale = max(1.0, rows / cols) ** 0.5
            return scale * orthogonalize((1 - beta) * g + beta * m, steps)

        return jax.tree.map(direction, updates, momentum), momentum

    return optax.GradientTransformation(init, update)


def muon(c, lr: optax.Schedule) -> optax.GradientTransformation:
    """Muon (Jordan et al. 2024; as DiLoCo's inner optimizer, MuLoCo, arXiv 2505.23725).

    The hidden layers' 2-D kernels take Muon's step (`scale_by_muon`, momentum
    `c.muon_beta`) at the schedule `lr`; every other leaf (embeddings, the output
    head, norms, biases, convolutions) takes Adam at the same schedule times
    `c.muon_adam_lr / c.learning_rate`, as Muon's authors keep Adam for those. Each
    matrix is orthogonalized whole, so a machine's model cannot be split over its
    workers (`setup` refuses `shard_model` with it).
    """
    ratio = c.muon_adam_lr / c.learning_rate

    def labels(params):
        return jax.tree_util.tree_map_with_path(
            lambda path, leaf: "muon" if _is_hidden_matrix(path, leaf) else "adam", params
        )

    return optax.multi_transform(
        {
            "muon": optax.chain(scale_by_muon(beta=c.muon_beta), optax.scale_by_learning_rate(lr)),
            "adam": optax.adam(lambda step: lr(step) * ratio),
        },
        labels,
    )


def _check_muon(c) -> None:
    if not c.muon_adam_lr > 0:
        raise ConfigError(f"config.muon_adam_lr={c.muon_adam_lr!r} must be > 0.")
    if not 0 <= c.muon_beta < 1:
        raise ConfigError(f"config.muon_beta={c.muon_beta!r} must be in [0, 1).")


OPTIMIZERS = {
    "adam": Entry(lambda c, lr: optax.adam(lr)),
    "muon": Entry(muon, ("learning_rate", "muon_adam_lr", "muon_beta"), _check_muon),
    "nesterov": Entry(
        lambda c, lr: optax.sgd(lr, momentum=c.momentum, nesterov=True), ("momentum",)
    ),
    "qg_momentum": Entry(
        lambda c, lr: lpdec.qg_momentum(lr, momentum=c.momentum, nesterov=True), ("momentum",)
    ),
    "sgd": Entry(lambda c, lr: optax.sgd(lr, momentum=c.momentum or None), ("momentum",)),
}


def make_local_optimizer(
    config: ml_collections.ConfigDict, schedule: optax.Schedule
) -> optax.GradientTransformation:
    """`config.optimizer` at `schedule`, after weight decay when `config.weight_decay` > 0.

    Builds only: `setup.check_values` checked the entry's values.
    """
    optimizer = build(config, "optimizer", OPTIMIZERS, schedule, checked=True)
    if config.weight_decay:
        return optax.chain(optax.add_decayed_weights(config.weight_decay), optimizer)
    return optimizer


# ----------------------------------------------------------------------------
# DiLoCo's outer step: `outer(view)`, chained after an exchange's mean.
# ----------------------------------------------------------------------------


def outer(c) -> optax.GradientTransformation:
    """DiLoCo's outer step: Nesterov momentum on the averaged pseudo-gradient.

    With ``outer_warmup_rounds`` K > 0 the momentum rises linearly from 0 at the first
    round to ``outer_momentum`` at round K + 1, so the first rounds' large and aligned
    pseudo-gradients are not amplified by 1 / (1 - momentum) at once. With
    ``outer_decay_rounds`` D > 0 it falls linearly back to 0 over the run's last D
    rounds (``(num_steps - sync_steps) // local_steps`` in all), so the last rounds' small
    pseudo-gradients are not outweighed by the momentum of earlier, larger ones (Pier,
    arXiv 2511.17849, warms the outer momentum up and decays it).

    With ``outer_slow_weight`` w > 0, a slow momentum ``outer_slow_momentum`` b beside
    the fast one (MT-DAO, arXiv 2510.05361, keeps a slow first moment beside the fast
    one so that the direction survives infrequent synchronisation): the step is
    (1 - w) x the fast Nesterov step + w x a Nesterov step of momentum b at
    ``outer_lr`` x (1 - b) / (1 - outer_momentum), a constant rate that gives the two
    the same gain on a steady pseudo-gradient (1 / (1 - outer_momentum) times it), so
    w moves weight between the timescales, not the step's size. The slow momentum is
    neither warmed up nor decayed: it starts at 0 and rises by itself.
    """
    fast = _fast_outer(c)
    weight = getattr(c, "outer_slow_weight", 0.0)
    if not weight:
        return fast
    gain = (1 - c.outer_slow_momentum) / (1 - c.outer_momentum)
    slow = slow_nesterov(c.outer_lr * gain, c.outer_slow_momentum)
    return mixture(fast, slow, weight)


def slow_nesterov(learning_rate: float, momentum: float) -> optax.GradientTransformation:
    """Nesterov momentum `momentum` at a constant `learning_rate`: -lr (g + mu m), m <- mu m + g."""

    def init_fn(params):
        return jax.tree.map(jnp.zeros_like, params)

    def update_fn(updates, trace, params=None):
        del params
        trace = jax.tree.map(lambda m, g: momentum * m + g, trace, updates)
        out = jax.tree.map(lambda g, m: -learning_rate * (g + momentum * m), updates, trace)
        return out, trace

    return optax.GradientTransformation(init_fn, update_fn)


def mixture(
    fast: optax.GradientTransformation, slow: optax.GradientTransformation, weight: float
) -> optax.GradientTransformation:
    """(1 - weight) x `fast`'s step + weight x `slow`'s, both of the same updates."""

    def init_fn(params):
        return fast.init(params), slow.init(params)

    def update_fn(updates, state, params=None):
        a, fast_state = fast.update(updates, state[0], params)
        b, slow_state = slow.update(updates, state[1], params)
        out = jax.tree.map(lambda x, y: (1 - weight) * x + weight * y, a, b)
        return out, (fast_state, slow_state)

    return optax.GradientTransformation(init_fn, update_fn)


def _fast_outer(c) -> optax.GradientTransformation:
    """The outer Nesterov step at `outer_momentum`, warmed up and decayed (`outer`)."""
    decay = getattr(c, "outer_decay_rounds", 0)
    if not (c.outer_warmup_rounds or decay) or not c.outer_momentum:
        return optax.sgd(c.outer_lr, momentum=c.outer_momentum or None, nesterov=True)
    if c.outer_warmup_rounds:
        momentum = optax.linear_schedule(0.0, c.outer_momentum, c.outer_warmup_rounds)
    else:  # (optax's linear schedule over 0 steps stays at its start, 0)
        momentum = optax.constant_schedule(c.outer_momentum)
    if decay:
        rounds = (c.num_steps - c.sync_steps) // c.local_steps
        momentum = optax.join_schedules(
            [momentum, optax.linear_schedule(c.outer_momentum, 0.0, decay)],
            [rounds - decay],
        )
    return optax.inject_hyperparams(optax.sgd)(
        learning_rate=c.outer_lr, momentum=momentum, nesterov=True
    )


OUTER = (
    "outer_lr",
    "outer_momentum",
    "outer_warmup_rounds",
    "outer_decay_rounds",
    "outer_slow_momentum",
    "outer_slow_weight",
    "num_steps",
    "local_steps",
    "sync_steps",
)
# The outer step of a synchronous warm-up: every node lands on the exchanged mean.
PLAIN_STEP = {
    "outer_lr": 1.0,
    "outer_momentum": 0.0,
    "outer_warmup_rounds": 0,
    "outer_decay_rounds": 0,
    "outer_slow_weight": 0.0,
}


def check_outer(c) -> None:
    if not c.outer_lr > 0:
        raise ConfigError(f"config.outer_lr={c.outer_lr!r} must be > 0.")
    if not 0 <= c.outer_momentum < 1:
        raise ConfigError(f"config.outer_momentum={c.outer_momentum!r} must be in [0, 1).")
    if not 0 <= c.outer_slow_momentum < 1:
        raise ConfigError(
            f"config.outer_slow_momentum={c.outer_slow_momentum!r} must be in [0, 1)."
        )
    if not 0 <= c.outer_slow_weight <= 1:
        raise ConfigError(f"config.outer_slow_weight={c.outer_slow_weight!r} must be in [0, 1].")
    rounds = c.outer_warmup_rounds
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
        raise ConfigError(f"config.outer_warmup_rounds={rounds!r} must be an integer >= 0.")
    decay = c.outer_decay_rounds
    if isinstance(decay, bool) or not isinstance(decay, int) or decay < 0:
        raise ConfigError(f"config.outer_decay_rounds={decay!r} must be an integer >= 0.")
    if decay and not c.num_steps:
        raise ConfigError(
            f"config.outer_decay_rounds={decay} decays the momentum over the run's last "
            "rounds: it needs the run's length in steps (config.num_steps > 0)."
        )
    rounds = (c.num_steps - c.sync_steps) // c.local_steps if c.local_steps else 0
    if decay and c.outer_warmup_rounds + decay > rounds:
        raise ConfigError(
            f"config.outer_warmup_rounds={c.outer_warmup_rounds} + config.outer_decay_rounds="
            f"{decay} exceed the run's {rounds} rounds ((config.num_steps={c.num_steps} - "
            f"config.sync_steps={c.sync_steps}) // config.local_steps={c.local_steps})."
        )
