"""compressed_mean(error_feedback=True) against a numpy reference of the two rounds with EF.

The reference is written from the formula in `compressed_mean`'s docstring: node
j sends v_j = g_j + e_j; owner c averages its own chunk of v_c with the others'
Q(v_j[c]) into a_c; everyone receives Q(a_c); the new residual is v_j - Q(v_j[c])
on the chunks j sent to others and n (a_j - Q(a_j)) on its own. Q is a min-max
quantizer written here in float32 numpy, with the float32 operations the
quantizer's docstring specifies, so the reference follows the transform's
arithmetic step after step.
"""

import jax
import numpy as np
import pytest

import lpdec
from lpdec import gossip
from lpdec import testing as harness

N = 8
AXIS = harness.AXIS
BITS = 4
SHAPES = {"a": (30, 7), "b": (13,)}  # d = 223: 8 chunks of 28 (the last padded)
D = sum(int(np.prod(s)) for s in SHAPES.values())


def _minmax_np(x, bits=BITS):
    """Min-max quantization of one chunk (nearest rounding) in float32 numpy."""
    x = x.astype(np.float32)
    lo, hi = x.min(), x.max()
    unit = (hi - lo) * np.float32(1.0 / (2**bits - 1))
    if unit == 0:
        return np.full_like(x, lo)
    codes = np.clip(np.round((x - lo) * (np.float32(1.0) / unit)), 0, 2**bits - 1)
    return (lo + (codes * unit).astype(np.float32)).astype(np.float32)


def _edge_pad(v, multiple):
    """Pads the last axis to a multiple of `multiple` by repeating its last element."""
    extra = -v.shape[-1] % multiple
    return np.concatenate([v, np.repeat(v[..., -1:], extra, axis=-1)], axis=-1)


def _np_two_rounds(v, quantize):
    """One exchange with error feedback: v [n, m] float32 (updates plus residuals).

    Returns:
      (the mean every node receives [m], the new residuals [n, m]).
    """
    n, m = v.shape
    padded = _edge_pad(v, n)
    size = padded.shape[1] // n
    mean, residual = np.zeros_like(padded[0]), np.zeros_like(padded)
    for c in range(n):
        part = slice(c * size, (c + 1) * size)
        sent = [padded[j, part] if j == c else quantize(padded[j, part]) for j in range(n)]
        total = sent[0]
        for row in sent[1:]:
            total = total + row
        a = total / np.float32(n)
        mean[part] = quantize(a)
        for j in range(n):
            residual[j, part] = padded[j, part] - sent[j]
        residual[c, part] = np.float32(n) * (a - mean[part])
    return mean[:m], residual[:, :m]


def _np_flat(g, quantize):
    """T steps over n nodes. g: [n, T, d] float32. Returns (means [T, d], residuals [T, n, d])."""
    e = np.zeros((g.shape[0], g.shape[2]), np.float32)
    means, residuals = [], []
    for t in range(g.shape[1]):
        mean, e = _np_two_rounds(g[:, t] + e, quantize)
        means.append(mean)
        residuals.append(e)
    return np.stack(means), np.stack(residuals)


