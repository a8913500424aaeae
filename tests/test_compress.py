"""Compressors: error bounds, unbiasedness, wire bytes, non-finite input, bad arguments,
and behaviour under jit, vmap and shard_map."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_kernels_pallas import np_dequantize
from test_kernels_pallas import np_minmax_quantize
from test_kernels_pallas import np_modulo_encode

import lpdec
from lpdec import compress
from lpdec.kernels_pallas import bitpack

EPS32 = float(np.finfo(np.float32).eps)
SIZES = [1, 7, 1000, 4099]


def per_element(chunk_values, num_elements, chunk):
    """Expands one value per chunk to one value per element."""
    return np.repeat(np.asarray(chunk_values, np.float64), chunk)[:num_elements]


def round_trip(comp, x, key=None, **decode_kwargs):
    payload = comp.encode(x, key)
    return payload, comp.decode(payload, **decode_kwargs)


# ----------------------------------------------------------------------------
# min-max
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("chunk_size", [1, 64, 2048])
def test_minmax_nearest_error_at_most_half_unit(rng, bits, dtype, chunk_size):
    d = 4099
    x = jnp.asarray(rng.standard_normal(d) * rng.uniform(0.01, 10), dtype)
    comp = lpdec.minmax(bits=bits, chunk_size=chunk_size)
    payload, x_hat = round_trip(comp, x)
    assert x_hat.dtype == dtype and x_hat.shape == x.shape
    x64 = np.asarray(x, np.float64)
    err = np.abs(np.asarray(x_hat, np.float64) - x64)
    unit = per_element(payload.unit, d, min(chunk_size, d))
    scale = per_element(
        np.maximum(np.abs(payload.lo), np.abs(payload.lo + payload.unit * (2**bits - 1))),
        d,
        min(chunk_size, d),
    )
    # float32 arithmetic: t = (x - lo) / unit is off by ~2**bits ulps of a code; decoding
    # rounds twice; the final cast to `dtype` rounds once more.
    out_eps = float(jnp.finfo(dtype).eps)
    tol = unit * (2**bits + 2) * EPS32 + 2 * EPS32 * scale + out_eps * (np.abs(x64) + unit)
    assert (err <= unit / 2 + tol).all(), float((err - unit / 2 - tol).max())


@pytest.mark.parametrize("bits", range(1, 9))
def test_minmax_default_chunks_cost_at_most_two_percent_and_keep_the_bound(rng, bits):
    """Issue 13: the default chunk size keeps the scales <= 2% of the packed codes.

    Counted from the payload itself (its arrays' bytes), for a model-sized vector,
    and the nearest-rounding error bound |x - x_hat| <= unit / 2 re-checked per
    chunk in float64 with the default chunking (the unit is the chunk's range over
    2**b - 1, computed here from x, not read from the payload).
    """
    d = 3 * 16384 + 5  # several default chunks at every width, and a ragged tail
    x = jnp.asarray(rng.standard_normal(d), jnp.float32)
    comp = lpdec.minmax(bits=bits)
    payload, x_hat = round_trip(comp, x)
    sent = sum(np.asarray(a).nbytes for a in (payload.codes, payload.lo, payload.unit))
    codes_only = math.ceil(d * bits / 8)
    assert sent == comp.wire_bytes(d)
    assert sent <= 1.02 * codes_only, (bits, sent / codes_only)
    x64 = np.asarray(x, np.float64)
    err = np.abs(np.asarray(x_hat, np.float64) - x64)
    chunk = comp.chunk_size
    for start in range(0, d, chunk):
        part = x64[start : start + chunk]
        unit = (part.max() - part.min()) / (2**bits - 1)
        tol = unit * (2**bits + 2) * EPS32 + 2 * EPS32 * np.abs(part).max()
        assert (err[start : start + chunk] <= unit / 2 + tol).all(), (bits, start)
    assert payload.lo.size == math.ceil(d / chunk)


@pytest.mark.parametrize("bits", [1, 3, 8])
def test_minmax_stochastic_rounding_is_unbiased(rng, bits):
    """Mean error over K keys vs a bound derived from the Bernoulli variance.

    Each element rounds to lo + (floor(t) + B) * unit with B ~ Bernoulli(frac(t)),
    so the error has mean 0 and standard deviation <= unit / 2. Over K keys the
    mean error of one element has std <= unit / (2 sqrt(K)); 6 standard deviations
    with a union bound over d elements gives a false-alarm rate below 1e-6.
    The same statistic computed for nearest rounding (which is biased on these
    inputs) must exceed the bound: the test can fail.
    """
    d, num_keys = 256, 512
    # Fractions near 0.3 of a unit, where nearest rounding is maximally biased.
    grid = np.linspace(-1, 1, 2**bits)
    x = grid[rng.integers(0, 2**bits - 1, d)] + 0.3 * (grid[1] - grid[0])
    x[:2] = [-1.0, 1.0]  # pin the chunk's range so the unit is the grid step
    x = jnp.asarray(x, jnp.float32)
    keys = jax.random.split(jax.random.key(int(rng.integers(2**31))), num_keys)

    def mean_error(comp):
        decode = jax.jit(jax.vmap(lambda k: comp.decode(comp.encode(x, k))))
        return np.asarray(decode(keys), np.float64).mean(axis=0) - np.asarray(x, np.float64)

    unit = 2.0 / (2**bits - 1)
    bound = 6 * unit / (2 * math.sqrt(num_keys))
    stochastic = mean_error(lpdec.minmax(bits=bits, rounding="stochastic", chunk_size=d))
    assert np.abs(stochastic).max() <= bound, (np.abs(stochastic).max(), bound)
    nearest = mean_error(lpdec.minmax(bits=bits, rounding="nearest", chunk_size=d))
    assert np.abs(nearest[2:]).max() > bound


@pytest.mark.parametrize("bits", [1, 4, 8])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_minmax_constant_chunks_decode_exactly(rng, bits, rounding):
    values = rng.standard_normal(5).astype(np.float32)
    x = jnp.asarray(np.repeat(values, 100))  # chunks of 100 equal values
    comp = lpdec.minmax(bits=bits, rounding=rounding, chunk_size=100)
    _, x_hat = round_trip(comp, x, jax.random.key(1))
    np.testing.assert_array_equal(np.asarray(x_hat), np.asarray(x))


@pytest.mark.parametrize("bits", [2, 8])
def test_minmax_codes_span_the_full_range_and_stay_in_it(rng, bits):
    x = jnp.asarray(rng.standard_normal(3000), jnp.float32)
    comp = lpdec.minmax(bits=bits, chunk_size=3000)
    payload = comp.encode(x)
    codes = np.asarray(bitpack.unpack_bits(payload.codes, bits=bits, num_elements=3000))
    assert codes.max() == 2**bits - 1 and codes.min() == 0
    assert codes[int(jnp.argmax(x))] == 2**bits - 1 and codes[int(jnp.argmin(x))] == 0


def test_minmax_decode_accumulate_matches_float32_reference(rng):
    d = 3001
    comp = lpdec.minmax(bits=6, chunk_size=500)
    payload = comp.encode(jnp.asarray(rng.standard_normal(d), jnp.float32))
    acc = rng.standard_normal(d).astype(np.float32)
    weight = np.float32(rng.uniform())
    out = comp.decode_accumulate(payload, jnp.asarray(acc), weight)
    expected = acc + weight * np.asarray(comp.decode(payload))
    np.testing.assert_array_equal(np.asarray(out), expected)


@pytest.mark.parametrize(
    "shape,chunk_size", [((3, 1000), 500), ((7, 333), 500), ((2, 3, 5), 4), ((4097,), 2048)]
)
@pytest.mark.parametrize(
    "bits,rounding", [(8, "nearest"), (3, "nearest"), (8, "stochastic"), (5, "stochastic")]
)
def test_minmax_cpu_layout_matches_chunked_reference(rng, shape, chunk_size, bits, rounding):
    # On CPU the compressor works in the leaf's own shape with per-element scales;
    # the kernels (and the numpy reference) see the padded [rows, chunk] view.
    # All three must give the same bits.
    x = rng.standard_normal(shape).astype(np.float32)
    key = jax.random.key(int(rng.integers(1 << 30)))
    cpu = lpdec.minmax(bits, rounding, chunk_size, implementation="xla")
    pallas = lpdec.minmax(bits, rounding, chunk_size, implementation="pallas")
    payload = cpu.encode(jnp.asarray(x), key)
    other = pallas.encode(jnp.asarray(x), key)
    for a, b in zip(jax.tree.leaves(payload), jax.tree.leaves(other), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    d, chunk = x.size, min(chunk_size, x.size)
    rows = -(-d // chunk)
    padded = np.pad(x.reshape(-1), (0, rows * chunk - d), mode="edge").reshape(rows, chunk)
    seeds = np.asarray(jax.random.bits(key, (1, 2), jnp.uint32))
    codes, lo, unit = np_minmax_quantize(padded, seeds, bits, rounding == "stochastic")
    np.testing.assert_array_equal(np.asarray(payload.lo), lo.reshape(-1))
    np.testing.assert_array_equal(np.asarray(payload.unit), unit.reshape(-1))
    np.testing.assert_array_equal(
        np.asarray(bitpack.unpack_bits(payload.codes, bits=bits, num_elements=d)),
        codes.reshape(-1)[:d],
    )
    decoded = np_dequantize(codes, lo, unit).reshape(-1)[:d].reshape(shape)
    np.testing.assert_array_equal(np.asarray(cpu.decode(payload)), decoded)
    np.testing.assert_array_equal(np.asarray(pallas.decode(payload)), decoded)
    acc = rng.standard_normal(shape).astype(np.float32)
    weight = np.float32(rng.uniform())
    expected = acc + weight * decoded
    for comp in (cpu, pallas):
        out = comp.decode_accumulate(payload, jnp.asarray(acc), weight)
        np.testing.assert_array_equal(np.asarray(out), expected)


# ----------------------------------------------------------------------------
# modulo (Moniqua)
# ----------------------------------------------------------------------------


MODULO_CASES = [(b, "nearest") for b in range(1, 9)] + [(b, "stochastic") for b in (2, 4, 8)]


@pytest.mark.parametrize("bits,rounding", MODULO_CASES)
def test_modulo_recovery_bound_lemma_2(rng, bits, rounding):
    """Seed 003 Lemma 2: if |x - y| < theta then |x_hat - x| <= delta * B_theta."""
    d = 5000
    theta = float(rng.uniform(0.01, 2.0))
    comp = lpdec.modulo(bits=bits, theta=theta, rounding=rounding)
    y = rng.standard_normal(d).astype(np.float32) * 3
    x = (y + theta * rng.uniform(-1, 1, d) * 0.999).astype(np.float32)
    _, x_hat = round_trip(comp, jnp.asarray(x), jax.random.key(3), reference=jnp.asarray(y))
    expected_delta = 2.0 ** -(bits + 1) if rounding == "nearest" else 2.0**-bits
    assert comp.delta == expected_delta
    # B is 2 theta / (1 - 2 delta) rounded up to 16 significant bits.
    big_b = comp.modulus()
    assert 1 <= big_b / (2 * theta / (1 - 2 * comp.delta)) < 1 + 2**-15
    err = np.abs(np.asarray(x_hat, np.float64) - x)
    tol = 8 * EPS32 * (np.abs(x) + np.abs(y) + big_b)
    assert (err <= comp.delta * big_b + tol).all(), float((err - comp.delta * big_b).max())


@pytest.mark.parametrize(
    "bits,rounding", [(1, "nearest"), (3, "nearest"), (1, "stochastic"), (8, "stochastic")]
)
def test_modulo_matches_numpy_from_the_formula(rng, bits, rounding):
    """The modulo compressor against numpy: B, the codes and the decode, from the formulas.

    B = 2 theta / (1 - 2 delta) rounded up to 16 significant bits (exactly); the codes
    are test_kernels_pallas' float32 numpy encode with scale 2**bits / B (bit for bit); the
    decode is x_hat = y + ((q B / 2**bits - y + B / 2) mod B) - B / 2 in float64, which
    the float32 decode matches to a few float32 ulps of |y| + B. The dense Moniqua
    references reuse this compressor, so it is pinned here.
    """
    delta = 2.0 ** -(bits + 1) if rounding == "nearest" else 2.0**-bits

    def modulus(theta):
        # One-bit stochastic rounding (delta = 1/2) takes one-bit nearest rounding's B.
        exact = 2 * theta / (1 - 2 * min(delta, 0.25))
        _, exponent = math.frexp(exact)  # exact = m 2**exponent, 1/2 <= m < 1
        return math.ceil(exact * 2.0 ** (16 - exponent)) * 2.0 ** (exponent - 16)

    # Many thetas: a B rounded to 15 bits agrees with the 16-bit one half the time.
    for theta in rng.uniform(0.05, 2.0, 20):
        assert lpdec.modulo(bits, float(theta), rounding).modulus() == modulus(theta), theta
    d, theta = 3001, float(rng.uniform(0.05, 2.0))
    comp = lpdec.modulo(bits=bits, theta=theta, rounding=rounding)
    big_b = modulus(theta)
    y = (rng.standard_normal(d) * 3).astype(np.float32)
    x = (y + theta * rng.uniform(-0.9, 0.9, d)).astype(np.float32)
    key = jax.random.key(int(rng.integers(1 << 30)))
    payload = comp.encode(jnp.asarray(x), key)
    codes = np.asarray(bitpack.unpack_bits(payload.codes, bits=bits, num_elements=d))
    seeds = np.asarray(jax.random.bits(key, (1, 2), jnp.uint32))
    scale = np.float32(2**bits) / np.float32(big_b)
    expected = np_modulo_encode(x.reshape(1, -1), seeds, scale, bits, rounding == "stochastic")
    np.testing.assert_array_equal(codes, expected.reshape(-1))
    r = codes * (big_b / 2**bits) - y.astype(np.float64)
    x_hat = y + np.mod(r + big_b / 2, big_b) - big_b / 2
    got = np.asarray(comp.decode(payload, reference=jnp.asarray(y)), np.float64)
    np.testing.assert_allclose(got, x_hat, rtol=0, atol=4 * EPS32 * (np.abs(y).max() + big_b))
    assert np.abs(x_hat - x).max() > 0.1 * delta * big_b  # the codes are coarse


def test_modulo_one_bit_stochastic_mean_decode_matches_the_two_point_expectation(rng):
    """One bit, stochastic (B = 4 theta): the codes are the lattice points a <= x < a + B/2
    of (B/2)Z with P(a + B/2) = (x - a) / (B/2); the decode maps each into y's window
    [y - B/2, y + B/2). The mean over many keys equals that two-point expectation, from
    float64 numpy: x where y lies in x's half-cell (a, a + B/2], off by a multiple of the
    far point's wrap elsewhere (the documented bias)."""
    theta, d, draws = 0.5, 400, 4000
    comp = lpdec.modulo(bits=1, theta=theta, rounding="stochastic")
    big_b = comp.modulus()
    assert big_b == lpdec.modulo(bits=1, theta=theta, rounding="nearest").modulus()
    assert big_b == 4 * theta
    y = (rng.standard_normal(d) * 3).astype(np.float32)
    x = (y + theta * rng.uniform(-0.99, 0.99, d)).astype(np.float32)
    keys = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), draws)
    decode = jax.jit(
        jax.vmap(lambda k: comp.decode(comp.encode(jnp.asarray(x), k), reference=jnp.asarray(y)))
    )
    mean = np.asarray(decode(keys), np.float64).mean(axis=0)

    h = big_b / 2
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    a = np.floor(x64 / h) * h
    p_up = (x64 - a) / h

    def into_window(point):
        return y64 + np.mod(point - y64 + big_b / 2, big_b) - big_b / 2

    low, high = into_window(a), into_window(a + h)
    expected = (1 - p_up) * low + p_up * high
    sd = np.sqrt(p_up * (1 - p_up)) * np.abs(high - low) / np.sqrt(draws)
    np.testing.assert_array_less(np.abs(mean - expected), 5 * sd + 1e-4)
    inside = (a < y64) & (y64 <= a + h)
    np.testing.assert_allclose(expected[inside], x64[inside], atol=1e-6)
    # Outside the half-cell the mean is biased by the wrap: visible at this many draws.
    assert 0 < (~inside).sum() < d
    assert (np.abs(mean - x64)[~inside] > 0.05 * h).mean() > 0.5


