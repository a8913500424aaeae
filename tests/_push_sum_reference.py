"""What tests/test_deepsqueeze.py, tests/test_sparse_push.py and tests/test_quant_sgp.py share:
the graphs, the float64 references of Deep-Squeeze, Sparse-Push and Quant-SGP, the runs
they read, and the checks every one of the three goes through.

Every check recomputes what the algorithm should have done from the explicit
mixing matrix (`Topology.mixing_matrix` of the matrices written out below, and of
`one_peer_exponential`, which test_topology.py checks against its definition),
never from lpdec's gossip code:
step by step from the implementation's own state (so compression need not be
re-simulated), free-running without compression, through invariants (the mass
sum_i x_i and sum_i w_i that push-sum must keep), and against D-PSGD on a
directed graph whose plain gossip is biased.

The directed graph with unequal out-degrees only runs under shard_map: its
edge classes are partial permutations, which `jax.vmap`'s ppermute rule
rejects ("Permutation doesn't match the axis size!"). The push-sum
step-by-step checks, which run in both modes, use column- but not
row-stochastic matrices whose edge classes are full permutations (every node
keeps a different share).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_references import base_key
from test_references import leaf_keys
from test_references import np_round_trip

import lpdec
from lpdec import topology
from lpdec.algorithms import deepsqueeze
from lpdec.algorithms import dpsgd
from lpdec.algorithms import quant_sgp
from lpdec.algorithms import sparse_push
from lpdec.testing import run
from lpdec.testing import to_numpy

N = 8


STEPS = 20


SHAPES = {"a": (24,), "b": (4, 5)}  # two leaves: one key each, top-k per leaf


GAMMA = 0.8


COMPRESSORS = {
    "identity": lpdec.identity(),
    "minmax8_stochastic": lpdec.minmax(bits=8, rounding="stochastic"),
    "top_k": lpdec.top_k(0.3),
}


def skewed_adjacency() -> np.ndarray:
    """A[i, j] = 1 if j sends to i (self-loops included): a ring plus chords, out-degrees 1-3."""
    a = np.eye(N)
    for i in range(N):
        a[(i + 1) % N, i] = 1
    for s, d in [(0, 2), (0, 4), (3, 6), (5, 1), (5, 7)]:
        a[d, s] = 1
    return a


def skewed_column() -> np.ndarray:
    """Each node j splits its mass equally among itself and its out-neighbours: 1/(outdeg_j + 1)."""
    a = skewed_adjacency()
    return a / a.sum(axis=0, keepdims=True)


def skewed_row() -> np.ndarray:
    """Each node averages itself and its in-neighbours uniformly (what plain gossip would use)."""
    a = skewed_adjacency()
    return a / a.sum(axis=1, keepdims=True)


def weighted_shifts(shifts, keep, first) -> np.ndarray:
    """Node j keeps keep[j], sends first[j] of the rest to j + shifts[0] and the remainder to
    j + shifts[1]: column stochastic, not row stochastic, each shift a full permutation."""
    w = np.diag(np.asarray(keep, np.float64))
    for j in range(N):
        rest = 1.0 - keep[j]
        w[(j + shifts[0]) % N, j] = first[j] * rest
        w[(j + shifts[1]) % N, j] = (1.0 - first[j]) * rest
    return w


WEIGHTED_0 = weighted_shifts(
    (1, 3), [0.3, 0.5, 0.7, 0.4, 0.6, 0.2, 0.8, 0.5], [0.6, 0.3, 0.5, 0.8, 0.4, 0.7, 0.5, 0.2]
)


WEIGHTED_1 = weighted_shifts(
    (2, -1), [0.5, 0.4, 0.3, 0.6, 0.2, 0.7, 0.5, 0.4], [0.5, 0.7, 0.2, 0.4, 0.6, 0.3, 0.8, 0.5]
)


def flat(tree, t=None) -> np.ndarray:
    """float64 [n, D]: every leaf (at step t of a [n, T, ...] tree) flattened per node."""
    leaves = jax.tree.leaves(tree)
    if t is not None:
        leaves = [x[:, t] for x in leaves]
    return np.concatenate([np.asarray(x, np.float64).reshape(N, -1) for x in leaves], axis=1)


def fields(name: str, params, state) -> dict:
    """The float state an algorithm keeps, flattened: what the references read and predict."""
    out = {"params": flat(params)}
    if name == "deepsqueeze":
        out["error"] = flat(state.error)
    else:
        out["x"] = flat(state.x)
        out["push_weight"] = np.asarray(state.push_weight, np.float64)[:, None]
    if name == "sparse_push":
        out["error"] = flat(state.error)
    if name == "quant_sgp":
        out["x_hat"] = flat(state.x_hat)
        out["neighbors"] = flat(state.neighbors)
    return out


def expect_deepsqueeze(prev, new, u, w, gamma):
    x_tilde = prev["params"] + u
    # The decoded message c_i is v_i minus the error the node kept.
    c = x_tilde + prev["error"] - new["error"]
    return {"params": x_tilde + gamma * (w - np.eye(N)) @ c}


def expect_sparse_push(prev, new, u, w, gamma):
    x_tilde = prev["x"] + u
    c = x_tilde + prev["error"] - new["error"]
    x = x_tilde + gamma * (w - np.eye(N)) @ c
    push_weight = prev["push_weight"] + gamma * (w - np.eye(N)) @ prev["push_weight"]
    return {"x": x, "push_weight": push_weight, "params": x / push_weight}


def expect_quant_sgp(prev, new, u, w, gamma):
    x_tilde = prev["x"] + u
    # s_i must equal sum_{j != i} W_ij x^_j of the owners' public copies (checked bit for
    # bit against C separately), and the gossip is the mass-conserving sum_j (W - I)_ij x^_j.
    x = x_tilde + gamma * (w - np.eye(N)) @ new["x_hat"]
    push_weight = prev["push_weight"] + gamma * (w - np.eye(N)) @ prev["push_weight"]
    return {
        "neighbors": (w - np.diag(np.diag(w))) @ new["x_hat"],
        "x": x,
        "push_weight": push_weight,
        "params": x / push_weight,
    }


ALGORITHMS = {
    "deepsqueeze": (deepsqueeze.deepsqueeze, topology.one_peer_exponential(N), expect_deepsqueeze),
    "sparse_push": (
        sparse_push.sparse_push,
        topology.from_matrix([WEIGHTED_0, WEIGHTED_1], name="weighted_shifts_schedule"),
        expect_sparse_push,
    ),
    "quant_sgp": (
        quant_sgp.quant_sgp,
        topology.from_matrix(WEIGHTED_0, name="weighted_shifts"),
        expect_quant_sgp,
    ),
}


def make(name: str, compressor):
    factory, topo, _ = ALGORITHMS[name]
    return factory(topo, compressor, gamma=GAMMA, axis_name="nodes", seed=3)


# One node's update holds a NaN at one step in every step-by-step run: the references
# expect it dropped (a zero update on that node), and the health counters must show it.
BAD_NODE, BAD_STEP = 3, 7


def inputs(seed: int = 0, *, bad_update: bool = True):
    rng = np.random.default_rng(seed)
    params = {k: rng.normal(size=(N, *s)).astype(np.float32) for k, s in SHAPES.items()}
    updates = {
        k: 0.1 * rng.normal(size=(N, STEPS, *s)).astype(np.float32) for k, s in SHAPES.items()
    }
    if bad_update:
        updates["a"][BAD_NODE, BAD_STEP, 5] = np.nan
    return params, updates


def effective_updates(updates, t):
    """The updates of step t as the nodes must apply them: a node whose update is not
    finite (in any leaf) takes no local step."""
    u = jax.tree.map(lambda x: x[:, t], updates)
    ok = np.all([np.isfinite(x).reshape(N, -1).all(axis=1) for x in jax.tree.leaves(u)], axis=0)
    return jax.tree.map(lambda x: np.where(ok.reshape((N,) + (1,) * (x.ndim - 1)), x, 0), u)


@functools.cache
def run_case(name: str, compressor_name: str, mode: str):
    """One harness run per configuration, shared by the tests that read it."""
    params, updates = inputs()
    out = run(make(name, COMPRESSORS[compressor_name]), params, STEPS, updates=updates, mode=mode)
    return params, updates, *to_numpy(out)


def state_at(params0, state0, ps, ss, t):
    """(params, state) after step t; t = -1 is before the first step."""
    if t < 0:
        return params0, state0
    return jax.tree.map(lambda x: x[:, t], ps), jax.tree.map(lambda x: x[:, t], ss)


def round_trip(compressor, tree, step):
    """decode(encode(leaf)) on every node with the key the algorithm must use, in numpy.

    The keys are re-derived from the seed (3, see `make`) and the step counted by the
    test (`test_references.leaf_keys`), and C is computed by `np_round_trip`: neither
    lpdec's key derivation nor its compressors are reused.
    """
    leaves, treedef = jax.tree.flatten(tree)
    keys = leaf_keys(base_key(3), step, num_nodes=N, num_leaves=len(leaves))
    return treedef.unflatten(
        [
            np.stack([np_round_trip(compressor, leaf[i], keys[i, k]) for i in range(N)])
            for k, leaf in enumerate(leaves)
        ]
    )


def compressed_field(name, params, state, u, compressor, count):
    """(field, its exact float32 value after the step) for the buffer that C's output updates."""
    add = functools.partial(jax.tree.map, lambda a, b: np.float32(a) + np.float32(b))
    if name == "quant_sgp":
        diff = jax.tree.map(lambda x, h: x - h, add(state.x, u), state.x_hat)
        q = round_trip(compressor, diff, count)
        return "x_hat", add(state.x_hat, q)
    base = params if name == "deepsqueeze" else state.x
    v = add(add(base, u), state.error)
    c = round_trip(compressor, v, count)
    return "error", jax.tree.map(lambda a, b: np.float32(a) - np.float32(b), v, c)


