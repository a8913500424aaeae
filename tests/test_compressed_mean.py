"""DCD-PSGD, quasi-global momentum, compressed and local means against independent references.

Each reference is written from the papers' formulas with an explicit mixing
matrix in numpy (float64 unless a check is bit for bit, where it follows the
float32 operations the docstrings specify).
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_references import base_key
from test_references import leaf_keys
from test_references import np_round_trip

import lpdec
from lpdec import gossip
from lpdec import testing as harness
from lpdec.algorithms.compressed_mean import compressed_mean
from lpdec.algorithms.dcd import dcd
from lpdec.algorithms.dpsgd import dpsgd
from lpdec.algorithms.local_mean import local_mean
from lpdec.algorithms.qg_momentum import qg_momentum
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


# ----------------------------------------------------------------------------
# DCD-PSGD
# ----------------------------------------------------------------------------

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


# ----------------------------------------------------------------------------
# Quasi-global momentum
# ----------------------------------------------------------------------------


def _qgm_reference(x0, grads, w, lr, beta, nesterov):
    """QG-DSGDm (Lin et al. 2021, Alg. 1) with D-PSGD's gossip, numpy float64.

    x0: [n, d]; grads: [n, T, d]. Returns the params and m_hat after each step.
    """
    x, m_hat = x0.astype(np.float64), np.zeros(x0.shape)
    x_prev, lr_prev = None, 0.0
    xs, m_hats = [], []
    for t in range(grads.shape[1]):
        g = grads[:, t].astype(np.float64)
        if t > 0 and lr_prev != 0:
            m_hat = beta * m_hat + (1 - beta) * (x_prev - x) / lr_prev
        m = g + beta * m_hat
        update = -lr(t) * (g + beta * m if nesterov else m)
        x_prev, lr_prev = x, lr(t)
        x = w @ x + update  # D-PSGD: x+ = sum_j W_ij x_j + u
        xs.append(x)
        m_hats.append(m_hat)
    return np.stack(xs, 1), np.stack(m_hats, 1)


WARMUP = optax.linear_schedule(0.0, 0.1, 5)


@pytest.mark.parametrize(
    "nesterov, schedule, mode",
    [
        (False, "constant", "shard_map"),
        (True, "constant", "vmap"),
        (False, "warmup", "vmap"),
        (True, "warmup", "shard_map"),
    ],
)
def test_qg_momentum_matches_paper_formulas(nesterov, schedule, mode, rng):
    steps, beta, topo = 25, 0.9, ring(N)
    learning_rate = 0.05 if schedule == "constant" else WARMUP
    lr = (lambda t: 0.05) if schedule == "constant" else (lambda t: float(WARMUP(t)))
    params0 = {"v": rng.standard_normal((N, 6)).astype(np.float32)}
    grads = {"v": rng.standard_normal((N, steps, 6)).astype(np.float32)}
    tx = optax.chain(
        qg_momentum(learning_rate, momentum=beta, nesterov=nesterov), dpsgd(topo, axis_name=AXIS)
    )
    ps, ss, _ = harness.run(tx, params0, steps, updates=grads, mode=mode)
    xs, m_hats = _qgm_reference(params0["v"], grads["v"], topo.mixing_matrix(), lr, beta, nesterov)
    np.testing.assert_allclose(ps["v"], xs, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ss[0].m_hat["v"], m_hats, rtol=1e-4, atol=1e-4)
    # The buffer is quasi-global: it is not plain local momentum of the gradients.
    assert np.abs(m_hats[:, -1]).max() > 0.1


def test_qg_momentum_under_inject_hyperparams_matches_fixed_hyperparameters():
    tx = optax.inject_hyperparams(qg_momentum)(learning_rate=0.05, momentum=0.8)
    reference = qg_momentum(0.05, momentum=0.8)
    params = {"v": jnp.arange(4.0)}
    state, ref_state = tx.init(params), reference.init(params)
    for t in range(3):
        grads = {"v": jnp.sin(params["v"] + t)}
        updates, state = tx.update(grads, state, params)
        expected, ref_state = reference.update(grads, ref_state, params)
        np.testing.assert_allclose(updates["v"], expected["v"], rtol=1e-6)
        # A move the optimizer did not make (gossip, say) enters the buffer.
        params = optax.apply_updates(params, {"v": updates["v"] + 0.01})


# ----------------------------------------------------------------------------
# Compressed and local means
# ----------------------------------------------------------------------------


def _run_mean(tx, grads, *, mode, axes=(AXIS,), steps=1):
    """Feeds every device the same gradients `steps` times.

    grads: leaves [*mesh_shape, ...]. Returns numpy (updates [*mesh_shape, steps,
    ...], the last state).
    """
    k = len(axes)

    def program(g):
        if mode == "shard_map":
            g = jax.tree.map(lambda x: x.reshape(x.shape[k:]), g)

        def body(state, _):
            u, state = tx.update(g, state)
            return state, u

        state, us = jax.lax.scan(body, tx.init(g), length=steps)
        out = gossip.to_varying((us, state), axes)
        if mode == "shard_map":
            out = jax.tree.map(lambda x: x.reshape((1,) * k + x.shape), out)
        return out

    if mode == "vmap":
        fn = program
        for name in reversed(axes):
            fn = jax.vmap(fn, axis_name=name)
        return harness.to_numpy(jax.jit(fn)(grads))
    mesh = jax.make_mesh(jax.tree.leaves(grads)[0].shape[:k], axes)
    spec = jax.P(*axes)
    fn = lpdec.layout.shard_map(program, mesh=mesh, in_specs=spec, out_specs=spec)
    return harness.to_numpy(jax.jit(fn)(jax.device_put(grads, jax.NamedSharding(mesh, spec))))


def _gradients(rng, n=N):
    """Leaves of awkward sizes (3 < n, empty, bfloat16) and node-dependent scales."""
    scale = rng.uniform(0.5, 3.0, size=(n, 1)).astype(np.float32)
    return {
        "a": (scale * rng.standard_normal((n, 1000)) + 1.0).astype(np.float32),
        "b": (scale[:, :, None] * rng.standard_normal((n, 5, 3))).astype(np.float32),
        "c": rng.standard_normal((n, 3)).astype(np.float32),
        "d": jnp.asarray(rng.standard_normal((n, 11)), jnp.bfloat16),
        "e": np.zeros((n, 0), np.float32),
    }


@pytest.mark.parametrize("mode", harness.MODES)
def test_compressed_mean_identity_is_the_exact_mean(mode, rng):
    grads = _gradients(rng)
    means, state = _run_mean(compressed_mean(lpdec.identity()), grads, mode=mode)
    for name, g in grads.items():
        assert means[name].dtype == g.dtype
        exact = np.asarray(g, np.float64).mean(axis=0)
        tol = 1e-2 if name == "d" else 1e-6
        got = means[name][:, 0].astype(np.float64)
        np.testing.assert_allclose(got, np.broadcast_to(exact, got.shape), atol=tol)
    assert not np.any(state.health.nonfinite_received)


def _quantization_steps(g):
    """The min-max 8-bit steps each element of the compressed mean of g goes through.

    g: [n, d] float64, the whole update of each node as one vector (its leaves
    concatenated). Element e lies in chunk c = e // ceil(d / n), which node
    j != c quantizes in round 1 with step u1[j, e] = range_j(chunk c) / 255 (the
    owner c adds its own chunk exactly: u1[c, e] = 0). Round 2 quantizes the
    round-1 average, whose range is at most r[e] (the exact mean's range over
    the chunk) plus twice the round-1 error.

    Returns:
      (u1 [n, d], r [d]).
    """
    n, d = g.shape
    size = -(-d // n)
    exact = g.mean(axis=0)
    u1, r = np.zeros((n, d)), np.zeros(d)
    for c in range(n):
        part = slice(c * size, min((c + 1) * size, d))
        u1[:, part] = np.ptp(g[:, part], axis=1, keepdims=True) / 255
        u1[c, part] = 0.0
        r[part] = np.ptp(exact[part])
    return u1, r


def test_compressed_mean_minmax_nearest_error_is_within_the_two_round_bound(rng):
    grads = {"a": _gradients(rng)["a"], "z": rng.standard_normal((N, 5003)).astype(np.float32)}
    means, _ = _run_mean(compressed_mean(lpdec.minmax(8, "nearest")), grads, mode="shard_map")
    # The leaves travel as one vector, in the tree's order, cut into N chunks.
    whole = np.concatenate([np.asarray(grads[name], np.float64) for name in ("a", "z")], axis=1)
    # Rounding to nearest errs by at most half a step, in each round.
    u1, r = _quantization_steps(whole)
    e1 = u1.sum(axis=0) / (2 * N)
    bounds = np.split(e1 + (r + 2 * e1) / 255 / 2 + 1e-6 * np.abs(whole).max(), [1000])
    for name, bound in zip(("a", "z"), bounds, strict=True):
        g = np.asarray(grads[name], np.float64)
        error = np.abs(means[name][:, 0].astype(np.float64) - g.mean(axis=0))
        assert np.all(error <= bound), f"{name}: worst error / bound {np.max(error / bound)}"
        # Compression did happen: the error reaches a fair part of the bound.
        assert np.max(error / bound) > 0.2
        # Every node holds the same bits.
        assert np.all(means[name][:, 0] == means[name][0, 0])


def test_compressed_mean_stochastic_rounding_is_unbiased(rng):
    draws = 400
    grads = {"a": _gradients(rng)["a"]}
    tx = compressed_mean(lpdec.minmax(8, "stochastic"), seed=int(rng.integers(1 << 30)))
    means, _ = _run_mean(tx, grads, mode="vmap", steps=draws)
    g = np.asarray(grads["a"], np.float64)
    exact = g.mean(axis=0)
    samples = means["a"][0].astype(np.float64)
    # Stochastic rounding with step u errs by less than u, with variance <= u^2 / 4.
    u1, r = _quantization_steps(g)
    u2 = (r + 2 * u1.sum(axis=0) / N) / 255
    variance = (u1**2).sum(axis=0) / N**2 / 4 + u2**2 / 4
    error = np.abs(samples.mean(axis=0) - exact)
    sigma = np.sqrt(variance / draws)
    assert np.all(error <= 6 * sigma + 1e-6), f"worst error / sigma {np.max(error / sigma)}"
    # Single draws do err: the average is better than any one of them by far.
    assert np.abs(samples[0] - exact).max() > 10 * error.max()


def _np_two_level_mean(g, quantize, n_nodes, local):
    """Seed 004 in numpy: intra-node average, two-round compressed exchange, broadcast.

    g: [nodes, local, d] float32; quantize: float32 vector -> decode(encode(.)).
    The intra-node average is split into `local` shards (shard l handled by local
    rank l, edge-padded); each shard runs seed 001's two rounds between the nodes.
    """
    d = g.shape[-1]
    node_avg = g.astype(np.float32).sum(axis=1) / np.float32(local)
    m = -(-d // local)
    padded = np.concatenate([node_avg, np.repeat(node_avg[:, -1:], m * local - d, axis=1)], 1)
    out = []
    for shard in range(local):
        v = padded[:, shard * m : (shard + 1) * m]
        size = -(-m // n_nodes)
        v = np.concatenate([v, np.repeat(v[:, -1:], size * n_nodes - m, axis=1)], 1)
        chunks = []
        for c in range(n_nodes):
            own = v[c, c * size : (c + 1) * size]
            total = own.copy()
            for j in range(n_nodes):
                if j != c:
                    total = total + quantize(v[j, c * size : (c + 1) * size])
            chunks.append(quantize(total / np.float32(n_nodes)))
        out.append(np.concatenate(chunks)[:m])
    return np.concatenate(out)[:d]


@pytest.mark.parametrize("mode", harness.MODES)
def test_hierarchical_compressed_mean_matches_numpy_simulation(mode, rng):
    nodes, local = 2, 4
    comp = lpdec.minmax(8, "nearest")
    # Multiples of 1/64: the intra-node averages are exact in float32.
    g = rng.integers(-256, 256, size=(nodes, local, 999)).astype(np.float32) / 64
    g[1] *= 3
    tx = compressed_mean(comp, axis_name="nodes", local_axis="local")
    means, state = _run_mean(tx, {"g": g}, mode=mode, axes=("nodes", "local"))
    expected = _np_two_level_mean(g, lambda v: np_round_trip(comp, v), nodes, local)
    got = np.asarray(means["g"])[:, :, 0]
    np.testing.assert_allclose(got, np.broadcast_to(expected, got.shape), rtol=0, atol=1e-6)
    # Quantization mattered: the exact mean is further away than the tolerance.
    assert np.abs(expected - g.mean(axis=(0, 1))).max() > 1e-3
    assert not np.any(state.health.nonfinite_received)


def _collectives_in(hlo):
    ops = ("all-reduce", "all-to-all", "all-gather", "reduce-scatter", "collective-permute")
    return [
        line
        for line in hlo.splitlines()
        if any(f" {op}(" in line or f"{op}-start(" in line for op in ops)
    ]


def _replica_groups(line):
    """The device groups of a collective in compiled HLO, in either notation XLA prints:
    lists (`replica_groups={{0,4},{1,5}}`, jax 0.10 and 0.11) or mesh axes
    (`replica_groups=mesh['nodes'=2,'local'=4] {'nodes'}`, jax 0.12: the groups run
    over the named axes of a row-major mesh of device ids)."""
    if lists := re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", line):
        groups = re.findall(r"\{([\d,]*)\}", lists.group(1))
        return [[int(v) for v in group.split(",")] for group in groups]
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", line)
    assert mesh, f"no replica groups in {line}"
    sizes = {name: int(size) for name, size in re.findall(r"'(\w+)'=(\d+)", mesh.group(1))}
    over = re.findall(r"'(\w+)'", mesh.group(2))
    names = list(sizes)
    order = [names.index(n) for n in names if n not in over] + [names.index(n) for n in over]
    ids = np.arange(math.prod(sizes.values())).reshape(tuple(sizes.values()))
    return ids.transpose(order).reshape(-1, math.prod(sizes[n] for n in over)).tolist()


@pytest.mark.parametrize(
    "notation, groups",
    [
        ("replica_groups={{0,1,2,3,4,5,6,7}}, dim", [[0, 1, 2, 3, 4, 5, 6, 7]]),
        ("replica_groups={{0,4},{1,5},{2,6},{3,7}}, dim", [[0, 4], [1, 5], [2, 6], [3, 7]]),
        ("replica_groups=mesh['nodes'=8] {'nodes'}, dim", [[0, 1, 2, 3, 4, 5, 6, 7]]),
        ("replica_groups=mesh['nodes'=2,'local'=4] {'nodes'}, m", [[0, 4], [1, 5], [2, 6], [3, 7]]),
        ("replica_groups=mesh['nodes'=2,'local'=4] {'local'}, m", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ],
)
def test_replica_groups_reads_both_notations(notation, groups):
    assert _replica_groups(notation) == groups


@pytest.mark.parametrize(
    "shape, axes, node_groups",
    [
        ((N,), (AXIS,), [[0, 1, 2, 3, 4, 5, 6, 7]]),
        ((2, 4), ("nodes", "local"), [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ],
)
def test_compressed_mean_compiles_to_uint8_exchanges_without_all_reduce(shape, axes, node_groups):
    local_axis = axes[1] if len(axes) == 2 else None
    tx = compressed_mean(lpdec.minmax(8, "nearest"), axis_name=axes[0], local_axis=local_axis)
    mesh = jax.make_mesh(shape, axes)
    spec = jax.P(*axes)

    def program(g):
        g = g.reshape(g.shape[len(axes) :])
        out, _ = tx.update(g, tx.init(g))
        return out.reshape((1,) * len(axes) + out.shape)

    g = jax.device_put(jnp.ones(shape + (4096,), jnp.float32), jax.NamedSharding(mesh, spec))
    fn = lpdec.layout.shard_map(program, mesh=mesh, in_specs=spec, out_specs=spec)
    lines = _collectives_in(jax.jit(fn).lower(g).compile().as_text())
    assert lines and not [line for line in lines if "all-reduce" in line], lines
    across = [line for line in lines if _replica_groups(line) == node_groups]
    for op in ("all-to-all", "all-gather"):
        assert any(op in line and "u8[" in line for line in across), (op, lines)
    # Between nodes float32 travels only as the per-chunk (lo, unit) scales.
    for line in across:
        for dims in re.findall(r"f32\[([\d,]*)\]", line):
            assert math.prod(int(v) for v in dims.split(",") if v) <= shape[0], line
    if local_axis is not None:
        within = [line for line in lines if _replica_groups(line) == [[0, 1, 2, 3], [4, 5, 6, 7]]]
        for op in ("reduce-scatter", "all-gather"):
            assert any(op in line and "f32[" in line for line in within), (op, lines)


def _count_collectives(hlo):
    ops = ("all-reduce", "all-to-all", "all-gather", "reduce-scatter", "collective-permute")
    counts = {}
    for line in _collectives_in(hlo):
        op = next(op for op in ops if f" {op}(" in line or f"{op}-start(" in line)
        counts[op] = counts.get(op, 0) + 1
    return counts


@pytest.mark.parametrize("leaves, error_feedback", [(1, False), (6, False), (6, True)])
@pytest.mark.parametrize(
    "shape, axes, expected",
    [
        ((N,), (AXIS,), {"all-to-all": 1, "all-gather": 1}),
        # Within a machine: one reduce-scatter before, one all-gather after.
        ((2, 4), ("nodes", "local"), {"all-to-all": 1, "all-gather": 2, "reduce-scatter": 1}),
    ],
)
def test_compressed_mean_issues_one_collective_per_round_for_the_whole_model(
    leaves, error_feedback, shape, axes, expected
):
    local_axis = axes[1] if len(axes) == 2 else None
    tx = compressed_mean(
        lpdec.minmax(8, "nearest"),
        axis_name=axes[0],
        local_axis=local_axis,
        error_feedback=error_feedback,
    )
    mesh = jax.make_mesh(shape, axes)
    spec = jax.P(*axes)
    k = len(axes)
    model = [
        ((4096,), jnp.float32),
        ((37,), jnp.float32),
        ((5, 3), jnp.bfloat16),
        ((11,), jnp.float32),
        ((0,), jnp.float32),
        ((2, 2, 2), jnp.float32),
    ]
    grads = {f"leaf{i}": jnp.ones(shape + s, t) for i, (s, t) in enumerate(model[:leaves])}

    def program(g):
        g = jax.tree.map(lambda x: x.reshape(x.shape[k:]), g)
        out, _ = tx.update(g, tx.init(g))
        return jax.tree.map(lambda x: x.reshape((1,) * k + x.shape), out)

    grads = jax.device_put(grads, jax.NamedSharding(mesh, spec))
    fn = lpdec.layout.shard_map(program, mesh=mesh, in_specs=spec, out_specs=spec)
    hlo = jax.jit(fn).lower(grads).compile().as_text()
    assert _count_collectives(hlo) == expected


@pytest.mark.parametrize("mode", harness.MODES)
def test_compressed_mean_drops_a_nonfinite_node(mode, rng):
    bad = 5
    grads = _gradients(rng)
    grads["a"][bad, 17] = np.nan
    means, state = _run_mean(compressed_mean(lpdec.identity()), grads, mode=mode)
    exact = np.delete(np.asarray(grads["a"], np.float64), bad, axis=0).mean(axis=0)
    np.testing.assert_allclose(
        np.asarray(means["a"])[:, 0], np.broadcast_to(exact, (N, 1000)), atol=1e-6
    )
    np.testing.assert_array_equal(state.health.nonfinite_updates, np.eye(N, dtype=int)[bad])
    # The leaves travel as one vector: every chunk owner but `bad` dropped the one chunk
    # `bad` sent it; `bad` itself averaged the others' copies of its own chunk.
    np.testing.assert_array_equal(state.health.nonfinite_received, 1 - np.eye(N, dtype=int)[bad])


def test_local_mean_averages_finite_updates(rng):
    bad = 2
    grads = _gradients(rng)
    means, state = _run_mean(local_mean(axis_name=AXIS), grads, mode="vmap")
    for name, g in grads.items():
        tol = 1e-2 if name == "d" else 1e-6
        exact = np.asarray(g, np.float64).mean(axis=0)
        np.testing.assert_allclose(
            np.asarray(means[name][:, 0], np.float64),
            np.broadcast_to(exact, (N,) + exact.shape),
            atol=tol,
        )
    grads["c"][bad, 0] = np.inf
    means, state = _run_mean(local_mean(axis_name=AXIS), grads, mode="shard_map")
    exact = np.delete(np.asarray(grads["a"], np.float64), bad, axis=0).mean(axis=0)
    np.testing.assert_allclose(
        np.asarray(means["a"])[:, 0], np.broadcast_to(exact, (N, 1000)), atol=1e-6
    )
    np.testing.assert_array_equal(state.health.nonfinite_updates, np.eye(N, dtype=int)[bad])
    np.testing.assert_array_equal(state.health.nonfinite_received, 1 - np.eye(N, dtype=int)[bad])


# ----------------------------------------------------------------------------
# Bad inputs
# ----------------------------------------------------------------------------


def test_bad_inputs_raise_clear_errors():
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

    for momentum in (-0.1, 1.0, True, "0.9"):
        with pytest.raises(ValueError, match="momentum"):
            qg_momentum(0.1, momentum=momentum)
    for lr in (-0.1, float("nan"), "0.1"):
        with pytest.raises(ValueError, match="learning_rate"):
            qg_momentum(lr)
    with pytest.raises(TypeError, match="nesterov"):
        qg_momentum(0.1, nesterov="yes")
    qgm = qg_momentum(0.1)
    with pytest.raises(ValueError, match="needs the current parameters"):
        qgm.update({"v": jnp.ones(4)}, qgm.init({"v": jnp.ones(4)}))

    with pytest.raises(ValueError, match="modulo"):
        compressed_mean(lpdec.modulo(8))
    with pytest.raises(TypeError, match="compressor"):
        compressed_mean("minmax")
    with pytest.raises(ValueError, match="local_axis"):
        compressed_mean(comp, axis_name="nodes", local_axis="nodes")
    with pytest.raises(ValueError, match="with local_axis, axis_name must be one axis name"):
        compressed_mean(comp, axis_name=("machines", "workers"), local_axis="local")
    for bad in (("nodes", "nodes"), (), ("nodes", 1), ["nodes"], 3):
        with pytest.raises(TypeError, match="compressed_mean: axis_name must be an axis name"):
            compressed_mean(comp, axis_name=bad)
        with pytest.raises(TypeError, match="local_mean: axis_name must be an axis name"):
            local_mean(axis_name=bad)
    cm = compressed_mean(comp)
    with pytest.raises(ValueError, match="not bound here"):
        cm.update({"v": jnp.ones(4)}, cm.init({"v": jnp.ones(4)}))
    lm = local_mean(axis_name="local")
    with pytest.raises(ValueError, match="not bound here"):
        jax.vmap(lambda g: lm.update(g, lm.init(g)), axis_name=AXIS)(params)
