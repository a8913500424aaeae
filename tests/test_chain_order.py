"""lpdec.algorithms.chain_order (check_chain, run by init_nodes, and lpdec.chain): the orders of
local optimizer, guard and gossip it refuses, each in one line, and the documented ones."""

import numpy as np
import optax
import pytest

import lpdec

N, D = 8, 16


def _init(tx, n=N):
    layout = lpdec.make_layout(n)
    return lpdec.init_nodes(tx, {"w": np.zeros(D, np.float32)}, layout)


def _gossip(n=N):
    return lpdec.choco(lpdec.ring(n), lpdec.minmax(8), gamma=0.5)


@pytest.mark.parametrize(
    "local",
    [optax.adam(1e-3), optax.sgd(0.1, momentum=0.9), optax.sgd(optax.constant_schedule(0.1))],
    ids=["adam", "momentum", "scheduled-sgd"],
)
def test_gossip_before_a_stateful_local_optimizer_is_refused(local):
    with pytest.raises(ValueError, match=r"ChocoState\) comes before .* lpdec.chain") as info:
        _init(optax.chain(_gossip(), local))
    assert "\n" not in str(info.value)
    # The same transforms in the right order, and the helper that builds it, start.
    _init(optax.chain(local, _gossip()))
    _init(lpdec.chain(local, _gossip()))
    # check_chain=False lets a user who means it through.
    lpdec.init_nodes(
        optax.chain(_gossip(), local),
        {"w": np.zeros(D, np.float32)},
        lpdec.make_layout(N),
        check_chain=False,
    )


@pytest.mark.parametrize(
    "guard",
    [
        lambda tx: optax.apply_if_finite(tx, max_consecutive_errors=5),
        lpdec.local_apply_if_finite,
    ],
    ids=["optax.apply_if_finite", "lpdec.local_apply_if_finite"],
)
@pytest.mark.parametrize(
    "communicating",
    [
        lambda: optax.chain(optax.sgd(0.1), _gossip()),
        lambda: lpdec.local_mean(axis_name="nodes"),
        lambda: optax.inject_hyperparams(lpdec.dpsgd)(lpdec.ring(N)),
    ],
    ids=["sgd+choco", "local_mean", "injected-dpsgd"],
)
def test_a_per_node_guard_around_communication_is_refused(guard, communicating):
    with pytest.raises(ValueError, match=r"wrapped in .*apply_if_finite.*per-node") as info:
        _init(guard(communicating()))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "tx",
    [
        lambda: optax.chain(lpdec.local_mean(axis_name="nodes"), optax.adam(1e-3)),
        lambda: optax.chain(
            optax.sgd(0.1), lpdec.delay(2), lpdec.moniqua(lpdec.ring(N), lpdec.modulo(8, 1.0))
        ),
        lambda: optax.chain(lpdec.qg_momentum(0.1, 0.9), lpdec.dpsgd(lpdec.ring(N))),
        lambda: lpdec.chain(optax.adam(1e-3), optax.inject_hyperparams(lpdec.dpsgd)(lpdec.ring(N))),
        lambda: lpdec.diloco(
            optax.adam(1e-3),
            optax.chain(lpdec.local_mean(axis_name="nodes"), optax.sgd(0.7, momentum=0.9)),
            local_steps=4,
        ),
        # A stateless transform after gossip (a projection) is allowed.
        lambda: optax.chain(optax.adam(1e-3), _gossip(), optax.keep_params_nonnegative()),
    ],
    ids=["mean-first", "delay-moniqua", "qgm", "injected", "diloco", "projection-after-gossip"],
)
def test_the_documented_orders_start(tx):
    _init(tx())


def test_a_gossip_state_inside_a_wrapper_is_seen():
    """inject_hyperparams holds the gossip state one level down: the order is still read."""
    gossip_first = optax.chain(optax.inject_hyperparams(lpdec.dpsgd)(lpdec.ring(N)), optax.adam(1))
    with pytest.raises(ValueError, match="comes before"):
        _init(gossip_first)
