"""MX block-scaled formats (MXFP8 E4M3, MXFP4 E2M1): against ml_dtypes' float casts.

The independent reference is numpy: each block's scale from float64 logarithms
(the smallest power of two that fits the block's largest magnitude), then the
element rounding by ml_dtypes' own float8_e4m3fn / float4_e2m1fn casts (round to
nearest even). The kernels (interpreted as each platform builds them, and
compiled where a GPU or TPU is present) must match the jnp references bit for bit.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import lpdec
from lpdec import kernels_pallas as kernels
from lpdec.kernels_pallas import bitpack
from lpdec.kernels_pallas import mx as mx_kernels
from lpdec.kernels_pallas import mx_gpu
from lpdec.kernels_pallas import platforms

NP_TYPES = {"fp8": ml_dtypes.float8_e4m3fn, "fp4": ml_dtypes.float4_e2m1fn}
LARGEST = {"fp8": 448.0, "fp4": 6.0}
FORMATS = ["fp8", "fp4"]


def np_block_exponent(block: np.ndarray, fmt: str) -> int:
    """Smallest e with max|block| <= largest * 2**e, in float64 (clamped to [-126, 126])."""
    amax = float(np.max(np.abs(block.astype(np.float64))))
    if amax == 0:
        return -126
    e = int(np.ceil(np.log2(amax / LARGEST[fmt])))
    # log2 of an exact power-of-two ratio can land a hair off: settle it exactly.
    while amax > LARGEST[fmt] * 2.0**e:
        e += 1
    while e > -126 and amax <= LARGEST[fmt] * 2.0 ** (e - 1):
        e -= 1
    return max(-126, min(126, e))


def np_mx_nearest(x: np.ndarray, fmt: str) -> np.ndarray:
    """MX round trip of flat float32 `x` with ml_dtypes' round-to-nearest-even casts."""
    x = x.astype(np.float32).reshape(-1)
    out = np.empty_like(x)
    for start in range(0, x.size, 32):
        block = x[start : start + 32]
        e = np_block_exponent(block, fmt)
        scaled = (block.astype(np.float64) / 2.0**e).astype(np.float32)
        out[start : start + 32] = scaled.astype(NP_TYPES[fmt]).astype(np.float64) * 2.0**e
    return out


def np_grid_neighbours(x: np.ndarray, fmt: str):
    """The element-format values just below and above each x / 2**e, times 2**e."""
    codes = np.arange(256 if fmt == "fp8" else 16, dtype=np.uint8)
    grid = codes.view(NP_TYPES[fmt]).astype(np.float64)
    grid = np.unique(grid[np.isfinite(grid)])
    lo, hi = np.empty(x.size), np.empty(x.size)
    for start in range(0, x.size, 32):
        block = x[start : start + 32].astype(np.float64)
        e = np_block_exponent(block.astype(np.float32), fmt)
        v = block / 2.0**e
        i = np.searchsorted(grid, v, side="right") - 1
        lo[start : start + 32] = grid[i] * 2.0**e
        hi[start : start + 32] = grid[np.minimum(i + 1, grid.size - 1)] * 2.0**e
        exact = grid[i] == v
        hi[start : start + 32][exact] = lo[start : start + 32][exact]
    return lo, hi


def wide_range(rng, size):
    """Gaussian values spread over 6 decades, with zeros and exact grid points mixed in."""
    x = rng.standard_normal(size) * 10.0 ** rng.uniform(-4, 2, size)
    x[rng.random(size) < 0.05] = 0.0
    x[:8] = [448.0, -6.0, 1.5, 0.25, 2.0**-9, -(2.0**-140), 3.0, 1e30][: min(8, size)]
    return x.astype(np.float32)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("size", [1, 31, 32, 1000, 4099])
def test_nearest_matches_ml_dtypes_cast_per_block(rng, fmt, size):
    x = wide_range(rng, size)
    comp = lpdec.mx(fmt)
    decoded = np.asarray(jax.jit(lambda x: comp.decode(comp.encode(x)))(x))
    np.testing.assert_array_equal(decoded, np_mx_nearest(x, fmt))


