"""lpdec.algorithms.dcd (DCD-PSGD) against a dense numpy reference with an explicit W.

The reference is written from the paper's formulas with an explicit mixing
matrix in numpy (float64 unless a check is bit for bit, where it follows the
float32 operations the docstrings specify).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_references import base_key
from test_references import leaf_keys
from test_references import np_round_trip

import lpdec
from lpdec import testing as harness
from lpdec.algorithms.dcd import dcd
from lpdec.topology import from_matrix
from lpdec.topology import one_peer_exponential
from lpdec.topology import ring

N = 8


AXIS = harness.AXIS


def _model(rng, n=N):
    # "w" has 2400 elements: two min-max scale chunks of 2048 and 352.
    return {
        "b": rng.standard_normal((n, 7)).astype(np.float32),
        "w": rng.standard_normal((n, 48, 50)).astype(np.float32),
    }


def _updates(rng, params, steps, scale=0.1):
    return jax.tree.map(
        lambda p: (scale * rng.standard_normal((p.shape[0], steps) + p.shape[1:])).astype(
            np.float32
        ),
        params,
    )


DCD_COMPRESSORS = {
    "minmax8_stochastic": lpdec.minmax(bits=8, rounding="stochastic"),
    "identity": lpdec.identity(),
    "top_k": lpdec.top_k(0.3),
}


def _before(params0, state0, ps, ss, t):
    """(params, state) at the start of step t: the initial ones for t = 0."""
    if t == 0:
        return params0, state0
    return jax.tree.map(lambda x: x[:, t - 1], ps), jax.tree.map(lambda x: x[:, t - 1], ss)


@pytest.mark.parametrize("mode", harness.MODES)
@pytest.mark.parametrize("name", list(DCD_COMPRESSORS))
def test_dcd_each_step_matches_dense_reference(mode, name, rng):
    """Q(z) is recomputed in numpy (`np_round_trip`) with each node's key derived from
    the seed (0, the default) and the step counted here (`leaf_keys`): neither lpdec's
    compressors, nor its key derivation, nor the state's step count drive it. W is
    ring(8)'s, checked against its definition in test_topology.py."""
    comp, topo, steps = DCD_COMPRESSORS[name], ring(N), 20
    w = topo.mixing_matrix()
    params0 = _model(rng)
    updates = _updates(rng, params0, steps)
    ps, ss, state0 = harness.run(dcd(topo, comp), params0, steps, updates=updates, mode=mode)
    u_all = [np.asarray(x) for x in jax.tree.leaves(updates)]
    for t in range(steps):
        params, state = _before(params0, state0, ps, ss, t)
        x = [np.asarray(p) for p in jax.tree.leaves(params)]
        s = [np.asarray(p) for p in jax.tree.leaves(state.neighbors)]
        x_next = [np.asarray(p)[:, t] for p in jax.tree.leaves(ps)]
        s_next = [np.asarray(p)[:, t] for p in jax.tree.leaves(ss.neighbors)]
        q = [np.zeros_like(leaf) for leaf in x]
        np.testing.assert_array_equal(state.count, np.full(N, t))
        keys = leaf_keys(base_key(0), t, num_nodes=N, num_leaves=len(x))
        for i in range(N):
            for k, leaf_key in enumerate(keys[i]):
                # z_i = r_i + u_i in float32 (r_i: the state's consensus residual).
                z = s[k][i] + u_all[k][i, t]
                # The same z from the DCD rule with the explicit W, in float64.
                z64 = (
                    np.tensordot(w[i], x[k].astype(np.float64), axes=1)
                    + u_all[k][i, t]
                    - x[k][i].astype(np.float64)
                )
                np.testing.assert_allclose(z, z64, rtol=0, atol=2e-5)
                q[k][i] = np_round_trip(comp, z, leaf_key)
                # The move x^+ = x + Q(z) with Q(z) = decode(encode(z, key)), bit for bit.
                np.testing.assert_array_equal(x_next[k][i], x[k][i] + q[k][i])
        for k in range(len(x)):
            # r_i^+ = r_i + sum_{j != i} W_ij Q(z_j) - (1 - W_ii) Q(z_i), in float64.
            off = w - np.diag(np.diag(w))
            keep = (1 - np.diag(w)).reshape((N,) + (1,) * (q[k].ndim - 1))
            expected = (
                s[k].astype(np.float64)
                + np.tensordot(off, q[k].astype(np.float64), 1)
                - keep * q[k].astype(np.float64)
            )
            np.testing.assert_allclose(s_next[k], expected, rtol=0, atol=2e-5)
    assert int(np.sum(ss.health.nonfinite_received)) == 0
    assert int(np.sum(ss.health.nonfinite_updates)) == 0


def _birkhoff_topology(rng, *, full_classes):
    """A directed, doubly stochastic W = 0.4 I + 0.35 P + 0.25 P' with random permutations.

    With `full_classes` every edge class is a full permutation; otherwise some
    node receives nothing in some class. (Under vmap, `lax.ppermute` accepts
    only full permutations, so `gossip.exchange` needs them there.)
    """
    while True:
        perms = [np.eye(N)[rng.permutation(N)] for _ in range(2)]
        try:
            topo = from_matrix(0.4 * np.eye(N) + 0.35 * perms[0] + 0.25 * perms[1], name="birkhoff")
        except ValueError:  # not strongly connected
            continue
        full = [len(c.perm) == N for c in topo.rounds[0].edge_classes]
        if all(full) if full_classes else not all(full):
            return topo