def test_modulo_fails_beyond_its_range(rng):
    """Outside |x - y| < B/2 - delta B the recovery is off by a multiple of B (it can fail)."""
    comp = lpdec.modulo(bits=8, theta=0.5)
    big_b = comp.modulus()
    y = rng.standard_normal(100).astype(np.float32)
    x = y + np.float32(0.8 * big_b)
    _, x_hat = round_trip(comp, jnp.asarray(x), reference=jnp.asarray(y))
    np.testing.assert_allclose(np.asarray(x_hat) - x, -big_b, atol=comp.delta * big_b + 1e-5)


def test_modulo_theta_override_matches_constant(rng):
    x = jnp.asarray(rng.standard_normal(777), jnp.float32)
    y = x + 0.01
    fixed = lpdec.modulo(bits=3, theta=0.25)
    override = lpdec.modulo(bits=3, theta=1.0)
    a = fixed.decode(fixed.encode(x), reference=y)
    b = jax.jit(lambda t: override.decode(override.encode(x, theta=t), reference=y, theta=t))(0.25)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ----------------------------------------------------------------------------
# sparsifiers
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("d", [1, 10, 1000, 70000])
def test_top_k_keeps_the_largest_magnitudes(rng, d):
    x = rng.standard_normal(d).astype(np.float32)
    comp = lpdec.top_k(0.05)
    k = max(1, round(0.05 * d))
    payload, x_hat = round_trip(comp, jnp.asarray(x))
    kept = np.flatnonzero(np.asarray(x_hat))
    np.testing.assert_array_equal(np.sort(kept), np.sort(np.argsort(-np.abs(x))[:k]))
    np.testing.assert_array_equal(np.asarray(x_hat)[kept], x[kept])
    assert payload.indices.dtype == (jnp.uint16 if d <= 65536 else jnp.int32)
    acc = rng.standard_normal(d).astype(np.float32)
    out = comp.decode_accumulate(payload, jnp.asarray(acc), 0.5)
    np.testing.assert_allclose(np.asarray(out), acc + 0.5 * np.asarray(x_hat), rtol=1e-6)


