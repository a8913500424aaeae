"""Pallas kernels against their jnp references and against independent numpy references.

`_KernelChecks` holds every check; `TestKernelsInterpret` runs them with the
kernels in interpret mode (this is how CI exercises them on CPU), and on a GPU
or TPU `TestKernelsCompiled` re-runs them compiled. `TestPlatformKernels` runs
the GPU and TPU kernels (their block sizes, reductions and scalar memory) in
interpret mode, so the branches only a compiled kernel takes are checked in CI.
The numpy references below are written from the semantics in docs/DESIGN.md,
not from the library's code: numpy float32 arithmetic never fuses multiply-adds,
so bit equality with it shows the library rounds every product exactly once, on
every path.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lpdec.kernels_pallas import bitpack
from lpdec.kernels_pallas import minmax
from lpdec.kernels_pallas import minmax_feedback
from lpdec.kernels_pallas import minmax_gpu
from lpdec.kernels_pallas import modulo
from lpdec.kernels_pallas import numerics
from lpdec.kernels_pallas import platforms

SHAPES = [(1, 1), (1, 7), (5, 1), (3, 1000), (37, 128), (130, 33)]
FLOAT_DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


# ----------------------------------------------------------------------------
# Independent numpy references.
# ----------------------------------------------------------------------------


def np_lowbias32(h):
    h = h.astype(np.uint32)
    h ^= h >> np.uint32(16)
    h = (h * np.uint32(0x7FEB352D)).astype(np.uint32)
    h ^= h >> np.uint32(15)
    h = (h * np.uint32(0x846CA68B)).astype(np.uint32)
    return h ^ (h >> np.uint32(16))


def np_uniform(seeds, shape):
    rows, cols = shape
    index = (np.arange(rows, dtype=np.uint32)[:, None] * np.uint32(cols)) + np.arange(
        cols, dtype=np.uint32
    )
    h = np_lowbias32(index ^ seeds[0, 0])
    h = np_lowbias32((h + seeds[0, 1]).astype(np.uint32))
    return (h >> np.uint32(8)).astype(np.float32) * np.float32(2.0**-24)


def np_minmax_quantize(x, seeds, bits, stochastic):
    x = np.asarray(x, np.float32)
    top = np.float32(2**bits - 1)
    lo = x.min(axis=1, keepdims=True)
    hi = x.max(axis=1, keepdims=True)
    unit = (hi - lo) * np.float32(1.0 / (2**bits - 1))
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(unit > 0, np.float32(1.0) / unit, np.float32(0.0)).astype(np.float32)
        t = (x - lo) * inv
    t = np.floor(t + np_uniform(seeds, x.shape)) if stochastic else np.round(t)
    t = np.clip(t, np.float32(0), top)
    t = np.where(np.isnan(t), np.float32(0), t)
    return t.astype(np.uint8), lo, unit


def np_dequantize(codes, lo, unit):
    return lo + codes.astype(np.float32) * unit


def np_modulo_encode(x, seeds, scale, bits, stochastic):
    x = np.asarray(x, np.float32)
    n = np.float32(2**bits)
    with np.errstate(invalid="ignore", over="ignore"):
        s = x * np.float32(scale)
        m = s - n * np.floor(s * np.float32(1.0 / 2**bits))
        r = np.floor(m + np_uniform(seeds, x.shape)) if stochastic else np.round(m)
        r = np.where(np.isfinite(r), r, np.float32(0))
    return (r.astype(np.int32) & (2**bits - 1)).astype(np.uint8)


def np_pack(codes, bits):
    stream = ((codes[:, None] >> np.arange(bits)) & 1).astype(np.uint8).reshape(-1)
    return np.packbits(stream, bitorder="little")


def random_seeds(rng):
    return rng.integers(0, 2**32, size=(1, 2), dtype=np.uint32)


def same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


# ----------------------------------------------------------------------------
# Checks run for each kernel mode.
# ----------------------------------------------------------------------------


class _KernelChecks:
    interpret: bool

    @pytest.mark.parametrize("shape", SHAPES)
    @pytest.mark.parametrize("bits", [1, 3, 8])
    @pytest.mark.parametrize("stochastic", [False, True])
    def test_minmax_quantize_matches_reference(self, rng, shape, bits, stochastic):
        x = jnp.asarray(rng.standard_normal(shape) * rng.uniform(0.01, 100), jnp.float32)
        seeds = jnp.asarray(random_seeds(rng))
        kernel = minmax.quantize_pallas(
            x, seeds, bits=bits, stochastic=stochastic, interpret=self.interpret
        )
        reference = minmax.quantize_reference(x, seeds, bits=bits, stochastic=stochastic)
        expected = np_minmax_quantize(x, np.asarray(seeds), bits, stochastic)
        for k, r, e in zip(kernel, reference, expected, strict=True):
            same_bits(k, r)
            same_bits(r, e)

    @pytest.mark.parametrize("dtype", FLOAT_DTYPES)
    def test_minmax_quantize_low_precision_inputs(self, rng, dtype):
        x = jnp.asarray(rng.standard_normal((9, 100)), dtype)
        seeds = jnp.asarray(random_seeds(rng))
        kernel = minmax.quantize_pallas(x, seeds, bits=8, stochastic=True, interpret=self.interpret)
        reference = minmax.quantize_reference(x, seeds, bits=8, stochastic=True)
        expected = np_minmax_quantize(np.asarray(x, np.float32), np.asarray(seeds), 8, True)
        for k, r, e in zip(kernel, reference, expected, strict=True):
            same_bits(k, r)
            same_bits(r, e)

    @pytest.mark.parametrize("block_rows", [1, 2, 8, 64])
    def test_stochastic_bits_do_not_depend_on_blocking(self, rng, block_rows):
        x = jnp.asarray(rng.standard_normal((45, 64)), jnp.float32)
        seeds = jnp.asarray(random_seeds(rng))
        blocked = minmax.quantize_pallas(
            x, seeds, bits=4, stochastic=True, block_rows=block_rows, interpret=self.interpret
        )
        whole = minmax.quantize_reference(x, seeds, bits=4, stochastic=True)
        for b, w in zip(blocked, whole, strict=True):
            same_bits(b, w)

    @pytest.mark.parametrize("shape", SHAPES)
    @pytest.mark.parametrize("dtype", FLOAT_DTYPES)
    def test_dequantize_matches_reference(self, rng, shape, dtype):
        codes = jnp.asarray(rng.integers(0, 256, shape), jnp.uint8)
        lo = jnp.asarray(rng.standard_normal((shape[0], 1)), jnp.float32)
        unit = jnp.asarray(rng.uniform(0, 1, (shape[0], 1)), jnp.float32)
        kernel = minmax.dequantize_pallas(codes, lo, unit, dtype=dtype, interpret=self.interpret)
        reference = minmax.dequantize_reference(codes, lo, unit, dtype=dtype)
        same_bits(kernel, reference)
        expected = np_dequantize(np.asarray(codes), np.asarray(lo), np.asarray(unit))
        same_bits(reference, jnp.asarray(expected).astype(dtype))

    @pytest.mark.parametrize("shape", SHAPES)
    def test_dequantize_accumulate_matches_reference(self, rng, shape):
        codes = jnp.asarray(rng.integers(0, 256, shape), jnp.uint8)
        lo = jnp.asarray(rng.standard_normal((shape[0], 1)), jnp.float32)
        unit = jnp.asarray(rng.uniform(0, 1, (shape[0], 1)), jnp.float32)
        acc = jnp.asarray(rng.standard_normal(shape), jnp.float32)
        weight = np.float32(rng.uniform(0, 1))
        kernel = minmax.dequantize_accumulate_pallas(
            acc, weight, codes, lo, unit, interpret=self.interpret
        )
        reference = minmax.dequantize_accumulate_reference(acc, weight, codes, lo, unit)
        same_bits(kernel, reference)
        decoded = np_dequantize(np.asarray(codes), np.asarray(lo), np.asarray(unit))
        same_bits(reference, np.asarray(acc) + weight * decoded)

    @pytest.mark.parametrize("shape", SHAPES)
    @pytest.mark.parametrize("bits", [1, 2, 5, 8])
    @pytest.mark.parametrize("stochastic", [False, True])
    def test_modulo_encode_matches_reference(self, rng, shape, bits, stochastic):
        x = jnp.asarray(rng.standard_normal(shape) * 10, jnp.float32)
        seeds = jnp.asarray(random_seeds(rng))
        scale = np.float32(2**bits / rng.uniform(0.1, 5))
        kernel = modulo.encode_pallas(
            x, seeds, scale, bits=bits, stochastic=stochastic, interpret=self.interpret
        )
        reference = modulo.encode_reference(x, seeds, scale, bits=bits, stochastic=stochastic)
        same_bits(kernel, reference)
        same_bits(reference, np_modulo_encode(x, np.asarray(seeds), scale, bits, stochastic))

    @pytest.mark.parametrize("bits", range(1, 9))
    @pytest.mark.parametrize("groups", [1, 3, 4097])
    def test_bitpack_matches_reference(self, rng, bits, groups):
        codes = jnp.asarray(rng.integers(0, 2**bits, (groups, 8)), jnp.uint8)
        packed = bitpack.pack_pallas(codes, bits=bits, interpret=self.interpret)
        same_bits(packed, bitpack.pack_reference(codes, bits=bits))
        same_bits(packed.reshape(-1), np_pack(np.asarray(codes).reshape(-1), bits))
        unpacked = bitpack.unpack_pallas(packed, bits=bits, interpret=self.interpret)
        same_bits(unpacked, bitpack.unpack_reference(packed, bits=bits))
        same_bits(unpacked, codes)

    def test_non_finite_rows_flagged_by_scales(self):
        x = np.ones((4, 16), np.float32)
        x[0, 3] = np.nan
        x[1, 0] = np.inf
        x[2, 5] = -np.inf
        codes, lo, unit = minmax.quantize_pallas(
            jnp.asarray(x), None, bits=8, stochastic=False, interpret=self.interpret
        )
        finite_rows = np.isfinite(np.asarray(lo)[:, 0]) & np.isfinite(np.asarray(unit)[:, 0])
        np.testing.assert_array_equal(finite_rows, [False, False, False, True])
        np.testing.assert_array_equal(np.asarray(codes)[:3], 0)
        decoded = np.asarray(minmax.dequantize_reference(codes, lo, unit))
        assert not np.isfinite(decoded[:3]).any()
        np.testing.assert_array_equal(decoded[3], 1.0)


class TestKernelsInterpret(_KernelChecks):
    interpret = True


if jax.default_backend() != "cpu":

    class TestKernelsCompiled(_KernelChecks):
        interpret = False


# ----------------------------------------------------------------------------
# Dispatch and the hash itself.
# ----------------------------------------------------------------------------


_LOCAL = jax.default_backend()
_COMPILED = None if _LOCAL == "cpu" else platforms.Target(_LOCAL, False)


@pytest.mark.parametrize(
    "implementation, expected",
    [
        ("xla", None),
        (None, _COMPILED),
        ("pallas", platforms.Target("cpu", True) if _LOCAL == "cpu" else _COMPILED),
    ],
)
def test_eager_dispatch_picks_the_default_backends_branch(implementation, expected):
    seen = []

    def body(x, *, target):
        seen.append(target)
        return x

    platforms.dispatch(implementation, body, jnp.zeros(3))
    assert seen == [expected]


def test_dispatch_rejects_unknown_implementation():
    with pytest.raises(ValueError, match="implementation"):
        platforms.dispatch("cuda", lambda x, *, target: x, jnp.zeros(3))


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_public_ops_agree_across_implementations(rng, implementation):
    x = jnp.asarray(rng.standard_normal((6, 50)), jnp.float32)
    seeds = jnp.asarray(random_seeds(rng))
    out = minmax.quantize(x, seeds, bits=5, stochastic=True, implementation=implementation)
    for o, r in zip(out, minmax.quantize_reference(x, seeds, bits=5, stochastic=True), strict=True):
        same_bits(o, r)
    packed = bitpack.pack_bits(out[0].reshape(-1), bits=5, implementation=implementation)
    same_bits(packed, np_pack(np.asarray(out[0]).reshape(-1), 5))


def test_hash_uniform_is_uniform_and_seed_dependent(rng):
    """Chi-square over 64 bins of 2**16 draws, and two seeds give unrelated streams."""
    index = jnp.arange(1 << 16, dtype=jnp.uint32)
    s = random_seeds(rng)
    u = np.asarray(numerics.hash_uniform(jnp.uint32(s[0, 0]), jnp.uint32(s[0, 1]), index))
    assert u.min() >= 0.0 and u.max() < 1.0
    counts = np.histogram(u, bins=64, range=(0, 1))[0]
    expected = u.size / 64
    chi2 = ((counts - expected) ** 2 / expected).sum()
    # 63 degrees of freedom: P(chi2 > 120) < 1e-5.
    assert chi2 < 120, chi2
    v = np.asarray(numerics.hash_uniform(jnp.uint32(s[0, 0] ^ 1), jnp.uint32(s[0, 1]), index))
    assert abs(np.corrcoef(u, v)[0, 1]) < 0.03
    np.testing.assert_array_equal(u, np_uniform(s, (1, 1 << 16)).reshape(-1))


# ----------------------------------------------------------------------------
# Each platform's compiled kernel, interpreted: the branches taken only when a
# kernel is compiled (two reductions instead of one variadic reduce, GPU-sized
# and TPU-tiled blocks, scalars in TPU SMEM) run here against the references.
# ----------------------------------------------------------------------------


def special_rows(rng, rows, chunk):
    """Random rows, then rows of each case the min/max reductions must get right."""
    x = rng.standard_normal((rows, chunk)).astype(np.float32)
    x[0] = np.where(rng.random(chunk) < 0.5, np.float32(-0.0), np.float32(0.0))
    x[0, 0], x[0, -1] = -0.0, 0.0  # both signs of zero, -0 < +0 in the total order
    x[1, 3] = np.nan
    x[2, 1] = np.inf
    x[3, 2] = -np.inf
    x[4, :2] = [np.inf, -np.inf]
    x[5] = 2.5  # constant: unit 0
    x[6, :] = -np.abs(x[6]) - 1.0  # all negative
    x[7, 5] = -np.float32(np.nan)  # a NaN with the sign bit set
    return x


# Each spans several blocks on GPU or TPU (test_blocks_split_the_rows).
PLATFORM_SHAPES = [(8, 128), (300, 64), (40, 4096)]


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
class TestPlatformKernels:
    """The GPU and TPU kernels, interpreted, against the jnp and numpy references."""

    @pytest.mark.parametrize("shape", PLATFORM_SHAPES)
    @pytest.mark.parametrize("bits", [1, 8])
    @pytest.mark.parametrize("stochastic", [False, True])
    def test_minmax_quantize(self, rng, platform, shape, bits, stochastic):
        x = special_rows(rng, *shape)
        seeds = jnp.asarray(random_seeds(rng))
        kernel = minmax.quantize_pallas(
            jnp.asarray(x),
            seeds,
            bits=bits,
            stochastic=stochastic,
            interpret=True,
            platform=platform,
        )
        reference = minmax.quantize_reference(
            jnp.asarray(x), seeds, bits=bits, stochastic=stochastic
        )
        for k, r in zip(kernel, reference, strict=True):
            same_bits(k, r)
        # Rows 8.. hold plain random values: the numpy reference applies.
        expected = np_minmax_quantize(x[8:], None, bits, False)
        if not stochastic:
            for k, e in zip(kernel, expected, strict=True):
                same_bits(np.asarray(k)[8:], e)
        lo, unit = np.asarray(kernel[1])[:8, 0], np.asarray(kernel[2])[:8, 0]
        assert np.signbit(lo[0]) and lo[0] == 0  # -0 is the row's minimum
        np.testing.assert_array_equal(np.isfinite(lo) & np.isfinite(unit), [1, 0, 0, 0, 0, 1, 1, 0])

    def test_minmax_quantize_bfloat16(self, rng, platform):
        x = jnp.asarray(special_rows(rng, 40, 256), jnp.bfloat16)
        seeds = jnp.asarray(random_seeds(rng))
        kernel = minmax.quantize_pallas(
            x, seeds, bits=4, stochastic=True, interpret=True, platform=platform
        )
        reference = minmax.quantize_reference(x, seeds, bits=4, stochastic=True)
        for k, r in zip(kernel, reference, strict=True):
            same_bits(k, r)

    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
    def test_minmax_dequantize_and_accumulate(self, rng, platform, dtype):
        shape = (40, 4096)
        codes = jnp.asarray(rng.integers(0, 256, shape), jnp.uint8)
        lo = rng.standard_normal((shape[0], 1)).astype(np.float32)
        unit = rng.uniform(0, 1, (shape[0], 1)).astype(np.float32)
        lo[:6, 0] = [-0.0, 0.0, np.nan, np.inf, -np.inf, 1.0]
        unit[:6, 0] = [0.0, np.inf, 1.0, 0.5, 0.0, np.nan]
        lo, unit = jnp.asarray(lo), jnp.asarray(unit)
        kernel = minmax.dequantize_pallas(
            codes, lo, unit, dtype=dtype, interpret=True, platform=platform
        )
        same_bits(kernel, minmax.dequantize_reference(codes, lo, unit, dtype=dtype))
        acc = jnp.asarray(rng.standard_normal(shape), jnp.float32)
        weight = np.float32(rng.uniform(0, 1))
        kernel = minmax.dequantize_accumulate_pallas(
            acc, weight, codes, lo, unit, interpret=True, platform=platform
        )
        same_bits(kernel, minmax.dequantize_accumulate_reference(acc, weight, codes, lo, unit))

    @pytest.mark.parametrize("stochastic", [False, True])
    def test_modulo_encode(self, rng, platform, stochastic):
        x = special_rows(rng, 80, 1024) * 10
        seeds = jnp.asarray(random_seeds(rng))
        scale = np.float32(2**3 / rng.uniform(0.1, 5))
        kernel = modulo.encode_pallas(
            jnp.asarray(x),
            seeds,
            scale,
            bits=3,
            stochastic=stochastic,
            interpret=True,
            platform=platform,
        )
        same_bits(kernel, modulo.encode_reference(x, seeds, scale, bits=3, stochastic=stochastic))
        same_bits(kernel, np_modulo_encode(x, np.asarray(seeds), scale, 3, stochastic))

    @pytest.mark.parametrize("bits", [1, 2, 4])
    def test_bitpack(self, rng, platform, bits):
        codes = jnp.asarray(rng.integers(0, 2**bits, (4097, 8)), jnp.uint8)
        packed = bitpack.pack_pallas(codes, bits=bits, interpret=True, platform=platform)
        same_bits(packed.reshape(-1), np_pack(np.asarray(codes).reshape(-1), bits))
        unpacked = bitpack.unpack_pallas(packed, bits=bits, interpret=True, platform=platform)
        same_bits(unpacked, codes)

    def test_blocks_split_the_rows(self, platform):
        """The shapes above span several blocks of this platform's kernels."""
        target = platforms.Target(platform)
        assert any(target.block_rows(r, c, (jnp.uint8,)) < r for r, c in PLATFORM_SHAPES)
        assert target.block_rows(40, 4096) < 40  # dequantize
        assert target.block_rows(80, 1024) < 80  # modulo
        assert target.block_rows(4097, 16, (jnp.uint8,)) < 4097  # bit packing