@pytest.mark.parametrize("fmt", FORMATS)
def test_scale_fits_the_largest_magnitude_without_clipping(rng, fmt):
    """max|decoded| <= the block's 2**e * largest, and the block's largest entry is kept close."""
    x = wide_range(rng, 32 * 50)
    comp = lpdec.mx(fmt)
    payload = jax.jit(comp.encode)(x)
    decoded = np.asarray(jax.jit(comp.decode)(payload))
    e = np.asarray(payload.scales).astype(np.int64) - 127
    expected_e = [np_block_exponent(x[i : i + 32], fmt) for i in range(0, x.size, 32)]
    np.testing.assert_array_equal(e, expected_e)
    blocks = x.reshape(-1, 32).astype(np.float64)
    amax = np.abs(blocks).max(axis=1)
    assert np.all(np.abs(decoded.reshape(-1, 32)).max(axis=1) <= LARGEST[fmt] * 2.0**e)
    # The block's largest entry is within half a top-binade step (relative 2**-(mbits+1)).
    mbits = mx_kernels.FORMATS[fmt].mbits
    kept = np.abs(decoded.reshape(-1, 32)).max(axis=1)
    assert np.all(np.abs(kept - amax) <= amax * 2.0 ** -(mbits + 1) + 1e-45)


@pytest.mark.parametrize("fmt", FORMATS)
def test_stochastic_rounding_picks_a_neighbour_and_is_unbiased(rng, fmt):
    x = (rng.standard_normal(64 * 32) * 10.0 ** rng.uniform(-2, 1, 64 * 32)).astype(np.float32)
    comp = lpdec.mx(fmt, "stochastic")
    encode = jax.jit(jax.vmap(lambda k: comp.decode(comp.encode(jnp.asarray(x), k))))
    draws = np.asarray(encode(jax.random.split(jax.random.key(3), 2000)), np.float64)
    lo, hi = np_grid_neighbours(x, fmt)
    assert np.all((draws == lo) | (draws == hi))
    # Unbiased: each element's count of draws rounded up is Binomial(n, p), p its distance
    # from the lower neighbour in units of the gap. Per element, Bernstein's bound at a
    # failure probability of 1e-9 (a normal approximation's 5 standard errors is not a
    # bound where n p is near 0: 6 up-draws where 0.9 were expected failed it once, for
    # an x 0.00045 from its neighbour); over the elements whose count is near normal
    # (variance > 10), the mean deviation away from zero, in standard deviations, within
    # 5 of its standard errors (a bias of 2 % of the gap towards zero fails it; signed, it
    # would cancel between positive and negative x).
    n, moving = draws.shape[0], hi > lo
    p = (x - lo)[moving] / (hi - lo)[moving]
    up = (draws[:, moving] == hi[moving]).sum(axis=0)
    var, t = n * p * (1 - p), np.log(2 / 1e-9)
    assert np.all(np.abs(up - n * p) <= t / 3 + np.sqrt(t * t / 9 + 2 * t * var))
    normal = var > 10
    z = (up - n * p)[normal] * np.sign(x[moving][normal]) / np.sqrt(var[normal])
    assert abs(z.mean()) <= 5 / np.sqrt(z.size), z.mean()
    assert (draws.std(axis=0) > 0).sum() > x.size // 2  # it does round both ways


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_code_decodes_to_its_ml_dtypes_value(fmt):
    """The element decode (scale 2**0) against ml_dtypes' interpretation of each bit pattern."""
    n = 2 ** mx_kernels.FORMATS[fmt].bits
    codes = np.arange(n, dtype=np.uint8)
    values = np.asarray(
        mx_kernels.dequantize_reference(
            jnp.asarray(codes).reshape(1, n), jnp.full((1, 1), 127, jnp.uint8), fmt=fmt
        )
    ).reshape(-1)
    # ml_dtypes' float4 unpacks one code per byte (low nibble).
    expected = codes.view(NP_TYPES[fmt]).astype(np.float32)
    finite = np.isfinite(expected)
    np.testing.assert_array_equal(values[finite], expected[finite])
    assert fmt == "fp4" or (~finite).sum() == 2  # E4M3's two NaN codes are never sent


