"""lpdec.nn: 8-bit layers (gradient bifurcation, STE, unbiased layer gradients), the
fp32 mode against flax, and the norms against float64 numpy references."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lpdec.nn import EvoNormS0
from lpdec.nn import QuantConv
from lpdec.nn import QuantDense
from lpdec.nn import RangeBatchNorm
from lpdec.nn import RangeEvoNormS0
from lpdec.nn import fake_quant
from lpdec.nn import int8_matmul
from lpdec.nn import range_constant

LEVELS = 255
# Hoeffding failure probability for the unbiasedness bounds (union over elements).
DELTA = 1e-6


# ----------------------------------------------------------------------------
# Independent references.
# ----------------------------------------------------------------------------


def np_fake_quant(x):
    """Per-tensor min-max, nearest rounding, float64: lo + round((x - lo) / unit) * unit."""
    x = np.asarray(x, np.float64)
    lo = x.min()
    unit = (x.max() - lo) / LEVELS
    return lo + np.round((x - lo) / unit) * unit


def on_grid_values(rng, shape, lo, unit):
    """float32 values within 0.3 units of the grid lo + k unit, k = 0..255, min and max on it.

    Every value's nearest grid point is unambiguous, so the 8-bit forward pass has
    one right answer that a float64 reference reproduces exactly.
    """
    levels = rng.integers(0, LEVELS + 1, size=shape).astype(np.float64)
    levels = np.clip(levels + rng.uniform(-0.3, 0.3, size=shape), 0, LEVELS)
    flat = levels.reshape(-1)
    flat[0], flat[1] = 0.0, LEVELS
    return np.asarray(lo + levels * unit, np.float32)


def conv_reference(x_q, w_q, cotangent):
    """(y, dL/dx_q, dL/dW_q) of the convolution in the conv case, by jax.vjp of lax."""

    def conv(x, w):
        return jax.lax.conv_general_dilated(
            x, w, (2, 2), ((1, 1), (1, 1)), dimension_numbers=("NHWC", "HWIO", "NHWC")
        )

    x_q, w_q = jnp.asarray(x_q, jnp.float32), jnp.asarray(w_q, jnp.float32)
    y, vjp = jax.vjp(conv, x_q, w_q)
    x_bar, w_bar = vjp(jnp.asarray(cotangent, jnp.float32))
    return np.asarray(y, np.float64), np.asarray(x_bar, np.float64), np.asarray(w_bar, np.float64)


def dense_reference(x_q, w_q, cotangent):
    return x_q @ w_q, cotangent @ w_q.T, x_q.T @ cotangent


def make_case(kind, rng):
    """(layer, params, x, cotangent of y, reference) for an int8 dense or conv layer."""
    if kind == "dense":
        layer = QuantDense(7, precision="int8")
        x = on_grid_values(rng, (6, 20), -0.8, 0.01)
        kernel = on_grid_values(rng, (20, 7), -0.05, 0.0004)
        y_shape, reference = (6, 7), dense_reference
    else:
        layer = QuantConv(4, (3, 3), strides=2, padding=1, precision="int8")
        x = on_grid_values(rng, (2, 7, 7, 3), -0.5, 0.006)
        kernel = on_grid_values(rng, (3, 3, 3, 4), -0.2, 0.0015)
        y_shape, reference = (2, 4, 4, 4), conv_reference
    bias = rng.standard_normal(kernel.shape[-1]).astype(np.float32)
    params = {"kernel": jnp.asarray(kernel), "bias": jnp.asarray(bias)}
    cotangent = rng.standard_normal(y_shape).astype(np.float32)
    return layer, params, jnp.asarray(x), cotangent, reference


def layer_grads(layer, params, x, cotangent, key):
    """Gradients of <y, cotangent> w.r.t. the params and the input x."""

    def loss(params, x):
        y = layer.apply({"params": params}, x, rngs={"quant": key})
        return jnp.sum(y * cotangent)

    return jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)


def on_8bit_grid(values):
    """(lo, unit, levels): values relative to their own per-tensor min/max grid."""
    values = np.asarray(values, np.float64)
    lo = values.min()
    unit = (values.max() - lo) / LEVELS
    return lo, unit, (values - lo) / unit


# ----------------------------------------------------------------------------
# Gradient bifurcation.
# ----------------------------------------------------------------------------

KINDS = ["dense", "conv"]


@pytest.mark.parametrize("kind", KINDS)
def test_int8_forward_is_float_op_on_quantized_operands(rng, kind):
    layer, params, x, cotangent, reference = make_case(kind, rng)
    x_q, w_q = np_fake_quant(x), np_fake_quant(params["kernel"])
    y_ref = reference(x_q, w_q, cotangent)[0] + np.asarray(params["bias"], np.float64)
    y = layer.apply({"params": params}, x)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_weight_gradient_is_float_gradient_of_quantized_forward(rng, kind):
    """(a): dW = d<f(x_q, W_q), r>/dW_q in float32, passed straight through to W."""
    layer, params, x, cotangent, reference = make_case(kind, rng)
    grads, _ = layer_grads(layer, params, x, cotangent, jax.random.key(0))
    x_q, w_q = np_fake_quant(x), np_fake_quant(params["kernel"])
    _, _, w_bar = reference(x_q, w_q, cotangent)
    np.testing.assert_allclose(grads["kernel"], w_bar, rtol=1e-5, atol=1e-5)
    bias_bar = cotangent.reshape(-1, cotangent.shape[-1]).sum(0)
    np.testing.assert_allclose(grads["bias"], bias_bar, rtol=1e-5, atol=1e-5)
    # The quantized operands matter: the float gradient on the raw input differs.
    _, _, w_bar_raw = reference(np.asarray(x, np.float64), w_q, cotangent)
    assert np.abs(w_bar_raw - w_bar).max() > 1e-3 * np.abs(w_bar).max()


@pytest.mark.parametrize("kind", KINDS)
def test_layer_gradient_lies_on_8bit_grid(rng, kind):
    """(b): dx = lo + k unit, k integral, at most 256 distinct values."""
    layer, params, x, cotangent, reference = make_case(kind, rng)
    _, x_bar = layer_grads(layer, params, x, cotangent, jax.random.key(1))
    _, unit, levels = on_8bit_grid(x_bar)
    assert unit > 0
    np.testing.assert_allclose(levels, np.round(levels), atol=1e-3)
    distinct = np.unique(np.asarray(x_bar)).size
    assert 16 < distinct <= LEVELS + 1
    # ... and it is not the float32 layer gradient itself.
    x_q, w_q = np_fake_quant(x), np_fake_quant(params["kernel"])
    x_bar_float = reference(x_q, w_q, cotangent)[1]
    assert not np.allclose(x_bar, x_bar_float, rtol=1e-4, atol=1e-4 * unit)


@pytest.mark.parametrize("kind", KINDS)
def test_layer_gradient_rounding_is_unbiased(rng, kind):
    """(c): the mean of dx over K keys approaches the float dx = f'(x_q, W_q)^T r.

    Each element is lo + unit (floor(t) + B), B ~ Bernoulli(frac(t)), with lo and
    unit fixed by the float dx. Hoeffding for K independent draws, with a union
    bound over the N elements: |mean - dx| <= unit sqrt(ln(2N / delta) / (2K)) for
    every element with probability >= 1 - delta; the mean over all N K draws
    has the same bound with N = 1 in the logarithm and N K draws.
    """
    layer, params, x, cotangent, reference = make_case(kind, rng)
    num_keys = 512
    keys = jax.random.split(jax.random.key(int(rng.integers(2**31))), num_keys)
    x_bars = jax.jit(jax.vmap(lambda k: layer_grads(layer, params, x, cotangent, k)[1]))(keys)
    x_q, w_q = np_fake_quant(x), np_fake_quant(params["kernel"])
    x_bar_float = reference(x_q, w_q, cotangent)[1]
    _, unit, _ = on_8bit_grid(x_bar_float)
    n = x_bar_float.size
    # float32 slack: the layer's dx and the reference differ in the last bits.
    slack = 1e-5 * np.abs(x_bar_float).max()
    error = np.asarray(x_bars, np.float64).mean(0) - x_bar_float
    bound = unit * math.sqrt(math.log(2 * n / DELTA) / (2 * num_keys)) + slack
    assert np.abs(error).max() <= bound, (np.abs(error).max(), bound)
    overall = unit * math.sqrt(math.log(2 / DELTA) / (2 * num_keys * n)) + slack
    assert abs(error.mean()) <= overall, (error.mean(), overall)
    # The bound has power: rounding to nearest would violate it.
    assert np.abs(np_fake_quant(x_bar_float) - x_bar_float).max() > bound


def test_int8_matmul_matches_fake_quant_forward(rng):
    """Integer codes with int32 accumulation give QuantDense's int8 forward pass."""
    x = on_grid_values(rng, (3, 4, 300), -1.5, 0.02)
    kernel = on_grid_values(rng, (300, 9), -0.07, 0.0005)
    y_exact = np_fake_quant(x) @ np_fake_quant(kernel)
    y_int = int8_matmul(jnp.asarray(x), jnp.asarray(kernel))
    layer = QuantDense(9, use_bias=False, precision="int8")
    y_fake = layer.apply({"params": {"kernel": jnp.asarray(kernel)}}, jnp.asarray(x))
    scale = np.abs(y_exact).max()
    np.testing.assert_allclose(y_int, y_exact, rtol=0, atol=1e-5 * scale)
    np.testing.assert_allclose(y_fake, y_exact, rtol=0, atol=1e-5 * scale)