# ----------------------------------------------------------------------------
# GPU quantize-and-pack in one pass (widths dividing 8), interpreted.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [1, 2, 4])
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize(
    "size, chunk",
    # whole chunks; a ragged last chunk ending mid-byte; a chunk that is no power of
    # two (24: 3 bytes of 1-bit codes, a 32-wide tile); one chunk, shorter than a byte.
    [(64 * 128, 128), (5 * 256 + 37, 256), (1000 + 3, 24), (7, 8)],
)
def test_gpu_packed_quantize_is_quantize_then_pack(rng, bits, stochastic, size, chunk):
    x = special_rows(rng, 8, 128).reshape(-1)
    x = np.concatenate([x, rng.standard_normal(size).astype(np.float32)])[-size:]
    seeds = jnp.asarray(random_seeds(rng))
    packed, lo, unit = minmax_gpu.gpu_quantize(
        jnp.asarray(x),
        seeds,
        chunk=chunk,
        bits=bits,
        stochastic=stochastic,
        target=platforms.Target("gpu", True),
        pack=True,
    )
    codes, want_lo, want_unit = minmax.quantize(
        jnp.asarray(x), seeds, bits=bits, stochastic=stochastic, chunk=chunk, implementation="xla"
    )
    same_bits(packed, np_pack(np.asarray(codes).reshape(-1), bits))
    same_bits(lo, np.asarray(want_lo).reshape(-1))
    same_bits(unit, np.asarray(want_unit).reshape(-1))