def check_step(name, compressor_name, mode, step):
    """Step `step` of a run, recomputed from the state before it."""
    params0, updates, ps, ss, state0 = run_case(name, compressor_name, mode)
    _, topo, expect = ALGORITHMS[name]
    params, state = state_at(params0, state0, ps, ss, step - 1)
    new_params, new_state = state_at(params0, state0, ps, ss, step)
    u = effective_updates(updates, step)
    prev, new = fields(name, params, state), fields(name, new_params, new_state)
    for field, want in expect(prev, new, flat(u), topo.mixing_matrix(step), GAMMA).items():
        scale = max(1.0, np.abs(want).max())
        np.testing.assert_allclose(
            new[field], want, rtol=0, atol=1e-5 * scale, err_msg=f"{field}, step {step}"
        )
    # The message is C of exactly what the update rule says, with the node's own key.
    compressor = COMPRESSORS[compressor_name]
    field, want = compressed_field(name, params, state, u, compressor, step)
    got = getattr(new_state, field)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(g, np.asarray(w), err_msg=f"{field}, step {step}")


def simulate(x0, updates, mats, gamma, steps):
    """Push-sum gossip in float64; returns z after each step.

    Without compression all three algorithms are x+ = x~ + gamma (W - I) x~ on the
    biased model and w+ = w + gamma (W - I) w (Deep-Squeeze: c = v = x~ with delta = 0;
    Quant-SGP: x^ = x~ after the step), and for a doubly stochastic W, w stays 1.
    """
    x, w = x0.copy(), np.ones((N, 1))
    out = []
    for t in range(steps):
        mix = mats[t % len(mats)] - np.eye(N)
        x_tilde = x + updates[:, t]
        x = x_tilde + gamma * mix @ x_tilde
        w = w + gamma * mix @ w
        out.append(x / w)
    return np.stack(out, axis=1)