def test_non_finite_block_gets_the_nan_scale_and_stays_in_its_block(rng):
    x = rng.standard_normal(32 * 4).astype(np.float32)
    x[40] = np.inf
    x[100] = np.nan
    comp = lpdec.mx("fp4")
    payload = jax.jit(comp.encode)(x)
    np.testing.assert_array_equal(np.asarray(payload.scales) == 255, [False, True, False, True])
    assert not bool(comp.is_finite(payload))
    decoded = np.asarray(jax.jit(comp.decode)(payload)).reshape(4, 32)
    assert np.isnan(decoded[[1, 3]]).all() and np.isfinite(decoded[[0, 2]]).all()


@pytest.mark.parametrize("fmt,bits_per_value", [("fp8", 8.25), ("fp4", 4.25)])
def test_wire_bytes(fmt, bits_per_value):
    comp = lpdec.mx(fmt)
    assert comp.wire_bytes(32 * 1000) * 8 == bits_per_value * 32 * 1000
    assert comp.wire_bytes(33) == -(-33 * comp.bits // 8) + 2


@pytest.mark.parametrize(
    "kwargs,match", [({"format": "fp6"}, "format"), ({"rounding": "up"}, "rounding")]
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        lpdec.mx(**kwargs)


# ----------------------------------------------------------------------------
# Kernels: each platform's kernel (interpreted here, compiled on an accelerator).
# ----------------------------------------------------------------------------

SHAPES = [(1, 32), (300, 32)]


def random_seeds(rng):
    return jnp.asarray(rng.integers(0, 2**32, (1, 2), dtype=np.uint64).astype(np.uint32))


def same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def kernel_modes():
    """(platform, interpret) pairs: every platform interpreted, the local one compiled."""
    modes = [("gpu", True), ("tpu", True)]
    if jax.default_backend() in ("gpu", "cuda"):
        modes.append(("gpu", False))
    if jax.default_backend() == "tpu":
        modes.append(("tpu", False))
    return modes


@pytest.mark.parametrize("platform,interpret", kernel_modes())
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("stochastic", [False, True])
def test_kernels_match_references(rng, platform, interpret, fmt, shape, stochastic):
    x = jnp.asarray(wide_range(rng, shape[0] * 32).reshape(shape))
    seeds = random_seeds(rng)
    args = {"fmt": fmt, "interpret": interpret, "platform": platform}
    codes, scales = mx_kernels.quantize_pallas(x, seeds, stochastic=stochastic, **args)
    ref_codes, ref_scales = mx_kernels.quantize_reference(x, seeds, fmt=fmt, stochastic=stochastic)
    same_bits(codes, ref_codes)
    same_bits(scales, ref_scales)
    same_bits(
        mx_kernels.dequantize_pallas(codes, scales, dtype=jnp.bfloat16, **args),
        mx_kernels.dequantize_reference(codes, scales, fmt=fmt, dtype=jnp.bfloat16),
    )
    acc = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    same_bits(
        mx_kernels.dequantize_accumulate_pallas(acc, 0.3, codes, scales, **args),
        mx_kernels.dequantize_accumulate_reference(acc, 0.3, codes, scales, fmt=fmt),
    )


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_public_ops_agree_across_implementations(rng, fmt, dtype):
    x = jnp.asarray(wide_range(rng, 3001), dtype)
    key = jax.random.key(1)
    outs = []
    for implementation in ("xla", "pallas"):
        comp = lpdec.mx(fmt, "stochastic", implementation=implementation)
        acc = jnp.linspace(-1, 1, x.size, dtype=jnp.float32)

        @jax.jit
        def run(x, acc, comp=comp):
            payload = comp.encode(x, key)
            return payload, comp.decode(payload), comp.decode_accumulate(payload, acc, 0.5)

        outs.append(run(x, acc))
    for a, b in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1]), strict=True):
        same_bits(a, b)


