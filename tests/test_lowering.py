"""Every kernel the public API reaches lowers to a compiled kernel for CUDA and TPU.

The programs are traced on this CPU-only machine and lowered with
`lowering_platforms=("cuda",)` or `("tpu",)`: no accelerator is needed to see
which implementation each platform gets (`lpdec.kernels_pallas.platforms.dispatch`).
A compiled Pallas kernel lowers to one custom call (Triton's on CUDA, Mosaic's on
TPU). An interpreted kernel lowers to an XLA while loop over its grid and no custom
call, so each check also asserts that no `stablehlo.while` is left
(`test_an_interpreted_kernel_fails_the_check` shows the check catches it). Where a
platform's compiler cannot take a kernel's blocks, the dispatch picks the jnp
path for that platform, and the tests below pin those choices.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.experimental.pallas import triton as pallas_triton

import lpdec
from lpdec import gossip
from lpdec.kernels_pallas import bitpack
from lpdec.kernels_pallas import minmax as minmax_kernels
from lpdec.kernels_pallas import platforms

PLATFORMS = ("cuda", "tpu")
# jax 0.11 names the Triton custom call's target; jax 0.10 emits this one.
_TRITON = getattr(pallas_triton, "CUSTOM_CALL_TARGET_NAME", "__gpu$xla.gpu.triton")
CUSTOM_CALL = {"cuda": _TRITON, "tpu": "tpu_custom_call"}
KEY = jax.random.key(0)


# From jax 0.12 the Triton lowering asks the device it lowers for which GPU it targets,
# and this machine has none: the target is named as an abstract device, set while the
# program is traced and lowered (a context set around `.lower()` alone is not seen).
# jax 0.10 needs no context (with no GPU it falls back to compute capability 9.0, an
# H100's) and accepts it, so every supported jax lowers for the same target.
ABSTRACT_DEVICE = {
    "cuda": jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=None, platform="gpu")
}


def trace(fn, *args):
    """A program to lower: `fn` and the abstract values it is traced with."""
    return fn, args


def lowered_text(program, platform: str) -> str:
    """`program` traced and lowered for `platform` (StableHLO text)."""
    fn, args = program
    device = ABSTRACT_DEVICE.get(platform)
    context = contextlib.nullcontext()
    if device is not None:
        mesh = jax.sharding.AbstractMesh((), (), abstract_device=device)
        context = jax.sharding.use_abstract_mesh(mesh)
    with context:
        return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def kernel_calls(program, platform: str) -> int:
    """Compiled kernels in `program` lowered for `platform`; fails on an interpreted one."""
    text = lowered_text(program, platform)
    assert "stablehlo.while" not in text, f"an interpreted kernel was lowered for {platform}"
    return text.count(CUSTOM_CALL[platform])


def assert_kernels(traced, expected: dict[str, int]):
    for platform, count in expected.items():
        assert kernel_calls(traced, platform) == count, platform


# The kernel block is 2**16 elements on TPU (2**12 on GPU) and a chunk 2048: the
# first size fills whole blocks of every kernel, the second ends in a partial chunk
# and a partial block.
SIZES = [2048 * 64, 2048 * 40 + 37]


@pytest.mark.parametrize("implementation", [None, "pallas"])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("size", SIZES)
def test_minmax_compressor_lowers_to_kernels(implementation, bits, dtype, size):
    comp = lpdec.minmax(bits, "stochastic", implementation=implementation)
    x = jax.ShapeDtypeStruct((size,), dtype)
    acc = jax.ShapeDtypeStruct((size,), jnp.float32)
    packing = int(bits < 8)  # 8-bit codes are their own bytes
    encode = trace(lambda x: comp.encode(x, KEY), x)
    # TPU: quantize (+ pack); GPU: widths dividing 8 pack as they quantize (one pass).
    assert_kernels(encode, {"cuda": 1, "tpu": 1 + packing})
    payload = jax.eval_shape(lambda x: comp.encode(x, KEY), x)
    decode = trace(comp.decode, payload)
    assert_kernels(decode, {p: packing + 1 for p in PLATFORMS})  # (unpack +) dequantize
    accumulate = trace(lambda p, a: comp.decode_accumulate(p, a, 0.5), payload, acc)
    assert_kernels(accumulate, {p: packing + 1 for p in PLATFORMS})


@pytest.mark.parametrize("implementation", [None, "pallas"])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("size", [1024 * 128, 1024 * 80 + 37])
def test_modulo_compressor_lowers_to_kernels(implementation, bits, dtype, size):
    """Moniqua's quantizer: the encode kernel and bit packing; decoding only unpacks."""
    rounding = "nearest" if bits == 1 else "stochastic"
    comp = lpdec.modulo(bits, theta=0.5, rounding=rounding, implementation=implementation)
    x = jax.ShapeDtypeStruct((size,), dtype)
    packing = int(bits < 8)
    encode = trace(lambda x: comp.encode(x, KEY), x)
    assert_kernels(encode, {p: 1 + packing for p in PLATFORMS})
    payload = jax.eval_shape(lambda x: comp.encode(x, KEY), x)
    decode = trace(lambda p, y: comp.decode(p, reference=y), payload, x)
    assert_kernels(decode, {p: packing for p in PLATFORMS})
    # The GPU kernels take the ragged array as it is (masked loads), unpadded.
    assert "stablehlo.pad" not in lowered_text(encode, "cuda")