def test_random_k_sender_and_receiver_agree_on_positions(rng):
    d = 1000
    x = rng.standard_normal(d).astype(np.float32)
    comp = lpdec.random_k(0.1)
    key = jax.random.key(7)
    payload = comp.encode(jnp.asarray(x), key)
    x_hat = np.asarray(comp.decode(payload, key=key))
    positions = np.asarray(comp.indices(d, key))
    assert len(np.unique(positions)) == 100
    np.testing.assert_array_equal(np.sort(np.flatnonzero(x_hat)), np.sort(positions))
    np.testing.assert_array_equal(x_hat[positions], x[positions])
    other = np.asarray(comp.indices(d, jax.random.key(8)))
    assert len(np.intersect1d(positions, other)) < 50


# ----------------------------------------------------------------------------
# shared contract: wire bytes, non-finite input, bad arguments, transforms
# ----------------------------------------------------------------------------


def expected_wire_bytes(comp, d, dtype):
    itemsize = np.dtype(dtype).itemsize
    if isinstance(comp, compress.Identity):
        return d * itemsize
    if isinstance(comp, compress.MinMax):
        chunks = math.ceil(d / min(comp.chunk_size, d))
        return math.ceil(d * comp.bits / 8) + 8 * chunks
    if isinstance(comp, compress.Modulo):
        return math.ceil(d * comp.bits / 8) + 1
    if isinstance(comp, compress.MX):  # codes of 4 or 8 bits, one E8M0 byte per 32 values
        return math.ceil(d * {"fp4": 4, "fp8": 8}[comp.format] / 8) + math.ceil(d / 32)
    if isinstance(comp, compress.ChunkedTopK):
        chunk = min(comp.chunk_size, d)
        entries = math.ceil(d / chunk) * min(comp.k, chunk)
        position_bits = 0 if comp.k >= chunk else (chunk - 1).bit_length()
        return math.ceil(entries * comp.bits / 8) + (
            math.ceil(entries * min(position_bits, 8) / 8)
            + math.ceil(entries * max(position_bits - 8, 0) / 8)
            + 8 * math.ceil(d / chunk)
        )
    k = max(1, round(comp.ratio * d))
    if isinstance(comp, compress.TopK):
        return k * (itemsize + (2 if d <= 65536 else 4))
    return k * itemsize