def test_kernels_take_any_row_count_on_every_platform():
    for rows in (1, 3, 1000, 4097):
        assert mx_kernels.kernel_lowers(platforms.Target("gpu"), rows, jnp.float32)
        assert mx_kernels.kernel_lowers(platforms.Target("tpu"), rows, jnp.bfloat16)
    assert kernels.packed_size(33, 4) == 17


# ----------------------------------------------------------------------------
# The GPU kernels on the flat array (`mx_gpu`), interpreted (compiled on a GPU
# machine): masked loads and stores instead of padding, E2M1 codes packed two a
# byte in the same pass.
# ----------------------------------------------------------------------------

GPU = platforms.Target("gpu", interpret=jax.default_backend() != "gpu")
# One element; under a block; one block; a ragged last block; whole grid steps
# (128 blocks of 32 each on GPU); a ragged last step.
GPU_SIZES = [1, 31, 32, 33, 4096 * 2, 4096 * 2 + 37]


def mixed_values(rng, size):
    """Values over six decades with signed zeros; an Inf, a NaN and a -Inf block where
    the size reaches blocks 1, 2 and 3. No element scales to a float32 subnormal."""
    x = (rng.standard_normal(size) * 10.0 ** rng.uniform(-3, 3, size)).astype(np.float32)
    x[rng.random(size) < 0.05] = 0.0
    x[rng.random(size) < 0.05] = -0.0
    x[size - size % 32 :] *= 1e-4  # a short last block of small values: loads past it give 0
    for i, special in ((40, np.inf), (70, np.nan), (100, -np.inf)):
        if i < size:
            x[i] = special
    return x


def rows_reference(x, seeds, fmt, stochastic):
    """`quantize_reference` of x zero-padded to whole blocks: (codes [size], scales)."""
    x2d = jnp.pad(jnp.asarray(x), (0, -x.size % 32)).reshape(-1, 32)
    codes, scales = mx_kernels.quantize_reference(x2d, seeds, fmt=fmt, stochastic=stochastic)
    return codes.reshape(-1)[: x.size], scales.reshape(-1)


def packed_reference(codes, bits):
    """`bitpack.pack_reference` of flat codes, cut to ceil(size * bits / 8) bytes."""
    groups = jnp.pad(jnp.asarray(codes), (0, -codes.size % 8)).reshape(-1, 8)
    packed = bitpack.pack_reference(groups, bits=bits).reshape(-1)
    return packed[: bitpack.packed_size(codes.size, bits)]


def np_mx_codes(x, fmt):
    """(codes, scale bytes) of flat float32 x from float64 scales and ml_dtypes' casts.

    A block holding NaN or Inf: scale 255, codes 0. A zero input's code is +0 (its
    sign is not kept); a nonzero value rounding to zero keeps its sign.
    """
    codes, scales = np.zeros(x.size, np.uint8), []
    for start in range(0, x.size, 32):
        block = x[start : start + 32]
        if not np.isfinite(block).all():
            scales.append(255)
            continue
        e = np_block_exponent(block, fmt)
        scaled = (block.astype(np.float64) / 2.0**e).astype(np.float32)
        cast = scaled.astype(NP_TYPES[fmt]).view(np.uint8)
        codes[start : start + 32] = np.where(scaled == 0, 0, cast)
        scales.append(e + 127)
    return codes, np.asarray(scales, np.uint8)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("size", GPU_SIZES)