def check_free_running_matches_float64_simulation_without_compression(name):
    """Algorithm `name` with the identity compressor against `simulate`, in float64."""
    params0, updates, ps, _, _ = run_case(name, "identity", "shard_map")
    _, topo, _ = ALGORITHMS[name]
    mats = topology.mixing_matrices(topo)
    u = np.stack([flat(effective_updates(updates, t)) for t in range(STEPS)], axis=1)
    want = simulate(flat(params0), u, mats, GAMMA, STEPS)
    got = np.stack([flat(ps, t) for t in range(STEPS)], axis=1)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())


CONSENSUS_STEPS = 300


PUSH_SUM_GAMMA = 0.8


def perron_vector(w: np.ndarray) -> np.ndarray:
    """pi >= 0 with pi^T W = pi^T, sum 1: row-stochastic gossip settles on sum_i pi_i x_i."""
    values, vectors = np.linalg.eig(w.T)
    pi = np.real(vectors[:, np.argmin(np.abs(values - 1))])
    return pi / pi.sum()


def biased_inputs():
    """Initial models whose pi-weighted average is far from their plain average."""
    rng = np.random.default_rng(1)
    d = sum(int(np.prod(s)) for s in SHAPES.values())
    pi = perron_vector(skewed_row())
    x0 = rng.normal(size=(N, d)) + 4.0 * (N * pi - 1.0)[:, None]
    tree, start = {}, 0
    for k, s in SHAPES.items():
        size = int(np.prod(s))
        tree[k] = x0[:, start : start + size].reshape(N, *s).astype(np.float32)
        start += size
    return tree


