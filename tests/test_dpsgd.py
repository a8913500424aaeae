"""lpdec.algorithms.dpsgd (D-PSGD) against a dense numpy simulation with an explicit W."""

import numpy as np
import optax
import pytest
from _gossip_problem import LR
from _gossip_problem import N
from _gossip_problem import T
from _gossip_problem import check_zero_updates_preserve_the_node_average
from _gossip_problem import problem
from _gossip_problem import ring_w
from _gossip_problem import torus_2x4_w

import lpdec
from lpdec import testing as harness

WRITTEN_OUT = {"ring(8)": ring_w(8), "torus(2, 4)": torus_2x4_w()}


def mixing(topology, t):
    """W at step t: written out here for the ring and the torus. The other topologies'
    `mixing_matrix` is checked against matrices built from their definitions in
    test_topology.py (and against their ppermute schedules there)."""
    return WRITTEN_OUT.get(repr(topology), topology.mixing_matrix(t))


TOPOLOGIES = [
    lpdec.ring(N),
    lpdec.torus(2, 4),
    lpdec.exponential(N),
    lpdec.one_peer_exponential(N),
    lpdec.random_matching(N, seed=3),
]


@pytest.mark.parametrize("mode", harness.MODES)
@pytest.mark.parametrize("topology", TOPOLOGIES, ids=repr)
def test_dpsgd_matches_dense_simulation(rng, mode, topology):
    x0, grads = problem(rng)
    tx = optax.chain(optax.sgd(LR), lpdec.dpsgd(topology))
    params, _, _ = harness.run(tx, {"w": x0}, T, updates={"w": grads}, mode=mode)
    x = x0.astype(np.float64)
    for t in range(T):
        x = mixing(topology, t) @ x - LR * grads[:, t]
        np.testing.assert_allclose(np.asarray(params["w"])[:, t], x, atol=2e-5, rtol=0)


def test_dpsgd_with_more_nodes_than_devices(rng):
    """16 nodes on 8 devices (vmap nested in shard_map) against the dense simulation."""
    topology = lpdec.ring(16)
    x0, grads = problem(rng, n=16)
    tx = optax.chain(optax.sgd(LR), lpdec.dpsgd(topology, axis_name=harness.NESTED_AXIS))
    params, _, _ = harness.run(tx, {"w": x0}, T, updates={"w": grads}, mode="nested")
    x = x0.astype(np.float64)
    w = ring_w(16)
    for t in range(T):
        x = w @ x - LR * grads[:, t]
    np.testing.assert_allclose(np.asarray(params["w"])[:, -1], x, atol=2e-5, rtol=0)


@pytest.mark.parametrize(
    "make",
    [
        lambda topo: lpdec.dpsgd(topo),
    ],
    ids=["dpsgd"],
)
def test_zero_updates_preserve_the_node_average(rng, make):
    check_zero_updates_preserve_the_node_average(rng, make)


@pytest.mark.parametrize("mode", harness.MODES)
def test_a_nan_update_is_dropped_on_its_node_and_never_reaches_neighbours(rng, mode):
    topology = lpdec.ring(N)
    x0, grads = problem(rng)
    grads[3, 5, 7] = np.nan
    tx = lpdec.dpsgd(topology)
    chain = optax.chain(optax.sgd(LR), tx)
    params, states, _ = harness.run(chain, {"w": x0}, T, updates={"w": grads}, mode=mode)
    assert np.isfinite(np.asarray(params["w"])).all()
    counts = np.asarray(states[1].health.nonfinite_updates)[:, -1]
    np.testing.assert_array_equal(counts, [0, 0, 0, 1, 0, 0, 0, 0])


def test_dpsgd_rejects_bad_arguments():
    with pytest.raises(TypeError, match="Topology"):
        lpdec.dpsgd(np.eye(8))


def test_topology_size_must_match_the_axis():
    tx = optax.chain(optax.sgd(LR), lpdec.dpsgd(lpdec.ring(4)))
    with pytest.raises(ValueError, match="ring\\(4\\) has 4 nodes"):
        harness.run(tx, {"w": np.zeros((8, 3), np.float32)}, 1, updates={"w": np.zeros((8, 1, 3))})