def test_gpu_quantize_matches_the_references(rng, fmt, stochastic, size):
    """Codes one per byte and packed (E2M1 two a byte) against the row reference
    and bitpack's packing, and (nearest) against ml_dtypes' casts."""
    x = mixed_values(rng, size)
    seeds = random_seeds(rng)
    bits = mx_kernels.FORMATS[fmt].bits
    args = {"fmt": fmt, "stochastic": stochastic, "target": GPU}
    codes, scales = mx_gpu.quantize(jnp.asarray(x), seeds, **args)
    packed, packed_scales = mx_gpu.quantize(jnp.asarray(x), seeds, pack=True, **args)
    want_codes, want_scales = rows_reference(x, seeds, fmt, stochastic)
    same_bits(codes, want_codes)
    same_bits(scales, want_scales)
    same_bits(packed, packed_reference(want_codes, bits))
    same_bits(packed_scales, want_scales)
    if not stochastic:
        np_codes, np_scales = np_mx_codes(x, fmt)
        same_bits(codes, np_codes)
        same_bits(scales, np_scales)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_gpu_quantize_half_precision_inputs(rng, fmt, dtype):
    x = jnp.asarray(mixed_values(rng, 4096 + 45), dtype)
    seeds = random_seeds(rng)
    packed, scales = mx_gpu.quantize(x, seeds, fmt=fmt, stochastic=True, target=GPU, pack=True)
    want_codes, want_scales = rows_reference(x, seeds, fmt, True)
    same_bits(packed, packed_reference(want_codes, mx_kernels.FORMATS[fmt].bits))
    same_bits(scales, want_scales)


