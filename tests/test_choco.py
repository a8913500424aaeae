"""lpdec.algorithms.choco (CHOCO-SGD) against dense numpy simulations with an explicit W."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _gossip_problem import LR
from _gossip_problem import D
from _gossip_problem import N
from _gossip_problem import T
from _gossip_problem import check_zero_updates_preserve_the_node_average
from _gossip_problem import problem
from _gossip_problem import ring_w
from _gossip_problem import torus_2x4_w
from test_references import base_key
from test_references import leaf_keys
from test_references import np_round_trip

import lpdec
from lpdec import testing as harness


def sgd_updates(grads):
    """The local optimizer's updates, fed to the algorithm directly so that x + u is one
    float32 add the test can repeat exactly (inside a chain XLA may fuse -lr * g + x)."""
    return grads * np.float32(-LR)


CHOCO_COMPRESSORS = [
    lpdec.identity(),
    lpdec.minmax(bits=8, rounding="stochastic", chunk_size=16),
    lpdec.minmax(bits=2, rounding="nearest"),
    lpdec.top_k(0.3),
    lpdec.random_k(0.3),
]


@pytest.mark.parametrize("mode", harness.MODES)
@pytest.mark.parametrize("compressor", CHOCO_COMPRESSORS, ids=repr)
def test_choco_each_step_matches_dense_update(rng, mode, compressor):
    """From the state after step t, step t+1 in numpy: q bit for bit, the rest in float64.

    The sum mode keeps e = x - x^ and c = sum_j W_ij (x^_j - x^_i); the paper's x^ is
    rebuilt as the running sum of the q's, and c and e are checked against it. q is
    recomputed in numpy (`np_round_trip`) with keys derived from the seed and the step
    counted here (`leaf_keys`), not with the library's compressor or `node_key`.
    """
    topology, gamma = lpdec.ring(N), 0.6
    w = ring_w(N)
    x0, grads = problem(rng)
    updates = sgd_updates(grads)
    tx = lpdec.choco(topology, compressor, gamma=gamma, seed=4)
    params, states, state0 = harness.run(tx, {"w": x0}, T, updates={"w": updates}, mode=mode)
    x_prev, lag_prev = x0.astype(np.float64), np.asarray(state0.lag["w"])
    consensus_prev = np.zeros((N, D))
    x_hat = np.zeros((N, D))  # the paper's public copies, float64
    for t in range(T):
        q = np.zeros((N, D))
        keys = leaf_keys(base_key(4), t, num_nodes=N, num_leaves=1)
        for i in range(N):
            # The node's x~ - x^ = e + u (one float32 add), compressed with its key: same bits.
            q[i] = np_round_trip(compressor, lag_prev[i] + updates[i, t], keys[i, 0])
        x_hat = x_hat + q
        consensus = np.asarray(states.consensus["w"])[:, t]
        np.testing.assert_allclose(consensus, consensus_prev + (w - np.eye(N)) @ q, atol=1e-5)
        np.testing.assert_allclose(consensus, (w - np.eye(N)) @ x_hat, atol=1e-5)
        x = np.asarray(params["w"])[:, t].astype(np.float64)
        np.testing.assert_allclose(x, x_prev + updates[:, t] + gamma * consensus, atol=1e-5)
        lag = np.asarray(states.lag["w"])[:, t]
        np.testing.assert_allclose(lag, x - x_hat, atol=1e-5)
        x_prev, lag_prev, consensus_prev = x, lag, consensus


@pytest.mark.parametrize("mode", harness.MODES)
def test_choco_free_running_matches_float64_simulation(rng, mode):
    topology, gamma = lpdec.torus(2, 4), 0.5
    x0, grads = problem(rng)
    tx = optax.chain(optax.sgd(LR), lpdec.choco(topology, lpdec.identity(), gamma=gamma))
    params, _, _ = harness.run(tx, {"w": x0}, T, updates={"w": grads}, mode=mode)
    w = torus_2x4_w()
    x = x0.astype(np.float64)
    x_hat = np.zeros_like(x)
    for t in range(T):
        x_tilde = x - LR * grads[:, t]
        x_hat = x_hat + (x_tilde - x_hat)
        x = x_tilde + gamma * (w @ x_hat - x_hat)
    np.testing.assert_allclose(np.asarray(params["w"])[:, -1], x, atol=3e-5, rtol=0)


@pytest.mark.parametrize("mode", harness.MODES)
def test_choco_per_peer_replicas_equal_owners_public_copies_bit_for_bit(rng, mode):
    topology, steps = lpdec.ring(N), 100
    x0, grads = problem(rng, steps=steps)
    comp = lpdec.minmax(bits=4, rounding="stochastic", chunk_size=8)
    tx = optax.chain(optax.sgd(LR), lpdec.choco(topology, comp, gamma=0.5, replicas="per_peer"))
    _, states, _ = harness.run(tx, {"w": x0}, steps, updates={"w": grads}, mode=mode)
    x_hat = np.asarray(states[1].x_hat["w"])[:, -1]
    for c, edge_class in enumerate(topology.rounds[0].edge_classes):
        replicas = np.asarray(states[1].replicas[c]["w"])[:, -1]
        for source, destination in edge_class.perm:
            np.testing.assert_array_equal(replicas[destination], x_hat[source])
    # The sum mode's consensus term stays sum_j W_ij (x^_j - x^_i) of its implicit public
    # copies x - e, up to float32 rounding. (Its trajectory is not bit-identical to the
    # per-peer run's: the two programs fuse, and so round, the model update differently.)
    tx_sum = optax.chain(optax.sgd(LR), lpdec.choco(topology, comp, gamma=0.5))
    params_sum, states_sum, _ = harness.run(
        tx_sum, {"w": x0}, steps, updates={"w": grads}, mode=mode
    )
    w = ring_w(N)
    x_hat_sum = (
        np.asarray(params_sum["w"], np.float64)[:, -1] - np.asarray(states_sum[1].lag["w"])[:, -1]
    )
    np.testing.assert_allclose(
        np.asarray(states_sum[1].consensus["w"])[:, -1], (w - np.eye(N)) @ x_hat_sum, atol=1e-4
    )


@pytest.mark.parametrize(
    "make",
    [
        lambda topo: lpdec.choco(topo, lpdec.minmax(8, "stochastic"), gamma=0.8),
        lambda topo: lpdec.choco(topo, lpdec.top_k(0.1), gamma=0.3),
    ],
    ids=["choco-minmax", "choco-topk"],
)
def test_zero_updates_preserve_the_node_average(rng, make):
    check_zero_updates_preserve_the_node_average(rng, make)


@pytest.mark.parametrize("mode", harness.MODES)
def test_a_nan_update_is_dropped_on_its_node_and_never_reaches_neighbours(rng, mode):
    topology = lpdec.ring(N)
    x0, grads = problem(rng)
    grads[3, 5, 7] = np.nan
    comp = lpdec.minmax(bits=8, rounding="stochastic")
    tx = lpdec.choco(topology, comp, gamma=0.5)
    chain = optax.chain(optax.sgd(LR), tx)
    params, states, _ = harness.run(chain, {"w": x0}, T, updates={"w": grads}, mode=mode)
    assert np.isfinite(np.asarray(params["w"])).all()
    counts = np.asarray(states[1].health.nonfinite_updates)[:, -1]
    np.testing.assert_array_equal(counts, [0, 0, 0, 1, 0, 0, 0, 0])


def test_choco_rejects_bad_arguments():
    comp = lpdec.minmax(8)
    with pytest.raises(ValueError, match="gamma"):
        lpdec.choco(lpdec.ring(8), comp, gamma=0.0)
    with pytest.raises(ValueError, match="static topology"):
        lpdec.choco(lpdec.one_peer_exponential(8), comp)
    with pytest.raises(ValueError, match="doubly"):
        lpdec.choco(lpdec.from_matrix(np.array([[0.5, 0.5], [1.0, 0.0]])), comp)
    with pytest.raises(ValueError, match="replicas"):
        lpdec.choco(lpdec.ring(8), comp, replicas="all")
    with pytest.raises(TypeError, match="compressor"):
        lpdec.choco(lpdec.ring(8), "minmax")
    tx = lpdec.choco(lpdec.ring(8), comp)
    with pytest.raises(ValueError, match="parameters"):
        jax.vmap(lambda x: tx.update(x, tx.init(x)), axis_name="nodes")(jnp.ones((8, 3)))