def _np_hierarchical(g, quantize):
    """T steps over M machines of L workers. g: [M, L, T, d] float32.

    Each step averages a machine's workers, pads the mean to a multiple of L (edge),
    and runs the exchange with EF between the machines on each 1/L shard; worker l
    keeps the residual of shard l. Returns (means [T, d], residuals [T, M, L, m]).
    """
    machines, workers, steps, d = g.shape
    m = -(-d // workers)
    e = np.zeros((machines, workers, m), np.float32)
    means, residuals = [], []
    for t in range(steps):
        total = g[:, 0, t]
        for w in range(1, workers):
            total = total + g[:, w, t]
        shards = _edge_pad(total / np.float32(workers), workers).reshape(machines, workers, m)
        out = []
        for w in range(workers):
            mean, e[:, w] = _np_two_rounds(shards[:, w] + e[:, w], quantize)
            out.append(mean)
        means.append(np.concatenate(out)[:d])
        residuals.append(e.copy())
    return np.stack(means), np.stack(residuals)


def _run(tx, grads, *, mode, axes=(AXIS,)):
    """Step t feeds each device grads[..., t, ...] (leaves [*mesh_shape, T, ...]).

    Returns numpy (updates [*mesh_shape, T, ...], residuals [*mesh_shape, T, m],
    the last state).
    """
    k = len(axes)

    def program(g):
        if mode == "shard_map":
            g = jax.tree.map(lambda x: x.reshape(x.shape[k:]), g)

        def body(state, g_t):
            u, state = tx.update(g_t, state)
            return state, (u, state.residual)

        state, (us, residuals) = jax.lax.scan(body, tx.init(jax.tree.map(lambda x: x[0], g)), g)
        out = gossip.to_varying((us, residuals, state), axes)
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
    fn = jax.shard_map(program, mesh=mesh, in_specs=spec, out_specs=spec)
    return harness.to_numpy(jax.jit(fn)(jax.device_put(grads, jax.NamedSharding(mesh, spec))))


def _gradients(rng, lead, steps):
    """Leaves [*lead, T, ...] with per-device scales, so the chunks' ranges differ."""
    grads = {}
    for k, s in SHAPES.items():
        scale = rng.uniform(0.5, 3.0, size=lead + (1,) * (1 + len(s)))
        grads[k] = (scale * rng.standard_normal(lead + (steps, *s)) + 0.25).astype(np.float32)
    return grads


def _flat(tree, lead):
    """The leaves concatenated in the tree's order: [*lead, T, d]."""
    return np.concatenate([tree[k].reshape(tree[k].shape[: lead + 1] + (-1,)) for k in SHAPES], -1)


@pytest.mark.parametrize("mode", harness.MODES)
def test_each_step_matches_the_numpy_two_rounds_with_error_feedback(mode, rng):
    steps = 6
    grads = _gradients(rng, (N,), steps)
    tx = lpdec.compressed_mean(lpdec.minmax(BITS, "nearest"), error_feedback=True)
    means, residuals, state = _run(tx, grads, mode=mode)
    expected, expected_residuals = _np_flat(_flat(grads, 1), _minmax_np)
    got = _flat(means, 1)
    np.testing.assert_allclose(got, np.broadcast_to(expected, got.shape), rtol=0, atol=1e-5)
    np.testing.assert_allclose(residuals, expected_residuals.transpose(1, 0, 2), rtol=0, atol=1e-5)
    assert residuals.shape == (N, steps, D) and residuals.dtype == np.float32
    # Feedback mattered: from the second step on, the mean is not the one without it.
    no_feedback = [_np_two_rounds(g_t, _minmax_np)[0] for g_t in _flat(grads, 1).swapaxes(0, 1)]
    assert np.abs(expected[1:] - np.stack(no_feedback)[1:]).max() > 1e-2
    assert not np.any(state.health.nonfinite_received)


def test_errors_telescope_and_stay_bounded_with_constant_gradients(rng):
    """sum_t mean_t - sum_t exact_t = mean_j(e_j,0 - e_j,T): the accumulated error is one
    residual's, so the average output converges to the exact mean; without feedback a
    deterministic quantizer errs the same way every step and the average keeps its bias."""
    steps = 50
    one = _gradients(rng, (N,), 1)
    grads = {k: np.repeat(g, steps, axis=1) for k, g in one.items()}
    exact = _flat(one, 1)[:, 0].astype(np.float64).mean(axis=0)
    comp = lpdec.minmax(BITS, "nearest")
    means, residuals, _ = _run(lpdec.compressed_mean(comp, error_feedback=True), grads, mode="vmap")
    got = _flat(means, 1)[0].astype(np.float64)  # [T, d], the same on every node
    drift = got.sum(axis=0) - steps * exact
    np.testing.assert_allclose(
        drift, -residuals[:, -1].astype(np.float64).mean(axis=0), rtol=0, atol=1e-4
    )
    plain, _, _ = _run(lpdec.compressed_mean(comp), grads, mode="vmap")
    plain = _flat(plain, 1)[0].astype(np.float64)
    error_ef = np.abs(got.mean(axis=0) - exact).max()
    error_plain = np.abs(plain.mean(axis=0) - exact).max()
    assert error_plain > 1e-2, error_plain  # 4-bit compression does err
    assert error_ef < error_plain / 10, (error_ef, error_plain)
    # The residuals stay bounded: no larger after 50 steps than after a few.
    assert np.abs(residuals[:, -1]).max() < 2 * np.abs(residuals[:, :5]).max()


@pytest.mark.parametrize("mode", harness.MODES)
def test_hierarchical_error_feedback_matches_numpy_per_shard(mode, rng):
    """2 machines x 4 workers (local_axis): the exchange between machines runs with EF on
    each worker's 1/4 shard of its machine's mean, and worker l keeps that shard's residual."""
    machines, workers, steps = 2, 4, 4
    # Multiples of 1/64: the machines' means are exact in float32 in any order.
    grads = {
        k: (rng.integers(-256, 256, size=(machines, workers, steps, *s)) / 64).astype(np.float32)
        for k, s in SHAPES.items()
    }
    grads["a"][1] *= 3
    tx = lpdec.compressed_mean(
        lpdec.minmax(BITS, "nearest"), axis_name="nodes", local_axis="local", error_feedback=True
    )
    means, residuals, state = _run(tx, grads, mode=mode, axes=("nodes", "local"))
    expected, expected_residuals = _np_hierarchical(_flat(grads, 2), _minmax_np)
    got = _flat(means, 2)
    np.testing.assert_allclose(got, np.broadcast_to(expected, got.shape), rtol=0, atol=1e-5)
    m = -(-D // workers)
    assert residuals.shape == (machines, workers, steps, m)
    np.testing.assert_allclose(
        residuals, expected_residuals.transpose(1, 2, 0, 3), rtol=0, atol=1e-5
    )
    # The telescoping identity, over machines: a machine's residual is its workers' shards.
    exact = _flat(grads, 2).astype(np.float64).mean(axis=(0, 1))  # [T, d]
    last = residuals[:, :, -1].reshape(machines, workers * m)[:, :D].astype(np.float64)
    drift = got[0, 0].astype(np.float64).sum(axis=0) - exact.sum(axis=0)
    np.testing.assert_allclose(drift, -last.mean(axis=0), rtol=0, atol=1e-4)
    assert np.abs(drift).max() > 1e-3  # there was something to feed back
    assert not np.any(state.health.nonfinite_received)


def test_a_nonfinite_update_leaves_its_residual_unchanged(rng):
    bad = 5
    grads = _gradients(rng, (N,), 3)
    grads["b"][bad, 1, 4] = np.nan
    tx = lpdec.compressed_mean(lpdec.minmax(BITS, "nearest"), error_feedback=True)
    means, residuals, state = _run(tx, grads, mode="shard_map")
    np.testing.assert_array_equal(residuals[bad, 1], residuals[bad, 0])
    assert np.abs(residuals[bad, 0]).max() > 0
    others = np.arange(N) != bad
    assert np.all(np.any(residuals[others, 1] != residuals[others, 0], axis=1))
    assert all(np.isfinite(x).all() for x in (means["a"], means["b"], residuals))
    np.testing.assert_array_equal(state.health.nonfinite_updates, np.eye(N, dtype=int)[bad])


def test_without_error_feedback_the_state_holds_no_residual():
    """Off (the default), the state's leaves are those it had before error feedback
    existed, so checkpoints written then still restore."""
    params = {k: np.zeros((N, *s), np.float32) for k, s in SHAPES.items()}
    for error_feedback, residual_shape in ((False, None), (True, (N, D))):
        tx = lpdec.compressed_mean(lpdec.minmax(8), error_feedback=error_feedback)
        state = jax.vmap(tx.init, axis_name=AXIS)(params)
        if residual_shape is None:
            assert state.residual == ()
            # count, key and the health counters: no residual.
            assert len(jax.tree.leaves(state)) == 2 + len(lpdec.Health._fields)
        else:
            assert state.residual.shape == residual_shape
            assert state.residual.dtype == np.float32 and not np.any(state.residual)


def test_error_feedback_must_be_a_bool():
    with pytest.raises(TypeError, match="compressed_mean: error_feedback must be a bool"):
        lpdec.compressed_mean(lpdec.minmax(8), error_feedback="yes")