@functools.cache
def run_directed(name: str):
    """CONSENSUS_STEPS zero-update steps on the skewed directed graph (shard_map only)."""
    params = biased_inputs()
    zeros = {k: np.zeros((N, CONSENSUS_STEPS, *s), np.float32) for k, s in SHAPES.items()}
    if name == "dpsgd":
        tx = dpsgd.dpsgd(topology.from_matrix(skewed_row(), name="skewed_row"))
    else:
        factory = sparse_push.sparse_push if name == "sparse_push" else quant_sgp.quant_sgp
        tx = factory(
            topology.from_matrix(skewed_column(), name="skewed_column"),
            lpdec.minmax(8),
            gamma=PUSH_SUM_GAMMA,
        )
    ps, ss, _ = to_numpy(run(tx, params, CONSENSUS_STEPS, updates=zeros, mode="shard_map"))
    return params, ps, ss


def check_push_sum_preserves_mass_and_weight_on_a_directed_graph(name):
    """Algorithm `name` keeps sum_i x_i and sum_i w_i on the skewed directed graph."""
    params, _, ss = run_directed(name)
    mass0 = flat(params).sum(axis=0)
    # Float32 rounding only: Quant-SGP's running sum s_i is never re-synchronised with the
    # neighbours' public copies, so its rounding errors random-walk and feed x every step
    # (measured: 3.5e-4 after 300 steps, against 1.2e-5 for Sparse-Push).
    atol = 3e-4 * np.abs(flat(params)).max()
    for t in range(CONSENSUS_STEPS):
        mass = flat(ss.x, t).sum(axis=0)
        np.testing.assert_allclose(mass, mass0, rtol=0, atol=atol, err_msg=f"step {t}")
    np.testing.assert_allclose(ss.push_weight.sum(axis=0), N, rtol=0, atol=1e-5)
    # The weights really are biased by the graph (a no-op would keep them at 1).
    assert np.ptp(ss.push_weight[:, -1]) > 0.1


def check_push_sum_reaches_the_true_average_where_plain_gossip_is_biased(name):
    """Algorithm `name` reaches the mean where D-PSGD settles on the Perron-weighted one."""
    params, dpsgd_ps, _ = run_directed("dpsgd")
    x0 = flat(params)
    mean = x0.mean(axis=0)
    weighted = perron_vector(skewed_row()) @ x0
    margin = np.abs(weighted - mean).min()
    assert margin > 0.2, margin

    # D-PSGD with the row-stochastic W agrees on the Perron-weighted average, not the mean.
    dpsgd_final = flat(dpsgd_ps, CONSENSUS_STEPS - 1)
    np.testing.assert_allclose(dpsgd_final, np.broadcast_to(weighted, x0.shape), atol=1e-4)
    assert (np.abs(dpsgd_final - mean) > 0.5 * margin).all()

    # Push-sum with the column-stochastic W of the same graph reaches the mean on every node.
    _, ps, _ = run_directed(name)
    z = flat(ps, CONSENSUS_STEPS - 1)
    tolerance = {"sparse_push": 0.05, "quant_sgp": 1e-3}[name]
    assert np.abs(z - mean).max() < tolerance < 0.25 * margin, np.abs(z - mean).max()


COLUMN_ONLY = topology.from_matrix(skewed_column(), name="column_only")


ROW_ONLY = topology.from_matrix(skewed_row(), name="row_only")


FACTORIES = {
    "deepsqueeze": deepsqueeze.deepsqueeze,
    "sparse_push": sparse_push.sparse_push,
    "quant_sgp": quant_sgp.quant_sgp,
}


def float_leaves(tree):
    return [x for x in jax.tree.leaves(tree) if np.issubdtype(x.dtype, np.floating)]