ALL_COMPRESSORS = [
    lpdec.identity(),
    lpdec.minmax(),
    lpdec.minmax(bits=1, chunk_size=100),
    lpdec.minmax(bits=3, rounding="stochastic", chunk_size=7),
    lpdec.minmax(bits=7, chunk_size=1000),
    lpdec.modulo(bits=1, theta=0.1),
    lpdec.modulo(bits=5, theta=2.0, rounding="stochastic"),
    lpdec.top_k(0.01),
    lpdec.random_k(0.3),
    lpdec.chunked_top_k(),
    lpdec.chunked_top_k(5, chunk_size=100, bits=3),
    lpdec.mx("fp4"),
    lpdec.mx("fp8", "stochastic"),
]


def decode_kwargs(comp, x, key):
    if isinstance(comp, compress.Modulo):
        return {"reference": x}
    if isinstance(comp, compress.RandomK):
        return {"key": key}
    return {}


@pytest.mark.parametrize("comp", ALL_COMPRESSORS, ids=repr)
@pytest.mark.parametrize("d", SIZES + [70001])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_wire_bytes_equal_payload_nbytes(comp, d, dtype):
    """The payload's bytes (its shapes and dtypes, traced: no need to run the encode)."""
    x = jnp.zeros((d,), dtype)
    payload = jax.eval_shape(comp.encode, x, jax.random.key(0))
    assert compress.payload_nbytes(payload) == comp.wire_bytes(d, dtype)
    assert comp.wire_bytes(d, dtype) == expected_wire_bytes(comp, d, dtype)