def test_differentiating_int8_without_quant_rng_raises():
    layer = QuantDense(3, precision="int8")
    x = jnp.ones((2, 4))
    variables = layer.init(jax.random.key(0), x)
    layer.apply(variables, x)  # the forward pass needs no rng
    with pytest.raises(ValueError, match="quant"):
        jax.grad(lambda v: layer.apply(v, x).sum())(variables)


def test_fake_quant_nearest_and_constant(rng):
    x = on_grid_values(rng, (300,), -3.0, 0.02)
    np.testing.assert_allclose(fake_quant(jnp.asarray(x)), np_fake_quant(x), rtol=0, atol=1e-6)
    constant = jnp.full((5, 3), 0.7, jnp.float32)
    np.testing.assert_array_equal(fake_quant(constant), constant)
    assert not np.isfinite(fake_quant(jnp.array([1.0, np.nan, 2.0]))).any()


# ----------------------------------------------------------------------------
# fp32 mode is flax.
# ----------------------------------------------------------------------------


def assert_same_as_flax(ours, theirs, x):
    variables = jax.jit(ours.init)(jax.random.key(3), x)
    flax_variables = jax.jit(theirs.init)(jax.random.key(3), x)
    assert jax.tree.structure(variables) == jax.tree.structure(flax_variables)
    jax.tree.map(np.testing.assert_array_equal, variables, flax_variables)

    def sum_of_squares(variables, module):
        return jnp.sum(module.apply(variables, x) ** 2)

    output_and_grad = jax.jit(jax.value_and_grad(sum_of_squares), static_argnums=1)
    jax.tree.map(
        np.testing.assert_array_equal,
        output_and_grad(variables, ours),
        output_and_grad(variables, theirs),
    )


