"""compressed_mean(rounds=1): SparseLoCo's sparse aggregation, against a numpy reference.

Written from the docstring: node j sends v_j = g_j + beta e_j whole (one all-gather),
every node averages the n decoded payloads Q(v_j) in node order, and node j keeps
e_j = v_j - Q(v_j). Q is the min-max quantizer in float32 numpy of
tests/test_compressed_mean_error_feedback.py (the 223 values are one scale chunk).
"""

import numpy as np
import pytest
from test_compressed_mean_error_feedback import BITS
from test_compressed_mean_error_feedback import D
from test_compressed_mean_error_feedback import N
from test_compressed_mean_error_feedback import _flat
from test_compressed_mean_error_feedback import _gradients
from test_compressed_mean_error_feedback import _minmax_np
from test_compressed_mean_error_feedback import _run

import lpdec
from lpdec import testing as harness


def _np_one_round(g, quantize, beta, feedback=True):
    """T steps over n nodes. g: [n, T, d] float32. Returns (means [T, d], residuals [T, n, d])."""
    e = np.zeros((g.shape[0], g.shape[2]), np.float32)
    means, residuals = [], []
    for t in range(g.shape[1]):
        v = g[:, t] + np.float32(beta) * e if feedback else g[:, t]
        sent = [quantize(v[j]) for j in range(v.shape[0])]
        total = sent[0]
        for row in sent[1:]:
            total = total + row
        means.append(total / np.float32(v.shape[0]))
        e = v - np.stack(sent) if feedback else e
        residuals.append(e)
    return np.stack(means), np.stack(residuals)


@pytest.mark.parametrize("beta", [1.0, 0.9])
@pytest.mark.parametrize("mode", harness.MODES)
def test_each_step_matches_the_numpy_all_gather_with_decayed_error_feedback(mode, beta, rng):
    steps = 5
    grads = _gradients(rng, (N,), steps)
    tx = lpdec.compressed_mean(
        lpdec.minmax(BITS, "nearest"), error_feedback=True, rounds=1, error_decay=beta
    )
    means, residuals, _ = _run(tx, grads, mode=mode)
    expected, expected_residuals = _np_one_round(_flat(grads, 1), _minmax_np, beta)
    got = _flat(means, 1)
    # Every node holds the same mean, the reference's to float32 rounding.
    np.testing.assert_array_equal(got, np.broadcast_to(got[:1], got.shape))
    np.testing.assert_allclose(got[0], expected, rtol=0, atol=1e-5)
    np.testing.assert_allclose(residuals, expected_residuals.transpose(1, 0, 2), rtol=0, atol=1e-5)
    assert residuals.shape == (N, steps, D)
    # Not the two rounds: the mean is not compressed a second time.
    two = lpdec.compressed_mean(lpdec.minmax(BITS, "nearest"), error_feedback=True)
    two_means, _, _ = _run(two, grads, mode=mode)
    assert np.abs(_flat(two_means, 1)[0] - got[0]).max() > 1e-3


def test_without_error_feedback_one_round_is_the_mean_of_the_quantized_updates(rng):
    grads = _gradients(rng, (N,), 2)
    tx = lpdec.compressed_mean(lpdec.minmax(BITS, "nearest"), rounds=1)
    means, _, _ = _run(tx, grads, mode="shard_map")
    expected, _ = _np_one_round(_flat(grads, 1), _minmax_np, 1.0, feedback=False)
    np.testing.assert_allclose(_flat(means, 1)[0], expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(rounds=3), "rounds must be 2 .* or 1"),
        (dict(rounds=True), "rounds must be 2"),
        (dict(error_feedback=True, error_decay=0.0), r"error_decay must be a number in \(0, 1\]"),
        (dict(error_feedback=True, error_decay=1.5), "error_decay must be a number"),
        (dict(error_decay=0.9), "error_decay applies to the error-feedback residual"),
        (dict(error_feedback=True, error_decay=True), "error_decay must be a number"),
    ],
)
def test_bad_rounds_and_decay_are_one_line_errors(kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        lpdec.compressed_mean(lpdec.minmax(8), **kwargs)
    assert "\n" not in str(info.value)


def test_error_decay_can_be_injected_as_a_hyperparameter():
    """optax.inject_hyperparams passes numbers as scalar arrays: the decay still applies."""
    import jax
    import jax.numpy as jnp
    import optax

    kwargs = dict(error_feedback=True, rounds=1, axis_name="i")
    injected = optax.inject_hyperparams(lpdec.compressed_mean)(
        lpdec.minmax(BITS), error_decay=0.5, **kwargs
    )
    plain = lpdec.compressed_mean(lpdec.minmax(BITS), error_decay=0.5, **kwargs)

    def two_steps(tx, g):
        state = tx.init(g)
        _, state = tx.update(g, state)
        return tx.update(g, state)[0]

    g = jnp.asarray(np.random.default_rng(0).normal(size=(4, 9)), jnp.float32)
    a = jax.vmap(lambda x: two_steps(injected, x), axis_name="i")(g)
    b = jax.vmap(lambda x: two_steps(plain, x), axis_name="i")(g)
    np.testing.assert_array_equal(a, b)