@pytest.mark.parametrize("comp", ALL_COMPRESSORS, ids=repr)
@pytest.mark.parametrize("shape", [(0,), (3, 0)])
def test_empty_leaves_round_trip(comp, shape):
    x = jnp.zeros(shape, jnp.float32)
    key = jax.random.key(0)
    payload = jax.jit(comp.encode)(x, key)
    assert compress.payload_nbytes(payload) == comp.wire_bytes(0)
    assert comp.decode(payload, **decode_kwargs(comp, x, key)).shape == shape
    acc = comp.decode_accumulate(payload, x, 0.5, **decode_kwargs(comp, x, key))
    assert acc.shape == shape and acc.dtype == jnp.float32


@pytest.mark.parametrize("comp", ALL_COMPRESSORS, ids=repr)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_input_is_flagged_and_decodes_non_finite(rng, comp, bad):
    x = rng.standard_normal(3000).astype(np.float32)
    key = jax.random.key(0)
    clean = comp.encode(jnp.asarray(x), key)
    assert bool(comp.is_finite(clean))
    x[1234] = bad
    payload = comp.encode(jnp.asarray(x), key)
    assert not bool(comp.is_finite(payload))
    x_hat = np.asarray(comp.decode(payload, **decode_kwargs(comp, jnp.asarray(x), key)))
    assert not np.isfinite(x_hat).all()