@pytest.mark.parametrize("use_bias", [True, False])
def test_fp32_dense_is_flax_dense(rng, use_bias):
    x = jnp.asarray(rng.standard_normal((3, 2, 5)), jnp.float32)
    assert_same_as_flax(QuantDense(6, use_bias=use_bias), nn.Dense(6, use_bias=use_bias), x)


@pytest.mark.parametrize(
    "kwargs, shape",
    [
        (dict(kernel_size=(3, 3)), (2, 6, 6, 3)),
        (dict(kernel_size=(3, 3), strides=2, padding=1, use_bias=False), (2, 7, 7, 3)),
        (dict(kernel_size=(1, 1), strides=2, padding="VALID"), (2, 6, 6, 4)),
        (dict(kernel_size=(3, 3), kernel_dilation=2, feature_group_count=2), (2, 9, 9, 4)),
        (dict(kernel_size=(5,), strides=2), (3, 40, 1)),
        (dict(kernel_size=(3,)), (40, 2)),
    ],
)
def test_fp32_conv_is_flax_conv(rng, kwargs, shape):
    x = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    assert_same_as_flax(QuantConv(4, **kwargs), nn.Conv(4, **kwargs), x)


# ----------------------------------------------------------------------------
# Norms against float64 numpy references of the papers' definitions.
# ----------------------------------------------------------------------------


