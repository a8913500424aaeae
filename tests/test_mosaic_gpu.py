"""The Mosaic GPU min-max kernels (kernels_pallas/minmax_mosaic.py) and their use without Triton.

Two checks, both on this CPU-only machine:

* Lowering: each kernel is traced and lowered for CUDA inside an abstract H100
  mesh (as tests/test_lowering.py does) and must become exactly one Mosaic GPU
  custom call, with no interpreted grid loop left.
* Correctness: each kernel runs in Mosaic GPU's interpret mode (its threads and
  memories simulated on CPU) and must match `minmax.quantize_reference` /
  `minmax.dequantize_reference` bit for bit. Interpreting runs the kernel body's
  jnp on XLA CPU, so it checks the kernel's indexing, padding and arithmetic,
  not the GPU's own rounding of each operation.
"""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lpdec
from lpdec.kernels_pallas import minmax
from lpdec.kernels_pallas import minmax_mosaic

pytestmark = pytest.mark.skipif(
    not minmax_mosaic.available(), reason=f"jax {jax.__version__} has no plgpu.kernel"
)
needs_interpret = pytest.mark.skipif(
    not minmax_mosaic.interpret_available(),
    reason=f"jax {jax.__version__} has no Mosaic GPU interpret mode",
)

H100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=None, platform="gpu")
SEEDS = np.array([[0x9E3779B9, 0x7F4A7C15]], np.uint32)
# [rows, chunk]: a multiple of 128 (no padding), a non-power-of-two multiple of 128,
# and a row length that is no multiple of 128 (padded to 1024 in the wrapper).
SHAPES = [(64, 2048), (8, 1152), (40, 1000)]