def test_minmax_non_finite_stays_in_its_chunk(rng):
    x = rng.standard_normal(1000).astype(np.float32)
    x[250] = np.nan
    comp = lpdec.minmax(chunk_size=100)
    x_hat = np.asarray(comp.decode(comp.encode(jnp.asarray(x))))
    assert np.isnan(x_hat[200:300]).all()
    assert np.isfinite(np.delete(x_hat, np.arange(200, 300))).all()


@pytest.mark.parametrize(
    "factory,kwargs,match",
    [
        (lpdec.minmax, {"bits": 0}, "bits must be an integer in 1..8"),
        (lpdec.minmax, {"bits": 9}, "bits must be an integer in 1..8"),
        (lpdec.minmax, {"bits": 2.5}, "bits must be an integer in 1..8"),
        (lpdec.minmax, {"bits": True}, "bits must be an integer in 1..8"),
        (lpdec.minmax, {"chunk_size": 0}, "chunk_size must be an integer >= 1"),
        (lpdec.minmax, {"chunk_size": 1.5}, "chunk_size must be an integer >= 1"),
        (lpdec.minmax, {"rounding": "up"}, "rounding must be 'nearest' or 'stochastic'"),
        (lpdec.minmax, {"implementation": "cuda"}, "implementation must be"),
        (lpdec.modulo, {"theta": 0.0}, "theta must be a number > 0"),
        (lpdec.modulo, {"theta": -1.0}, "theta must be a number > 0"),
        (lpdec.modulo, {"bits": 12}, "bits must be an integer in 1..8"),
        (lpdec.top_k, {"ratio": 0.0}, r"ratio must be a number in \(0, 1\]"),
        (lpdec.top_k, {"ratio": 1.5}, r"ratio must be a number in \(0, 1\]"),
        (lpdec.random_k, {"ratio": -0.1}, r"ratio must be a number in \(0, 1\]"),
    ],
)
def test_bad_arguments_raise_value_error_naming_the_argument(factory, kwargs, match):
    with pytest.raises(ValueError, match=match):
        factory(**kwargs)


