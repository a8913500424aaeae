"""lpdec.algorithms.compressed_mean against numpy references of its two compressed rounds.

Each reference is written from the papers' formulas in numpy (float64 unless a
check is bit for bit, where it follows the float32 operations the docstrings
specify); the collectives are read from the compiled program's HLO. Error
feedback has its own file, tests/test_compressed_mean_error_feedback.py.
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _mean_harness import AXIS
from _mean_harness import N
from _mean_harness import _gradients
from _mean_harness import _run_mean
from test_references import np_round_trip

import lpdec
from lpdec import testing as harness
from lpdec.algorithms.compressed_mean import compressed_mean


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


def test_compressed_mean_bad_inputs_raise_clear_errors():
    comp = lpdec.minmax(8)
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
    cm = compressed_mean(comp)
    with pytest.raises(ValueError, match="not bound here"):
        cm.update({"v": jnp.ones(4)}, cm.init({"v": jnp.ones(4)}))


@pytest.mark.parametrize("rounds", [2, 1])
def test_several_nodes_per_device_give_the_bits_of_one_node_axis(rounds, rng):
    """A vmap axis nested in the shard_map axis (8 nodes simulated on one GPU, say):
    the all-to-all and all-gather run per axis and give the bits of one axis."""
    n = 2 * len(jax.devices())

    def tx(axis):
        return lpdec.compressed_mean(
            lpdec.minmax(4, "stochastic"), axis_name=axis, error_feedback=True, rounds=rounds
        )

    params = {
        "w": rng.standard_normal((n, 1000)).astype(np.float32),
        "b": rng.standard_normal((n, 7)).astype(np.float32),
    }

    def grad_fn(p, node, t):  # every node's gradient differs
        return jax.tree.map(lambda x: jnp.sin(x * (node + 1.0) + t.astype(jnp.float32)), p)

    nested = harness.run(tx(harness.NESTED_AXIS), params, 3, grad_fn=grad_fn, mode="nested")
    one_axis = harness.run(tx(harness.AXIS), params, 3, grad_fn=grad_fn, mode="vmap")
    for got, want in zip(jax.tree.leaves(nested[:2]), jax.tree.leaves(one_axis[:2]), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