@pytest.mark.parametrize("implementation", [None, "pallas"])
@pytest.mark.parametrize("fmt", ["fp4", "fp8"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("size", [32 * 4096, 32 * 1000 + 7])
def test_mx_compressor_lowers_to_kernels(implementation, fmt, dtype, size):
    """Every size compiles on both platforms. The GPU kernels take the flat arrays
    (`mx_gpu`): one launch per op, E2M1 codes packed and unpacked in it; TPU's
    [rows, 32] kernels pack and unpack in launches of their own."""
    comp = lpdec.mx(fmt, "stochastic", implementation=implementation)
    x = jax.ShapeDtypeStruct((size,), dtype)
    acc = jax.ShapeDtypeStruct((size,), jnp.float32)
    packing = int(fmt == "fp4")
    assert_kernels(trace(lambda x: comp.encode(x, KEY), x), {"cuda": 1, "tpu": 1 + packing})
    payload = jax.eval_shape(lambda x: comp.encode(x, KEY), x)
    assert_kernels(trace(comp.decode, payload), {"cuda": 1, "tpu": packing + 1})
    accumulate = trace(lambda p, a: comp.decode_accumulate(p, a, 0.5), payload, acc)
    assert_kernels(accumulate, {"cuda": 1, "tpu": packing + 1})


@pytest.mark.parametrize("fmt", ["fp4", "fp8"])
def test_mx_gpu_kernels_take_a_ragged_array_as_it_is(fmt):
    """No padded copy in and no sliced copy out around the GPU kernels (nearest
    rounding: the key's bits would bring slices of their own)."""
    comp = lpdec.mx(fmt)
    size = 32 * 1000 + 7  # neither whole blocks nor whole grid steps
    x = jax.ShapeDtypeStruct((size,), jnp.bfloat16)
    payload = jax.eval_shape(comp.encode, x)
    programs = [
        trace(comp.encode, x),
        trace(comp.decode, payload),
        trace(lambda p, a: comp.decode_accumulate(p, a, 0.5), payload, x),
    ]
    for program in programs:
        text = lowered_text(program, "cuda")
        assert "stablehlo.pad" not in text and "stablehlo.slice" not in text
        assert text.count(CUSTOM_CALL["cuda"]) == 1


def test_the_cpu_lowering_keeps_the_jnp_path():
    comp = lpdec.minmax(4)
    x = jax.ShapeDtypeStruct((SIZES[1],), jnp.float32)
    text = lowered_text(trace(comp.encode, x), "cpu")
    assert "custom_call" not in text and "stablehlo.while" not in text


# ----------------------------------------------------------------------------
# Where a platform cannot compile a kernel, its jnp path is chosen explicitly.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [3, 5, 6, 7])
def test_gpu_packs_odd_bit_widths_with_its_kernel(bits):
    """A [G, bits] byte block is no Triton block: the GPU kernels address flat arrays."""
    comp = lpdec.minmax(bits)
    x = jax.ShapeDtypeStruct((SIZES[1],), jnp.float32)
    assert bitpack.pack_lowers(platforms.Target("gpu"), SIZES[1] // 8, bits)
    assert_kernels(trace(comp.encode, x), {"cuda": 2, "tpu": 2})  # quantize, then pack
    payload = jax.eval_shape(comp.encode, x)
    assert_kernels(trace(comp.decode, payload), {"cuda": 2, "tpu": 2})
    assert "stablehlo.pad" not in lowered_text(trace(comp.encode, x), "cuda")


@pytest.mark.parametrize("size, chunk_size", [(1000, None), (1000 * 7 + 13, 1000), (4099, 2048)])
def test_gpu_quantizes_any_chunk_and_size_with_its_kernel(size, chunk_size):
    """Chunks that are not a power of two, and ragged sizes, compile on GPU and TPU alike.

    The GPU kernels address the flat array with masked loads and stores
    (`minmax_gpu.gpu_quantize`), so neither needs the jnp path or a padded copy.
    """
    comp = lpdec.minmax(8, chunk_size=chunk_size)
    x = jax.ShapeDtypeStruct((size,), jnp.float32)
    chunk = min(comp.chunk_size, size)
    rows = -(-size // chunk)
    assert minmax_kernels.quantize_lowers(platforms.Target("gpu"), rows, chunk, jnp.float32)
    assert_kernels(trace(comp.encode, x), {"cuda": 1, "tpu": 1})
    payload = jax.eval_shape(comp.encode, x)
    assert_kernels(trace(comp.decode, payload), {"cuda": 1, "tpu": 1})
    text = lowered_text(trace(comp.encode, x), "cuda")
    assert "stablehlo.pad" not in text  # the flat array goes to the kernel as it is


F32, BF16, U8 = jnp.float32, jnp.bfloat16, jnp.uint8


@pytest.mark.parametrize(
    "platform, block, shape, dtype, lowers",
    [
        # Triton: every block extent a power of two.
        ("gpu", (4, 2048), (64, 2048), F32, True),
        ("gpu", (1, 1), (1, 1), F32, True),
        ("gpu", (4, 1000), (4, 1000), F32, False),
        ("gpu", (256, 3), (512, 3), U8, False),
        # Mosaic: last two dims multiples of the (rows, 128) tile, or the whole dim.
        ("tpu", (8, 128), (64, 128), F32, True),
        ("tpu", (8, 128), (64, 128), BF16, False),
        ("tpu", (16, 256), (64, 256), BF16, True),
        ("tpu", (16, 256), (64, 256), U8, False),
        ("tpu", (32, 256), (64, 256), U8, True),
        ("tpu", (5, 1000), (5, 1000), U8, True),
        ("tpu", (8, 64), (8, 128), F32, False),
        ("tpu", (4096, 3), (8192, 3), U8, True),
        ("cpu", (3, 5), (7, 9), U8, True),  # interpreted: anything
    ],
)
def test_block_rules(platform, block, shape, dtype, lowers):
    assert platforms.Target(platform).lowers((block, shape, dtype)) == lowers


def test_tpu_blocks_are_whole_tiles():
    """A 16384-element chunk makes 4-row blocks; TPU rounds them up to 32 rows (uint8 tiles)."""
    comp = lpdec.minmax(1, chunk_size=16384)
    size = 16384 * 40 + 5
    assert platforms.Target("tpu").block_rows(41, 16384, (jnp.uint8,)) == 32
    x = jax.ShapeDtypeStruct((size,), jnp.float32)
    assert_kernels(trace(comp.encode, x), {"cuda": 1, "tpu": 2})


@pytest.mark.parametrize(
    "bits, chunk_size, mosaic_kernels",
    [(8, None, 1), (4, None, 1), (8, 1000, 0), (1, None, 0)],
    ids=["8-bit", "4-bit", "chunk 1000", "1-bit chunk 16384"],
)
def test_without_pallas_triton_the_gpu_quantizes_with_mosaic_gpu(
    monkeypatch, bits, chunk_size, mosaic_kernels
):
    """A jax without the Triton lowering (deprecated from 0.11) quantizes with the Mosaic
    GPU row kernel (`minmax.mosaic_quantizes`): chunks of whole warpgroups up to 4096
    elements; other chunks, the bit packing and the decode take the jnp path."""
    from lpdec.kernels_pallas import minmax_mosaic

    if not minmax_mosaic.available():
        pytest.skip(f"jax {jax.__version__} has no plgpu.kernel")
    monkeypatch.setattr(platforms, "pallas_triton", None)
    comp = lpdec.minmax(bits, "stochastic", chunk_size=chunk_size)
    x = jax.ShapeDtypeStruct((SIZES[1],), jnp.float32)
    text = lowered_text(trace(lambda x: comp.decode(comp.encode(x, KEY)), x), "cuda")
    assert "stablehlo.while" not in text
    assert text.count(minmax_mosaic.CUSTOM_CALL_TARGET) == mosaic_kernels
    assert _TRITON not in text
    tpu = kernel_calls(trace(lambda x: comp.encode(x, KEY), x), "tpu")
    assert tpu >= 1  # TPU keeps its kernels


@pytest.mark.parametrize("bits, kernels", [(4, 1), (1, 1), (8, 1), (3, 2)])
def test_gpu_error_feedback_is_one_pass_where_codes_pack_in_it(bits, kernels):
    """Error feedback reads update and residual once; widths dividing 8 also pack there."""
    comp = lpdec.minmax(bits, "stochastic")
    x = jax.ShapeDtypeStruct((SIZES[1],), jnp.float32)
    program = trace(lambda u, e: comp.encode_feedback(u, e, KEY), x, x)
    assert kernel_calls(program, "cuda") == kernels


def test_gpu_backend_is_the_measured_choice():
    """Triton on every supported jax: the choice BENCHMARKS.md's GPU section measured.

    On an H100 (jax 0.11.2) the Mosaic GPU row kernels ran as fast as Triton's and
    bit-exact, but only Triton has every kernel (flat arrays, many leaves, error
    feedback, MX, bit packing); a jax without it quantizes with Mosaic GPU (test above).
    Changing the GPU backend means measuring again and changing this test.
    """
    from lpdec.kernels_pallas import minmax_mosaic

    assert platforms.pallas_triton is not None, f"jax {jax.__version__} has no Pallas Triton"
    x = jax.ShapeDtypeStruct((SIZES[1],), jnp.float32)
    comp = lpdec.minmax(8, "stochastic")
    text = lowered_text(trace(lambda x: comp.encode(x, KEY), x), "cuda")
    assert text.count(_TRITON) == 1
    assert minmax_mosaic.CUSTOM_CALL_TARGET not in text


def test_gpu_warps_default_by_block_size_and_a_target_can_override_them():
    """The dispatch's Triton warps (8 for blocks of >= 4096 elements, else 4), and
    `Target.num_warps`, which `bench/gpu_kernels.py --parts tune` sweeps."""
    if platforms.pallas_triton is None:
        pytest.skip(f"jax {jax.__version__} has no Pallas Triton")
    gpu = platforms.Target("gpu")
    assert gpu.compiler_params(4096).num_warps == 8
    assert gpu.compiler_params(2048).num_warps == 4
    assert platforms.Target("gpu", num_warps=16).compiler_params(2048).num_warps == 16


def test_an_interpreted_kernel_fails_the_check():
    """Interpreting (what the old default-backend dispatch did on CPU) is caught."""
    x = jax.ShapeDtypeStruct((64, 2048), jnp.float32)
    traced = trace(
        lambda x: minmax_kernels.quantize(
            x, bits=8, stochastic=False, implementation="pallas", interpret=True
        ),
        x,
    )
    for platform in PLATFORMS:
        with pytest.raises(AssertionError, match="interpreted kernel"):
            kernel_calls(traced, platform)
        text = lowered_text(traced, platform)
        assert CUSTOM_CALL[platform] not in text


# ----------------------------------------------------------------------------
# One full CHOCO step, as the library runs it.
# ----------------------------------------------------------------------------

N = 8


def choco_step(implementation):
    comp = lpdec.minmax(4, "stochastic", implementation=implementation)
    tx = lpdec.choco(lpdec.ring(N), comp, gamma=0.5, axis_name="nodes")

    def step(params, grads):
        state = tx.init(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


def choco_params():
    return {
        "w": jax.ShapeDtypeStruct((N, 2048 * 3 + 100), jnp.float32),
        "b": jax.ShapeDtypeStruct((N, 64), jnp.bfloat16),
    }


@pytest.mark.parametrize("implementation", [None, "pallas"])
def test_choco_step_under_vmap_lowers_to_kernels(implementation):
    step = jax.vmap(choco_step(implementation), axis_name="nodes")
    traced = trace(step, choco_params(), choco_params())
    for platform in PLATFORMS:
        assert kernel_calls(traced, platform) > 0
    assert "custom_call" not in lowered_text(traced, "cpu")


def test_choco_step_under_shard_map_lowers_to_kernels():
    """Sharded over 8 devices of each platform: an abstract mesh that names the device
    (ahead-of-time lowering, so no devices are needed, on CPU or on a 1-GPU machine;
    inside shard_map its mesh's device is the one lowered for)."""
    step = choco_step(None)

    def program(params, grads):
        first = lambda tree: jax.tree.map(lambda x: x[0], tree)  # noqa: E731
        out = gossip.to_varying(step(first(params), first(grads)), "nodes")
        return jax.tree.map(lambda x: x[None], out)

    spec = jax.P("nodes")
    counts = {}
    for platform in PLATFORMS:
        mesh = jax.sharding.AbstractMesh(
            (N,),
            ("nodes",),
            axis_types=(jax.sharding.AxisType.Explicit,),  # jax.make_mesh's, on any jax
            abstract_device=ABSTRACT_DEVICE.get(platform),
        )
        sharded = jax.shard_map(program, mesh=mesh, in_specs=(spec, spec), out_specs=spec)
        params = {
            k: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=jax.NamedSharding(mesh, spec))
            for k, s in choco_params().items()
        }
        counts[platform] = kernel_calls(trace(sharded, params, params), platform)
    assert all(np.array(list(counts.values())) > 0), counts


def test_a_whole_tree_quantizes_in_one_gpu_launch():
    """encode_tree of a model's leaves: one quantize kernel on GPU (8-bit codes need no packing).

    Leaves of every kind (a 1000-element chunk, a ragged size, a scalar bias) share it.
    """
    comp = lpdec.minmax(8, "stochastic")
    tree = {
        "embed": jax.ShapeDtypeStruct((256, 64), jnp.float32),
        "w": [jax.ShapeDtypeStruct((64, 192), jnp.float32) for _ in range(4)],
        "b": [jax.ShapeDtypeStruct((1000,), jnp.float32), jax.ShapeDtypeStruct((7,), jnp.bfloat16)],
        "scale": jax.ShapeDtypeStruct((), jnp.float32),
    }
    encode = trace(lambda t: lpdec.compress.encode_tree(comp, t, KEY), tree)
    assert kernel_calls(encode, "cuda") == 1
    assert kernel_calls(encode, "tpu") > 1  # TPU keeps one launch per leaf


@pytest.mark.parametrize("bits, cuda_kernels", [(1, 2), (2, 2), (4, 2), (8, 2), (3, 2 + 7)])
def test_a_packed_tree_is_one_gpu_launch_per_dtype(bits, cuda_kernels):
    """`tree_layout="packed"`: the float32 leaves in one buffer, the bfloat16 leaf in
    another, one flat kernel each that packs 1, 2 and 4 bits in its pass (8-bit codes
    are their bytes); 3 bits packs each leaf's codes after it (7 leaves)."""
    comp = lpdec.minmax(bits, "stochastic", tree_layout="packed")
    tree = {
        "embed": jax.ShapeDtypeStruct((256, 64), jnp.float32),
        "w": [jax.ShapeDtypeStruct((64, 192), jnp.float32) for _ in range(2)],
        "b": [jax.ShapeDtypeStruct((1000,), jnp.float32), jax.ShapeDtypeStruct((7,), jnp.bfloat16)],
        "scale": jax.ShapeDtypeStruct((), jnp.float32),
        "ragged": jax.ShapeDtypeStruct((2048 * 3 + 37,), jnp.float32),
    }
    encode = trace(lambda t: lpdec.compress.encode_tree(comp, t, KEY), tree)
    assert kernel_calls(encode, "cuda") == cuda_kernels
    assert kernel_calls(encode, "tpu") > cuda_kernels  # TPU encodes leaf by leaf
    assert "custom_call" not in lowered_text(encode, "cpu")