def random_codes_and_scales(rng, fmt, size):
    """Every code value (the sign-of-zero code among them) and scales of every kind:
    the NaN byte, the extremes, and 127 (2**0)."""
    codes = rng.integers(0, 2 ** mx_kernels.FORMATS[fmt].bits, size).astype(np.uint8)
    blocks = -(-size // 32)
    scales = rng.integers(127 - 30, 127 + 30, blocks).astype(np.uint8)
    scales[: min(blocks, 4)] = [127, 255, 0, 253][: min(blocks, 4)]
    return codes, scales


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("size", [1, 33, 4096 * 2 + 37])
def test_gpu_decodes_match_the_references(rng, fmt, packed, size):
    codes, scales = random_codes_and_scales(rng, fmt, size)
    bits = mx_kernels.FORMATS[fmt].bits
    wire = packed_reference(codes, bits) if packed else jnp.asarray(codes)
    c2d = jnp.pad(jnp.asarray(codes), (0, -size % 32)).reshape(-1, 32)
    s2d = jnp.asarray(scales).reshape(-1, 1)
    for dtype in (jnp.float32, jnp.bfloat16):
        got = mx_gpu.dequantize(
            wire, jnp.asarray(scales), fmt=fmt, size=size, dtype=dtype, target=GPU, packed=packed
        )
        want = mx_kernels.dequantize_reference(c2d, s2d, fmt=fmt, dtype=dtype)
        same_bits(got, want.reshape(-1)[:size])
    acc = rng.standard_normal(size).astype(np.float32)
    got = mx_gpu.dequantize_accumulate(
        jnp.asarray(acc), 0.3, wire, jnp.asarray(scales), fmt=fmt, target=GPU, packed=packed
    )
    a2d = jnp.pad(jnp.asarray(acc), (0, -size % 32)).reshape(-1, 32)
    want = mx_kernels.dequantize_accumulate_reference(a2d, 0.3, c2d, s2d, fmt=fmt)
    same_bits(got, want.reshape(-1)[:size])


@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_decode_keeps_the_sign_of_zero(fmt):
    """Each code at scale 2**0 decodes to ml_dtypes' value, bit for bit: -0 stays -0
    (an H100 once decoded it to +0: Triton lowers -x as 0 - x)."""
    bits = mx_kernels.FORMATS[fmt].bits
    codes = np.arange(2**bits, dtype=np.uint8)
    expected = codes.view(NP_TYPES[fmt]).astype(np.float32)
    finite = np.isfinite(expected)  # E4M3's two NaN codes are never sent
    assert np.signbit(expected[1 << (bits - 1)]) and expected[1 << (bits - 1)] == 0
    scales = jnp.full((-(-codes.size // 32),), 127, jnp.uint8)
    for packed in (False, True):
        wire = packed_reference(codes, bits) if packed else jnp.asarray(codes)
        args = {"fmt": fmt, "size": codes.size, "target": GPU, "packed": packed}
        got = mx_gpu.dequantize(wire, scales, dtype=jnp.float32, **args)
        same_bits(np.asarray(got)[finite], expected[finite])


@pytest.mark.parametrize("fmt", FORMATS)
def test_public_ops_on_gpu_take_the_flat_kernels(rng, fmt):
    """What the public ops run on a GPU (its target, interpreted), on a 2-D array:
    the jnp path's bytes, one code per byte and packed."""
    shape = (3, 77)
    x = jnp.asarray(mixed_values(rng, 3 * 77).reshape(shape))
    seeds = random_seeds(rng)
    f = mx_kernels.FORMATS[fmt]
    codes, scales = mx_kernels.quantize_on(x, seeds, fmt=f, stochastic=True, target=GPU)
    packed, packed_scales = mx_kernels.quantize_packed_on(
        x, seeds, fmt=f, stochastic=True, target=GPU
    )
    want = mx_kernels.quantize(x, seeds, fmt=fmt, stochastic=True, implementation="xla")
    same_bits(codes, want[0])
    same_bits(scales, want[1])
    same_bits(packed, packed_reference(want[0].reshape(-1), f.bits))
    same_bits(packed_scales, want[1])
    acc = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    want_values = mx_kernels.dequantize(codes, scales, fmt=fmt, implementation="xla")
    want_acc = mx_kernels.dequantize_accumulate(
        acc, 0.5, codes, scales, fmt=fmt, implementation="xla"
    )
    same_bits(
        mx_kernels.dequantize_on(codes, scales, fmt=f, dtype=jnp.float32, target=GPU), want_values
    )
    same_bits(
        mx_kernels.dequantize_packed_on(
            packed, scales, fmt=f, shape=shape, dtype=jnp.float32, target=GPU
        ),
        want_values,
    )
    weight = jnp.float32(0.5)
    same_bits(
        mx_kernels.dequantize_accumulate_on(acc, weight, codes, scales, fmt=f, target=GPU),
        want_acc,
    )
    same_bits(
        mx_kernels.dequantize_accumulate_packed_on(acc, weight, packed, scales, fmt=f, target=GPU),
        want_acc,
    )


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_packed_ops_are_quantize_then_pack(rng, fmt, implementation):
    """The packed public ops where no GPU runs (jnp, or the row kernels and bitpack's)."""
    shape = (37, 29)
    x = jnp.asarray(mixed_values(rng, 37 * 29).reshape(shape))
    seeds = random_seeds(rng)
    bits = mx_kernels.FORMATS[fmt].bits
    args = {"fmt": fmt, "implementation": implementation, "interpret": True}
    packed, scales = mx_kernels.quantize_packed(x, seeds, stochastic=True, **args)
    want_codes, want_scales = rows_reference(np.asarray(x).reshape(-1), seeds, fmt, True)
    same_bits(packed, packed_reference(want_codes, bits))
    same_bits(scales, want_scales)
    codes = want_codes.reshape(shape)
    same_bits(
        mx_kernels.dequantize_packed(packed, scales, shape=shape, dtype=jnp.bfloat16, **args),
        mx_kernels.dequantize(codes, scales, dtype=jnp.bfloat16, fmt=fmt, implementation="xla"),
    )
    acc = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    same_bits(
        mx_kernels.dequantize_accumulate_packed(acc, 0.25, packed, scales, **args),
        mx_kernels.dequantize_accumulate(acc, 0.25, codes, scales, fmt=fmt, implementation="xla"),
    )


def test_packed_ops_check_the_byte_count():
    packed, scales = jnp.zeros(16, jnp.uint8), jnp.zeros(2, jnp.uint8)
    with pytest.raises(ValueError, match=r"packed fp4 codes of 33 elements have shape \(17,\)"):
        mx_kernels.dequantize_packed(packed, scales, fmt="fp4", shape=(33,))
    with pytest.raises(ValueError, match="have shape"):
        mx_kernels.dequantize_accumulate_packed(jnp.zeros(36), 1.0, packed, scales, fmt="fp4")
    # 34 fp4 codes take the 17 bytes and 2 scales of 33: the compressor checks the count.
    comp = lpdec.mx("fp4")
    with pytest.raises(ValueError, match="acc has 34 elements; the payload 33"):
        comp.decode_accumulate(comp.encode(jnp.zeros(33)), jnp.zeros(34), 1.0)