@pytest.mark.parametrize("bits", [1, 4])
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("size, chunk", [(5 * 256 + 37, 256), (1000 + 3, 24)])
def test_gpu_packed_feedback_is_feedback_then_pack(rng, bits, stochastic, size, chunk):
    """One pass of error feedback with packed codes: the same bytes, scales and residual."""
    update = jnp.asarray(rng.standard_normal(size).astype(np.float32))
    residual = jnp.asarray(0.1 * rng.standard_normal(size).astype(np.float32))
    seeds = jnp.asarray(random_seeds(rng))
    got = minmax_gpu.gpu_quantize_feedback(
        update,
        residual,
        0.9,
        seeds,
        chunk=chunk,
        bits=bits,
        stochastic=stochastic,
        target=platforms.Target("gpu", True),
        pack=True,
    )
    codes, lo, unit, error = minmax_feedback.quantize_feedback(
        update,
        residual,
        0.9,
        seeds,
        bits=bits,
        stochastic=stochastic,
        chunk=chunk,
        implementation="xla",
    )
    want = (np_pack(np.asarray(codes).reshape(-1), bits), lo.reshape(-1), unit.reshape(-1), error)
    for g, w in zip(got, want, strict=True):
        same_bits(g, np.asarray(w))


@pytest.mark.parametrize("bits, chunk", [(3, 64), (8, 64), (4, 5)])
def test_gpu_packs_in_pass_only_whole_bytes_of_one_chunk(bits, chunk):
    assert not minmax_gpu.packs_in_pass(bits, chunk)
    with pytest.raises(ValueError, match="one pass"):
        minmax_gpu.gpu_quantize(
            jnp.zeros(64), None, chunk=chunk, bits=bits, stochastic=False, target=None, pack=True
        )
