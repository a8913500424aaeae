"""The optimizers a config names: the learning-rate schedule, the node's own (local)
optimizer, and DiLoCo's outer step.

Tables as `train_lib.registry`'s (`train_lib.tables`): `make_schedule` and
`make_local_optimizer` are what `setup` calls; `outer(view)` is the outer step the
exchanges of `registry.EXCHANGES` chain after their mean.
"""

from __future__ import annotations

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

OPTIMIZERS = {
    "adam": Entry(lambda c, lr: optax.adam(lr)),
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
    pseudo-gradients are not amplified by 1 / (1 - momentum) at once.
    """
    if not c.outer_warmup_rounds or not c.outer_momentum:
        return optax.sgd(c.outer_lr, momentum=c.outer_momentum or None, nesterov=True)
    momentum = optax.linear_schedule(0.0, c.outer_momentum, c.outer_warmup_rounds)
    return optax.inject_hyperparams(optax.sgd)(
        learning_rate=c.outer_lr, momentum=momentum, nesterov=True
    )


OUTER = ("outer_lr", "outer_momentum", "outer_warmup_rounds")
# The outer step of a synchronous warm-up: every node lands on the exchanged mean.
PLAIN_STEP = {"outer_lr": 1.0, "outer_momentum": 0.0, "outer_warmup_rounds": 0}


def check_outer(c) -> None:
    if not c.outer_lr > 0:
        raise ConfigError(f"config.outer_lr={c.outer_lr!r} must be > 0.")
    if not 0 <= c.outer_momentum < 1:
        raise ConfigError(f"config.outer_momentum={c.outer_momentum!r} must be in [0, 1).")
    rounds = c.outer_warmup_rounds
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
        raise ConfigError(f"config.outer_warmup_rounds={rounds!r} must be an integer >= 0.")