@pytest.mark.parametrize("mode", harness.MODES)
def test_dcd_per_peer_replicas_are_their_owners_bit_for_bit(mode, rng):
    topo, steps = _birkhoff_topology(rng, full_classes=mode == "vmap"), 100
    params0 = _model(rng)
    updates = _updates(rng, params0, steps)
    tx = dcd(topo, lpdec.minmax(8, "stochastic"), replicas="per_peer", seed=3)
    ps, ss, state0 = harness.run(tx, params0, steps, updates=updates, mode=mode)
    classes = topo.rounds[0].edge_classes
    assert len(ss.neighbors) == len(classes)
    for c, edge_class in enumerate(classes):
        for leaf_p, leaf_p0, leaf_r, leaf_r0 in zip(
            jax.tree.leaves(ps),
            jax.tree.leaves(params0),
            jax.tree.leaves(ss.neighbors[c]),
            jax.tree.leaves(state0.neighbors[c]),
            strict=True,
        ):
            for i, sender in enumerate(edge_class.senders):
                if sender < 0:
                    assert not np.any(np.asarray(leaf_r)[i]), "a replica of nobody must stay 0"
                    continue
                np.testing.assert_array_equal(np.asarray(leaf_r0)[i], np.asarray(leaf_p0)[sender])
                np.testing.assert_array_equal(np.asarray(leaf_r)[i], np.asarray(leaf_p)[sender])
    # The models did move, and apart from each other.
    w_final = np.asarray(ps["w"])[:, -1]
    assert np.abs(w_final - params0["w"]).max() > 0.1
    assert np.abs(w_final[0] - w_final[1]).max() > 0.01


def test_dcd_sum_mode_tracks_neighbors_from_different_starts(rng):
    topo, steps = _birkhoff_topology(rng, full_classes=False), 100
    w = topo.mixing_matrix()
    params0 = _model(rng)
    updates = _updates(rng, params0, steps)
    tx = dcd(topo, lpdec.minmax(8, "stochastic"))
    ps, ss, state0 = harness.run(tx, params0, steps, updates=updates, mode="shard_map")

    def residual(x):
        """r_i = sum_{j != i} W_ij x_j - (1 - W_ii) x_i = ((W - I) x)_i."""
        x = np.asarray(x, np.float64)
        return np.tensordot(w - np.eye(N), x, 1)

    for leaf_p0, leaf_s0 in zip(
        jax.tree.leaves(params0), jax.tree.leaves(state0.neighbors), strict=True
    ):
        np.testing.assert_allclose(leaf_s0, residual(leaf_p0), rtol=0, atol=1e-6)
    for leaf_p, leaf_s in zip(jax.tree.leaves(ps), jax.tree.leaves(ss.neighbors), strict=True):
        expected = residual(np.asarray(leaf_p)[:, -1])
        np.testing.assert_allclose(np.asarray(leaf_s)[:, -1], expected, rtol=0, atol=2e-5)


def test_dcd_nonfinite_start_and_messages_are_contained(rng):
    topo, steps, bad = ring(N), 10, 3
    params0 = _model(rng)
    params0["b"][bad, 2] = np.nan
    updates = _updates(rng, params0, steps)
    updates["w"][5, 4, 0, 0] = np.inf
    tx = dcd(topo, lpdec.minmax(8, "stochastic"))
    ps, ss, state0 = harness.run(tx, params0, steps, updates=updates, mode="vmap")
    others = [i for i in range(N) if i != bad]
    for leaf in jax.tree.leaves(ps):
        assert np.all(np.isfinite(np.asarray(leaf)[others]))
    # `bad`'s neighbours: one non-finite start at init, then one dropped message from
    # `bad` per step. Node 5's neighbours: its one non-finite update poisons its message
    # that step (the node skips the step: it neither moves nor sends a usable message).
    expected = np.zeros(N, dtype=int)
    expected[[(bad - 1) % N, (bad + 1) % N]] += steps + 1
    expected[[4, 6]] += 1
    received = np.asarray(ss.health.nonfinite_received)[:, -1]
    np.testing.assert_array_equal(received, expected)
    dropped = np.asarray(ss.health.nonfinite_updates)[:, -1]
    # Node 5 skipped one step; `bad` (NaN parameters) cannot send a usable message or
    # move at any step.
    np.testing.assert_array_equal(
        dropped, np.eye(N, dtype=int)[5] + steps * np.eye(N, dtype=int)[bad]
    )


def test_dcd_bad_inputs_raise_clear_errors():
    params = {"v": jnp.ones((N, 4))}
    comp = lpdec.minmax(8)
    with pytest.raises(ValueError, match="static topology"):
        dcd(one_peer_exponential(N), comp)
    row_only = np.array([[0.5, 0.5, 0.0], [0.0, 0.5, 0.5], [0.5, 0.5, 0.0]])
    with pytest.raises(ValueError, match="not doubly stochastic"):
        dcd(from_matrix(row_only), comp)
    with pytest.raises(ValueError, match="replicas"):
        dcd(ring(N), comp, replicas="all")
    with pytest.raises(TypeError, match="compressor"):
        dcd(ring(N), "minmax")
    with pytest.raises(ValueError, match="modulo"):
        dcd(ring(N), lpdec.modulo(8))
    tx = dcd(ring(N), comp)
    with pytest.raises(ValueError, match="not bound here"):
        tx.init({"v": jnp.ones(4)})
    with pytest.raises(ValueError, match="needs the current parameters"):
        jax.vmap(lambda p: tx.update(p, tx.init(p)), axis_name=AXIS)(params)
    with pytest.raises(ValueError, match="has 4 nodes"):
        jax.vmap(dcd(ring(4), comp).init, axis_name=AXIS)(params)