@pytest.mark.parametrize("comp", ALL_COMPRESSORS, ids=repr)
def test_integer_input_raises_type_error(comp):
    with pytest.raises(TypeError, match="floating-point"):
        comp.encode(jnp.arange(10), jax.random.key(0))


@pytest.mark.parametrize(
    "comp", [lpdec.minmax(rounding="stochastic"), lpdec.random_k(0.5)], ids=repr
)
def test_missing_key_raises(comp):
    with pytest.raises(ValueError, match="PRNG key"):
        comp.encode(jnp.ones(10))


@pytest.mark.parametrize("comp", ALL_COMPRESSORS, ids=repr)
def test_jit_and_vmap_match_eager(rng, comp):
    xs = jnp.asarray(rng.standard_normal((3, 517)), jnp.float32)
    keys = jax.random.split(jax.random.key(11), 3)

    def f(x, key):
        return comp.decode(comp.encode(x, key), **decode_kwargs(comp, x + 0.01, key))

    eager = np.stack([np.asarray(f(x, k)) for x, k in zip(xs, keys, strict=True)])
    np.testing.assert_array_equal(np.asarray(jax.jit(f)(xs[0], keys[0])), eager[0])
    np.testing.assert_array_equal(np.asarray(jax.jit(jax.vmap(f))(xs, keys)), eager)


@pytest.mark.parametrize("comp", ALL_COMPRESSORS, ids=repr)
def test_payload_crosses_a_ring_under_shard_map(rng, comp):
    """Each node encodes, ppermutes the payload to its successor, which decodes it."""
    n = 8
    mesh = jax.make_mesh((n,), ("nodes",))
    sharding = jax.NamedSharding(mesh, jax.P("nodes"))
    xs = jnp.asarray(rng.standard_normal((n, 300)), jnp.float32)
    base_key = jax.random.key(5)
    perm = [(i, (i + 1) % n) for i in range(n)]

    def node(x):
        me = jax.lax.axis_index("nodes")
        # Keys both ends can compute: the sender's key is fold_in(base, sender index).
        payload = comp.encode(x[0], jax.random.fold_in(base_key, me))
        received = jax.lax.ppermute(payload, "nodes", perm)
        sender_key = jax.random.fold_in(base_key, (me - 1) % n)
        kwargs = decode_kwargs(comp, x[0] + 0.01, sender_key)
        return comp.decode(received, **kwargs)[None]

    out = jax.jit(
        jax.shard_map(node, mesh=mesh, in_specs=jax.P("nodes"), out_specs=jax.P("nodes"))
    )(jax.device_put(xs, sharding))
    out = np.asarray(out)
    for i in range(n):
        j = (i - 1) % n
        key = jax.random.fold_in(base_key, j)
        expected = comp.decode(comp.encode(xs[j], key), **decode_kwargs(comp, xs[i] + 0.01, key))
        np.testing.assert_array_equal(np.asarray(out[i]), np.asarray(expected))


def test_compressors_are_hashable_static_arguments(rng):
    assert lpdec.minmax(bits=4) == lpdec.minmax(bits=4)
    assert hash(lpdec.minmax(bits=4)) == hash(lpdec.minmax(bits=4))
    assert lpdec.top_k(0.1) != lpdec.random_k(0.1)
    round_trip_jit = jax.jit(lambda comp, x: comp.decode(comp.encode(x)), static_argnums=0)
    x = jnp.asarray(rng.standard_normal(100), jnp.float32)
    comp = lpdec.minmax(bits=4)
    np.testing.assert_array_equal(
        np.asarray(round_trip_jit(comp, x)), np.asarray(comp.decode(comp.encode(x)))
    )


def test_tree_helpers_compress_leaf_by_leaf(rng):
    tree = {
        "w": jnp.asarray(rng.standard_normal((30, 40)), jnp.float32),
        "b": jnp.asarray(rng.standard_normal(40), jnp.bfloat16),
    }
    comp = lpdec.top_k(0.1)
    payloads = compress.encode_tree(comp, tree)
    decoded = compress.decode_tree(comp, payloads, like=tree)
    assert compress.payload_nbytes(payloads) == compress.tree_wire_bytes(comp, tree)
    # Layer-wise: each leaf keeps its own top 10%.
    assert int((np.asarray(decoded["w"]) != 0).sum()) == 120
    assert int((np.asarray(decoded["b"], np.float32) != 0).sum()) == 4
    assert decoded["b"].dtype == jnp.bfloat16