def check_non_finite_update_is_dropped_and_counted_on_its_node(name, mode):
    """Algorithm `name` drops BAD_NODE's NaN update at BAD_STEP and counts it there only."""
    _, updates, ps, ss, _ = run_case(name, "minmax8_stochastic", mode)
    assert not np.isfinite(updates["a"][BAD_NODE, BAD_STEP]).all()

    counted = ss.health.nonfinite_updates
    assert (counted[BAD_NODE, BAD_STEP:] == 1).all() and (counted[BAD_NODE, :BAD_STEP] == 0).all()
    assert (np.delete(counted, BAD_NODE, axis=0) == 0).all()
    assert (ss.health.nonfinite_received == 0).all()
    for leaf in float_leaves((ps, ss)):
        assert np.isfinite(leaf).all()
    # Dropped means the node took that step with a zero update (and the others as usual).
    check_step(name, "minmax8_stochastic", mode, BAD_STEP)


def check_non_finite_node_does_not_poison_its_neighbours(name):
    """Algorithm `name` keeps a node with Inf parameters from its neighbours' models."""
    params, updates = inputs(seed=4, bad_update=False)
    params["b"][BAD_NODE, 1, 2] = np.inf
    tx = make(name, COMPRESSORS["top_k"])
    ps, ss, state0 = to_numpy(run(tx, params, STEPS, updates=updates))

    others = [i for i in range(N) if i != BAD_NODE]
    for leaf in float_leaves((ps, ss)):
        assert np.isfinite(leaf[others]).all()
    # Every message the bad node sent was refused by its receiver, and nothing else was.
    _, topo, _ = ALGORITHMS[name]
    sent = sum(len(topo.out_neighbors(BAD_NODE, step=t)) for t in range(STEPS))
    received = ss.health.nonfinite_received[:, -1]
    assert received.sum() == sent
    receivers = {j for t in range(STEPS) for j in topo.out_neighbors(BAD_NODE, step=t)}
    assert all(received[i] == 0 for i in range(N) if i not in receivers)

    # A refused message counts as the receiver's own (Deep-Squeeze's c_i, Sparse-Push's
    # (c_i, w_i)). Quant-SGP's increments are dropped on both ends instead, so the bad
    # node's public copy stays at 0 and its (finite) w_j is still used: plain W.
    _, _, expect = ALGORITHMS[name]
    for step in range(STEPS):
        prev = fields(name, *state_at(params, state0, ps, ss, step - 1))
        new = fields(name, *state_at(params, state0, ps, ss, step))
        for f in (prev, new):  # keep the bad node's Inf/NaN out of the matrix products
            for value in f.values():
                value[~np.isfinite(value)] = 0.0
        w = topo.mixing_matrix(step)
        refused = w.copy()
        for i in others:
            refused[i, i] += refused[i, BAD_NODE]
            refused[i, BAD_NODE] = 0.0
        u = flat(effective_updates(updates, step))
        want = expect(prev, new, u, w if name == "quant_sgp" else refused, GAMMA)
        for field, value in want.items():
            np.testing.assert_allclose(
                new[field][others],
                value[others],
                rtol=0,
                atol=1e-5 * max(1.0, np.abs(value[others]).max()),
                err_msg=f"{field}, step {step}",
            )


# The argument checks every push-sum test file runs for its algorithm (`name`).


def check_gamma_outside_unit_interval_raises(name, gamma):
    with pytest.raises(ValueError, match=rf"{name}: gamma \(the consensus step size\)"):
        FACTORIES[name](topology.directed_ring(N), lpdec.minmax(8), gamma=gamma)


def check_update_without_params_raises(name):
    tx = FACTORIES[name](topology.directed_ring(N), lpdec.minmax(8))
    params = {"a": jnp.zeros((N, 3))}
    with pytest.raises(ValueError, match=f"{name} needs the current parameters"):
        jax.vmap(lambda p: tx.update(p, tx.init(p)), axis_name="nodes")(params)


def check_not_a_compressor_raises(name):
    with pytest.raises(TypeError, match=f"{name} needs an lpdec compressor"):
        FACTORIES[name](topology.directed_ring(N), "minmax")


def check_topology_size_must_match_the_axis(name):
    tx = FACTORIES[name](topology.directed_ring(4), lpdec.minmax(8))

    def one(p):
        return tx.update(p, tx.init(p), p)

    with pytest.raises(ValueError, match="has 4 nodes but the named axis 'nodes' has size 8"):
        jax.vmap(one, axis_name="nodes")(jnp.zeros((N, 3)))