def np_chunks(size, most=16):
    """Largest number of equal chunks <= most with at least two values each."""
    for c in range(min(most, size // 2), 0, -1):
        if size % c == 0:
            return c
    raise AssertionError(size)


def np_range_sigma(values):
    """C(n) * (mean chunk max - mean chunk min) of a 1-D array (Banner et al.)."""
    c = np_chunks(values.size)
    n = values.size // c
    chunks = values.reshape(c, n)
    spread = chunks.max(1).mean() - chunks.min(1).mean()
    return spread * 0.5 * 0.35 * (1 + math.sqrt(math.pi * math.log(4))) / math.sqrt(2 * math.log(n))


def np_group_stat(x, groups, stat):
    """stat(values of sample b, group g in channel-major order), broadcast per channel."""
    batch, channels = x.shape[0], x.shape[-1]
    per_group = channels // groups
    out = np.empty((batch, channels))
    for b in range(batch):
        for g in range(groups):
            block = x[b, ..., g * per_group : (g + 1) * per_group]
            values = np.moveaxis(block, -1, 0).reshape(-1)
            out[b, g * per_group : (g + 1) * per_group] = stat(values)
    return out.reshape((batch,) + (1,) * (x.ndim - 2) + (channels,))


def np_evonorm(x, gamma, beta, v, groups, eps=1e-5):
    std = np_group_stat(x, groups, lambda values: math.sqrt(values.var() + eps))
    return x / (1 + np.exp(-v * x)) / std * gamma + beta


def np_range_evonorm(x, gamma, beta, v, groups, eps=1e-5):
    sigma = np_group_stat(x, groups, np_range_sigma)
    hard_sigmoid = np.clip((v * x + 3) / 6, 0, 1)
    return x * hard_sigmoid / (sigma + eps) * gamma + beta


def random_norm_params(rng, channels, names=("scale", "bias", "v")):
    return {name: jnp.asarray(rng.uniform(0.5, 1.5, channels), jnp.float32) for name in names}


NORM_SHAPES = [(2, 8, 8, 16), (2, 4, 4, 16), (3, 40, 8), (4, 32), (2, 5, 5, 24)]


@pytest.mark.parametrize("shape", NORM_SHAPES)
@pytest.mark.parametrize(
    "layer, reference", [(EvoNormS0, np_evonorm), (RangeEvoNormS0, np_range_evonorm)]
)
def test_evonorms_match_reference(rng, shape, layer, reference):
    x = rng.standard_normal(shape) * 2.0 + 0.5
    params = random_norm_params(rng, shape[-1])
    y = layer().apply({"params": params}, jnp.asarray(x, jnp.float32))
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    y_ref = reference(x.astype(np.float32).astype(np.float64), p["scale"], p["bias"], p["v"], 8)
    np.testing.assert_allclose(y, y_ref, rtol=2e-5, atol=2e-5)


def np_range_batchnorm_stats(x):
    values = x.reshape(-1, x.shape[-1])
    mean = values.mean(0)
    scale = np.array([1 / (np_range_sigma(values[:, c]) + 1e-5) for c in range(x.shape[-1])])
    return mean, scale


@pytest.mark.parametrize("shape", [(4, 4, 4, 8), (6, 5), (2, 3, 7, 4)])
def test_range_batchnorm_matches_reference(rng, shape):
    x = (rng.standard_normal(shape) * 3.0 - 1.0).astype(np.float32)
    params = random_norm_params(rng, shape[-1], ("scale", "bias"))
    layer = RangeBatchNorm(momentum=0.8)
    variables = layer.init(jax.random.key(0), jnp.asarray(x), use_running_average=False)
    variables = {"params": params, "batch_stats": variables["batch_stats"]}
    y, updates = layer.apply(
        variables, jnp.asarray(x), use_running_average=False, mutable=["batch_stats"]
    )
    gamma, beta = (np.asarray(params[k], np.float64) for k in ("scale", "bias"))
    mean, scale = np_range_batchnorm_stats(x.astype(np.float64))
    np.testing.assert_allclose(y, (x - mean) * scale * gamma + beta, rtol=2e-5, atol=2e-5)
    stats = updates["batch_stats"]
    np.testing.assert_allclose(stats["mean"], 0.2 * mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stats["scale"], 0.8 + 0.2 * scale, rtol=1e-5)
    # Evaluation uses the running averages, not the batch's statistics.
    x_eval = rng.standard_normal(shape).astype(np.float32)
    y_eval = layer.apply(
        {"params": params, "batch_stats": stats}, jnp.asarray(x_eval), use_running_average=True
    )
    ra_mean, ra_scale = (np.asarray(stats[k], np.float64) for k in ("mean", "scale"))
    y_eval_ref = (x_eval - ra_mean) * ra_scale * gamma + beta
    np.testing.assert_allclose(y_eval, y_eval_ref, rtol=2e-5, atol=2e-5)


def test_range_constant_estimates_gaussian_sigma(rng):
    """C(n) * E[range] is a (low-biased) estimate of sigma: 0.75..1 sigma for n >= 8.

    Rows enough that the mean's standard error is at most 0.0015 for every n (n = 8 with
    4000 rows: 0.0034, so 0.01 was 3 standard errors, and failed at seed 1179715673)."""
    for n, expected in [(8, 0.755), (128, 0.900), (2048, 0.955)]:
        samples = rng.standard_normal((max(4000, 2**21 // n), n)) * 3.0
        estimate = range_constant(n) * np.ptp(samples, axis=1).mean() / 3.0
        assert abs(estimate - expected) < 0.01, (n, estimate)


def test_norms_differentiate_finitely(rng):
    x = jnp.asarray(rng.standard_normal((2, 4, 4, 16)), jnp.float32)
    for layer in (EvoNormS0(), RangeEvoNormS0()):
        variables = layer.init(jax.random.key(0), x)
        grads = jax.grad(lambda v, x, m=layer: jnp.sum(m.apply(v, x) ** 2), argnums=(0, 1))(
            variables, x
        )
        assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))


# ----------------------------------------------------------------------------
# Bad arguments.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "build, argument",
    [
        (lambda: QuantDense(3, precision="int4"), "precision"),
        (lambda: QuantConv(3, (3, 3), precision="float32"), "precision"),
        (lambda: QuantDense(3, precision="int8", bits=9), "bits"),
        (lambda: EvoNormS0(groups=0), "groups"),
        (lambda: RangeEvoNormS0(groups=2.5), "groups"),
        (lambda: RangeEvoNormS0(num_chunks=0), "num_chunks"),
        (lambda: RangeBatchNorm(num_chunks=-1), "num_chunks"),
    ],
)
def test_bad_arguments_name_the_argument(build, argument):
    with pytest.raises(ValueError, match=argument):
        build()


@pytest.mark.parametrize("layer", [EvoNormS0(groups=3), RangeEvoNormS0(groups=5)])
def test_groups_must_divide_channels(layer):
    with pytest.raises(ValueError, match="groups"):
        layer.init(jax.random.key(0), jnp.ones((2, 4, 4, 16)))
