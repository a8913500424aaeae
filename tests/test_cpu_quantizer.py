"""The blocked CPU quantizer (`quantize_blocked`) against the [rows, chunk] references.

`quantize_blocked` walks a flat array in blocks of whole chunks, shifts the last
full block back onto already-quantized chunks and quantizes a short last chunk
on its own. Each test picks sizes that put a chunk of interest on one of those
seams and compares every output bit with `quantize_reference` on the
edge-padded [rows, chunk] view (the layout the Pallas kernels see) and, for
finite inputs, with the independent numpy reference of test_kernels.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_kernels import np_minmax_quantize
from test_kernels import random_seeds
from test_kernels import same_bits

import lpdec
from lpdec.kernels_pallas import bitpack
from lpdec.kernels_pallas import minmax


def padded_view(flat, chunk):
    """Edge-padded [rows, chunk] view: the short last chunk keeps its min and max."""
    d = flat.shape[0]
    rows = -(-d // chunk)
    return jnp.pad(flat, (0, rows * chunk - d), mode="edge").reshape(rows, chunk)


def blocked(flat, seeds, *, chunk, bits, stochastic, block_elements):
    fn = jax.jit(
        minmax.quantize_blocked,
        static_argnames=("chunk", "bits", "stochastic", "block_elements"),
    )
    return fn(
        flat, seeds, chunk=chunk, bits=bits, stochastic=stochastic, block_elements=block_elements
    )


def assert_matches_reference(flat, seeds, *, chunk, bits, stochastic, block_elements):
    codes, lo, unit = blocked(
        flat, seeds, chunk=chunk, bits=bits, stochastic=stochastic, block_elements=block_elements
    )
    ref_codes, ref_lo, ref_unit = minmax.quantize_reference(
        padded_view(flat, chunk), seeds, bits=bits, stochastic=stochastic
    )
    d = flat.shape[0]
    same_bits(codes, ref_codes.reshape(-1)[:d])
    same_bits(lo, ref_lo.reshape(-1))
    same_bits(unit, ref_unit.reshape(-1))
    return codes, lo, unit


# (chunks, short last chunk, chunks per block): a block count that divides the
# chunks, one that does not (the last block is shifted back), a short chunk after
# either, and a single partial block.
LAYOUTS = [(12, 0, 3), (11, 0, 3), (11, 17, 3), (12, 1, 4), (2, 5, 8), (7, 0, 1)]


@pytest.mark.parametrize("chunks,short,block_chunks", LAYOUTS)
@pytest.mark.parametrize("bits", [1, 4, 8])
@pytest.mark.parametrize("stochastic", [False, True])
def test_blocks_match_references(rng, chunks, short, block_chunks, bits, stochastic):
    chunk = 64
    d = chunks * chunk + short
    # Each chunk gets its own offset and spread, so a chunk quantized with another
    # chunk's scales (a misplaced block) cannot give the right codes.
    scale = np.repeat(rng.uniform(0.1, 10, chunks + 1), chunk)[:d]
    offset = np.repeat(rng.uniform(-5, 5, chunks + 1), chunk)[:d]
    x = (rng.standard_normal(d) * scale + offset).astype(np.float32)
    seeds = jnp.asarray(random_seeds(rng)) if stochastic else None
    codes, lo, unit = assert_matches_reference(
        jnp.asarray(x),
        seeds,
        chunk=chunk,
        bits=bits,
        stochastic=stochastic,
        block_elements=block_chunks * chunk,
    )
    rows = -(-d // chunk)
    padded = np.pad(x, (0, rows * chunk - d), mode="edge").reshape(rows, chunk)
    np_seeds = np.asarray(seeds) if stochastic else None
    np_codes, np_lo, np_unit = np_minmax_quantize(padded, np_seeds, bits, stochastic)
    np.testing.assert_array_equal(np.asarray(codes), np_codes.reshape(-1)[:d])
    np.testing.assert_array_equal(np.asarray(lo), np_lo.reshape(-1))
    np.testing.assert_array_equal(np.asarray(unit), np_unit.reshape(-1))


@pytest.mark.parametrize("block_elements", [1, 100, 200])
def test_chunk_larger_than_block_is_one_chunk_per_block(rng, block_elements):
    chunk, d = 256, 256 * 5 + 31
    x = jnp.asarray(rng.standard_normal(d), jnp.float32)
    seeds = jnp.asarray(random_seeds(rng))
    assert_matches_reference(
        x, seeds, chunk=chunk, bits=8, stochastic=True, block_elements=block_elements
    )


@pytest.mark.parametrize("d", [0, 1, 5, 63])
def test_less_than_one_chunk(rng, d):
    x = jnp.asarray(rng.standard_normal(d), jnp.float32)
    if d == 0:
        codes, lo, unit = blocked(x, None, chunk=64, bits=8, stochastic=False, block_elements=128)
        assert codes.shape == (0,) and lo.shape == (0,) and unit.shape == (0,)
        return
    assert_matches_reference(x, None, chunk=64, bits=8, stochastic=False, block_elements=128)


@pytest.mark.parametrize("bits", [2, 8])
def test_non_finite_and_signed_zero_chunks_in_later_blocks(rng, bits):
    """NaN, +-Inf and -0 chunks in the second and the shifted last block, and in the short chunk."""
    chunk, chunks, short = 32, 10, 9
    d = chunks * chunk + short
    x = rng.standard_normal(d).astype(np.float32)
    x[4 * chunk + 3] = np.nan  # second block
    x[5 * chunk + 7] = -np.inf
    x[6 * chunk : 7 * chunk] = -0.0  # an all -0 chunk
    x[7 * chunk + 1] = np.inf  # the shifted last block
    x[8 * chunk : 9 * chunk] = np.where(rng.uniform(size=chunk) < 0.5, -0.0, 0.0)
    x[9 * chunk + 2] = -np.nan  # the last full chunk
    x[chunks * chunk + 4] = np.nan  # the short chunk
    seeds = jnp.asarray(random_seeds(rng))
    for stochastic in (False, True):
        _, lo, unit = assert_matches_reference(
            jnp.asarray(x),
            seeds if stochastic else None,
            chunk=chunk,
            bits=bits,
            stochastic=stochastic,
            block_elements=4 * chunk,
        )
        finite = np.isfinite(np.asarray(lo)) & np.isfinite(np.asarray(unit))
        expected = np.ones(chunks + 1, bool)
        expected[[4, 5, 7, 9, 10]] = False
        np.testing.assert_array_equal(finite, expected)
        # -0 sorts below +0: a chunk of -0s has lo = -0, a mixed one lo = -0 too.
        assert np.signbit(np.asarray(lo)[6]) and np.signbit(np.asarray(lo)[8])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_input(rng, dtype):
    chunk, d = 64, 64 * 9 + 13
    x = jnp.asarray(rng.standard_normal(d) * 3, dtype)
    seeds = jnp.asarray(random_seeds(rng))
    for stochastic in (False, True):
        assert_matches_reference(
            x, seeds, chunk=chunk, bits=8, stochastic=stochastic, block_elements=2 * chunk
        )


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("shape", [(3, 250_000), (700_001,)])
def test_compressor_cpu_encode_takes_several_blocks(rng, rounding, shape):
    """The public encode on CPU, with a chunk size that makes several default-sized blocks."""
    chunk_size = 64
    assert np.prod(shape) > 2 * minmax.BLOCK_ELEMENTS  # a shifted last block, a short chunk
    x = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    key = jax.random.key(int(rng.integers(1 << 30)))
    comp = lpdec.minmax(8, rounding, chunk_size, implementation="xla")
    payload = jax.jit(comp.encode)(x, key)
    seeds = jax.random.bits(key, (1, 2), jnp.uint32)
    codes, lo, unit = minmax.quantize_reference(
        padded_view(x.reshape(-1), chunk_size), seeds, bits=8, stochastic=rounding == "stochastic"
    )
    d = x.size
    same_bits(bitpack.unpack_bits(payload.codes, bits=8, num_elements=d), codes.reshape(-1)[:d])
    same_bits(payload.lo, lo.reshape(-1))
    same_bits(payload.unit, unit.reshape(-1))