def lowered(fn, *args) -> str:
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=H100)):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def assert_one_kernel(text: str):
    assert "stablehlo.while" not in text, "an interpreted kernel was lowered"
    assert text.count(minmax_mosaic.CUSTOM_CALL_TARGET) == 1


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_quantize_lowers_to_one_mosaic_gpu_kernel(shape, dtype, stochastic):
    def fn(x, seeds):
        return minmax_mosaic.quantize(x, seeds, bits=8, stochastic=stochastic)

    x = jax.ShapeDtypeStruct(shape, dtype)
    assert_one_kernel(lowered(fn, x, jax.ShapeDtypeStruct((1, 2), jnp.uint32)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_dequantize_lowers_to_one_mosaic_gpu_kernel(shape, dtype):
    scale = jax.ShapeDtypeStruct((shape[0], 1), jnp.float32)
    codes = jax.ShapeDtypeStruct(shape, jnp.uint8)
    fn = lambda c, lo, u: minmax_mosaic.dequantize(c, lo, u, dtype=dtype)  # noqa: E731
    assert_one_kernel(lowered(fn, codes, scale, scale))


@pytest.mark.parametrize("chunk", [1000, 64, 200])
def test_the_kernel_itself_needs_whole_warpgroups(chunk):
    """Only the wrappers take any row length: the kernel wants multiples of 128."""
    assert not minmax_mosaic.lowers(chunk)
    with pytest.raises(ValueError, match="multiple of 128"):
        minmax_mosaic.quantize_kernel(
            jnp.zeros((2, chunk), jnp.float32), SEEDS, bits=8, stochastic=False
        )


def awkward_rows(shape, seed: int = 0) -> np.ndarray:
    """Normal values with a constant row, rows with NaN and inf, and signed zeros."""
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    x[1] = 0.75  # hi == lo: unit 0, codes 0
    x[2, 3] = np.nan
    x[3, -1] = -np.inf
    x[4, ::2] = -0.0
    x[4, 1::2] = 0.0
    x[5] *= 1e30
    return x


def assert_bits_equal(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


@needs_interpret
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_interpreted_quantize_matches_the_reference(shape, stochastic, bits):
    x = jnp.asarray(awkward_rows(shape))
    got = minmax_mosaic.quantize(x, SEEDS, bits=bits, stochastic=stochastic, interpret=True)
    want = minmax.quantize_reference(x, SEEDS, bits=bits, stochastic=stochastic)
    for g, w in zip(got, want, strict=True):
        assert_bits_equal(g, w)


@needs_interpret
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_interpreted_dequantize_matches_the_reference(shape, dtype):
    codes, lo, unit = minmax.quantize_reference(
        jnp.asarray(awkward_rows(shape, seed=1)), SEEDS, bits=8, stochastic=True
    )
    got = minmax_mosaic.dequantize(codes, lo, unit, dtype=dtype, interpret=True)
    assert_bits_equal(got, minmax.dequantize_reference(codes, lo, unit, dtype=dtype))


@needs_interpret
def test_interpreted_kernels_on_a_ragged_array():
    """A flat size that ends in a partial chunk, laid out as minmax.quantize lays it out."""
    chunk, size = 256, 256 * 5 + 37
    x = jnp.asarray(np.random.default_rng(2).standard_normal(size).astype(np.float32))
    rows = -(-size // chunk)
    codes, lo, unit = minmax_mosaic.quantize(
        minmax.as_rows(x, rows, chunk, "edge"), SEEDS, bits=8, stochastic=True, interpret=True
    )
    want = minmax.quantize(x, SEEDS, bits=8, stochastic=True, chunk=chunk, implementation="xla")
    for g, w in zip((minmax.from_rows(codes, x.shape), lo, unit), want, strict=True):
        assert_bits_equal(g, w)
    out = minmax_mosaic.dequantize(
        minmax.as_rows(want[0], rows, chunk, "constant"), lo, unit, interpret=True
    )
    want_x = minmax.dequantize(*want, chunk=chunk, implementation="xla")
    assert_bits_equal(minmax.from_rows(out, x.shape), want_x)


@needs_interpret
@pytest.mark.parametrize(
    "bits, chunk_size, dtype",
    [(8, None, jnp.float32), (4, None, jnp.bfloat16), (2, 1152, jnp.float32)],
    ids=["8-bit", "4-bit bf16", "2-bit chunk 1152"],
)
def test_without_triton_the_interpreted_gpu_encode_is_mosaic_gpu_bit_for_bit(
    monkeypatch, bits, chunk_size, dtype
):
    """A jax without Pallas Triton: `minmax`'s GPU encode, interpreted as the GPU runs
    it (the Mosaic GPU row kernel, then the jnp packing), against the jnp encode."""
    from lpdec.kernels_pallas import platforms

    monkeypatch.setattr(platforms, "pallas_triton", None)
    chunk = lpdec.minmax(bits, chunk_size=chunk_size).chunk_size
    size = 3 * chunk + 37  # a partial last chunk
    x = np.random.default_rng(3).standard_normal(size).astype(np.float32)
    x[chunk : 2 * chunk] = 0.75  # a constant chunk
    x[5] = np.nan
    x[2 * chunk + 1 :: 2] = -0.0
    x[3 * chunk :] = 1.0 + np.abs(x[3 * chunk :])  # padding the last chunk with 0 would show
    x = jnp.asarray(x).astype(dtype)
    seeds = lpdec.kernels_pallas.seeds_from_key(jax.random.key(4))
    gpu = platforms.Target("gpu", True)
    assert minmax.mosaic_quantizes(gpu, 4, chunk, dtype)
    got = jax.jit(
        lambda x: minmax.quantize_on(x, seeds, chunk=chunk, bits=bits, stochastic=True, target=gpu)
    )(x)
    want = minmax.quantize(x, seeds, bits=bits, stochastic=True, chunk=chunk, implementation="xla")
    for g, w in zip(got, want, strict=True):
        assert_bits_equal(g, w)


on_a_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU to compile")


@on_a_gpu
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_compiled_kernels_match_the_reference(shape, stochastic, bits):
    """The same checks compiled for the GPU: its own rounding of each operation."""
    x = jnp.asarray(awkward_rows(shape))
    got = minmax_mosaic.quantize(x, SEEDS, bits=bits, stochastic=stochastic)
    want = minmax.quantize_reference(x, SEEDS, bits=bits, stochastic=stochastic)
    for g, w in zip(got, want, strict=True):
        assert_bits_equal(g, w)
    for dtype in (jnp.float32, jnp.bfloat16):
        assert_bits_equal(
            minmax_mosaic.dequantize(*want, dtype=dtype),
            minmax.dequantize_reference(*want, dtype=dtype),
        )


@on_a_gpu
@pytest.mark.parametrize("bits", [8, 4])
def test_without_triton_the_compiled_compressor_encodes_with_mosaic_gpu(monkeypatch, bits):
    """A jax without Pallas Triton, compiled: `minmax`'s encode and decode against jnp's."""
    from lpdec.kernels_pallas import platforms

    monkeypatch.setattr(platforms, "pallas_triton", None)
    x = jnp.asarray(awkward_rows((64, 2048)).reshape(-1)[: 64 * 2048 - 37])
    key = jax.random.key(5)
    got = jax.jit(lambda x: lpdec.minmax(bits, "stochastic").encode(x, key))(x)
    want = jax.jit(lambda x: lpdec.minmax(bits, "stochastic", implementation="xla").encode(x, key))(
        x
    )
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert_bits_equal(g, w)


def test_import_lpdec_leaves_mosaic_gpu_unimported():
    """Mosaic GPU's modules load on first use (half a second of every process's start on
    jax 0.12): a fresh `import lpdec` does not load them."""
    heavy = ["jax.experimental.pallas.mosaic_gpu", "jax._src.pallas.mosaic_gpu.lowering"]
    code = f"import sys, lpdec; print([m for m in {heavy} if m in sys.modules])"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]", out.stdout