@pytest.mark.parametrize(
    "comp",
    [
        lpdec.minmax(4),
        lpdec.minmax(3, "stochastic", chunk_size=100),
        lpdec.mx("fp4"),
        lpdec.chunked_top_k(5, chunk_size=100, bits=3),
        lpdec.top_k(0.1),
    ],
    ids=repr,
)
def test_encode_feedback_is_encode_of_the_sum_and_its_error(rng, comp):
    """(Q(v), v - D(Q(v))) for v = u + decay * e, computed here in numpy from encode/decode."""
    u = rng.standard_normal(1037).astype(np.float32)
    e = (0.1 * rng.standard_normal(1037)).astype(np.float32)
    key = jax.random.key(4)
    payload, error = jax.jit(lambda u, e: comp.encode_feedback(u, e, key, 0.75))(u, e)
    v = u + np.float32(0.75) * e  # decay * e is exact here, so no rounding question
    expected = jax.jit(lambda v: comp.encode(v, key))(v)
    for a, b in zip(jax.tree.leaves(payload), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    decoded = np.asarray(jax.jit(lambda p: comp.decode(p, key=key))(expected), np.float32)
    np.testing.assert_array_equal(np.asarray(error), v - decoded)


@pytest.mark.parametrize("chunk_size, stochastic", [(1000, True), (2048, False)])
def test_minmax_fused_feedback_kernel_matches_the_unfused_path(rng, chunk_size, stochastic):
    """The GPU kernel (interpreted as the GPU builds it) against quantize + decode."""
    from lpdec.kernels_pallas import minmax_feedback
    from lpdec.kernels_pallas import platforms

    u = jnp.asarray(rng.standard_normal(7013), jnp.float32)
    e = jnp.asarray(rng.standard_normal(7013), jnp.float32)
    seeds = jnp.asarray([[11, 12]], jnp.uint32)

    def run(target):
        return jax.jit(
            lambda u, e: minmax_feedback.quantize_feedback_on(
                u,
                e,
                jnp.float32(0.3),
                seeds,
                chunk=chunk_size,
                bits=4,
                stochastic=stochastic,
                target=target,
            )
        )(u, e)

    for a, b in zip(run(platforms.Target("gpu", True)), run(None), strict=True):
        np.testing.assert_array_equal(np.asarray(a).reshape(-1), np.asarray(b).reshape(-1))


@pytest.mark.parametrize("bits, rounding", [(8, "stochastic"), (3, "nearest")])
def test_minmax_encode_leaves_equals_leaf_by_leaf_encode(rng, bits, rounding):
    """One launch for many leaves (the GPU kernel, interpreted as the GPU builds it),
    against each leaf's own encode."""
    from lpdec.kernels_pallas import minmax_tree
    from lpdec.kernels_pallas import platforms

    comp = lpdec.minmax(bits, rounding, chunk_size=1000)
    leaves = [rng.standard_normal(s).astype(np.float32) for s in [(7013,), (64, 3), (5,), (1,)]]
    keys = list(jax.random.split(jax.random.key(9), len(leaves)))
    expected = [
        jax.jit(lambda x, k: comp.encode(x, k))(x, k) for x, k in zip(leaves, keys, strict=True)
    ]
    got = jax.jit(lambda xs, ks: comp.encode_leaves(xs, ks))(leaves, keys)
    seeds = jnp.concatenate([lpdec.kernels_pallas.seeds_from_key(k) for k in keys])
    on_gpu = jax.jit(
        lambda xs: minmax_tree.quantize_leaves_on(
            xs,
            seeds,
            chunks=(1000,) * len(xs),
            bits=bits,
            stochastic=rounding == "stochastic",
            target=platforms.Target("gpu", True),
        )
    )(leaves)
    for e, g, (codes, lo, unit) in zip(expected, got, on_gpu, strict=True):
        for a, b in zip(jax.tree.leaves(e), jax.tree.leaves(g), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_array_equal(np.asarray(lo).reshape(-1), np.asarray(e.lo))
        np.testing.assert_array_equal(np.asarray(unit).reshape(-1), np.asarray(e.unit))
        unpacked = lpdec.kernels_pallas.unpack_bits(e.codes, bits=bits, num_elements=codes.size)
        np.testing.assert_array_equal(np.asarray(codes).reshape(-1), np.asarray(unpacked))
