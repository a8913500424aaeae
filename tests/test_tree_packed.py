"""The packed-tree min-max encode (`lpdec.kernels_pallas.minmax_tree`) against leaf-by-leaf encode.

The GPU kernel runs interpreted as the GPU builds it (`Target("gpu", interpret=True)`):
the leaves packed into one buffer of whole chunks, one flat kernel with a row
table of (leaf start, leaf end, seeds). Its payloads must be the bytes of
`minmax.encode` of each leaf alone with the key `encode_tree` gives it. Its
lowering for CUDA is pinned in tests/test_lowering.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lpdec
from lpdec import compress
from lpdec.kernels_pallas import minmax_tree
from lpdec.kernels_pallas import platforms

# Interpreted here; compiled on a GPU machine (bench/gpu_session.sh runs this file there).
GPU = platforms.Target("gpu", interpret=jax.default_backend() != "gpu")
CHUNK = 256  # smaller than the matrices, larger than the biases


def gpt_like_tree(rng) -> dict:
    """A small decoder's leaves: chunk multiples, ragged sizes, sizes below a chunk,
    sizes that are no multiple of a byte's codes, a scalar, an empty leaf, bf16 and f16."""
    f32 = {
        "embed": (40, 16),  # 640: two chunks and a ragged half
        "pos": (16, 16),  # exactly one chunk
        "qkv": (16, 48),  # three chunks
        "qkv_b": (48,),
        "up": (16, 63),  # 1008: ragged, not a multiple of 8
        "up_b": (63,),
        "odd": (7,),
        "scale": (),
        "empty": (0,),
    }
    tree = {k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in f32.items()}
    tree["constant"] = jnp.full((300,), 0.25, jnp.float32)  # unit 0 in both chunks
    tree["down_bf16"] = jnp.asarray(rng.standard_normal((33, 9)), jnp.bfloat16)
    tree["ln_f16"] = jnp.asarray(rng.standard_normal(5), jnp.float16)
    return tree


def leaf_by_leaf(comp, tree, key):
    """What `encode_tree` must equal: `encode` of each leaf with its split key."""
    leaves, treedef = jax.tree.flatten(tree)
    keys = list(jax.random.split(key, len(leaves)))
    encoded = jax.jit(lambda xs, ks: [comp.encode(x, k) for x, k in zip(xs, ks, strict=True)])
    return treedef.unflatten(encoded(leaves, keys))


def assert_same_payloads(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    static = lambda t: [(p.shape, p.dtype) for p in jax.tree.leaves(t, is_leaf=is_payload)]  # noqa: E731
    assert static(got) == static(want)


def is_payload(x) -> bool:
    return isinstance(x, lpdec.compress.minmax_quantizer.MinMaxPayload)


@pytest.mark.parametrize(
    "bits, rounding",
    [(b, r) for b in (1, 2, 4, 8) for r in ("nearest", "stochastic")]
    + [(3, "stochastic"), (5, "nearest")],
)
def test_packed_kernel_is_leaf_by_leaf_encode(rng, bits, rounding):
    """Every width (1, 2, 4 pack in the kernel's pass; 3, 5 and 8 after it), both roundings."""
    tree = gpt_like_tree(rng)
    comp = lpdec.minmax(bits, rounding, chunk_size=CHUNK)
    key = jax.random.key(7)
    want = leaf_by_leaf(comp, tree, key)
    leaves, treedef = jax.tree.flatten(tree)
    seeds = jnp.zeros((len(leaves), 2), jnp.uint32)
    if comp.needs_key:
        seeds = jnp.concatenate(
            [lpdec.kernels_pallas.seeds_from_key(k) for k in jax.random.split(key, len(leaves))]
        )
    got = jax.jit(
        lambda xs, s: minmax_tree.quantize_tree_packed_on(
            xs, s, chunk=CHUNK, bits=bits, stochastic=comp.needs_key, target=GPU
        )
    )(leaves, seeds)
    for (codes, lo, unit), w in zip(got, jax.tree.leaves(want, is_leaf=is_payload), strict=True):
        assert lo.shape == unit.shape == (w.lo.size, 1)
        assert_same_payloads([codes, lo.reshape(-1), unit.reshape(-1)], [w.codes, w.lo, w.unit])


def test_encode_tree_with_the_packed_layout_runs_the_gpu_kernel(rng, monkeypatch):
    """`minmax(tree_layout="packed")` through `encode_tree`, with the dispatch made to pick
    the interpreted GPU kernel: the payload tree of leaf-by-leaf encode, bit for bit."""
    tree = gpt_like_tree(rng)
    key = jax.random.key(3)
    comp = lpdec.minmax(4, "stochastic", chunk_size=CHUNK, tree_layout="packed")
    want = leaf_by_leaf(comp, tree, key)
    calls = []

    def on_the_gpu(implementation, body, *args, interpret=False):
        del implementation, interpret
        calls.append(getattr(body, "func", body).__name__)
        return body(*args, target=GPU)

    monkeypatch.setattr(platforms, "dispatch", on_the_gpu)
    got = jax.jit(lambda t: compress.encode_tree(comp, t, key))(tree)
    assert calls == ["quantize_tree_packed_on"]
    assert_same_payloads(got, want)


def test_the_packed_layout_is_leaf_by_leaf_off_the_gpu(rng):
    """On CPU both layouts encode leaf by leaf: the same payloads as `encode`."""
    tree = gpt_like_tree(rng)
    key = jax.random.key(5)
    for layout in lpdec.compress.minmax_quantizer.TREE_LAYOUTS:
        comp = lpdec.minmax(2, "stochastic", chunk_size=CHUNK, tree_layout=layout)
        got = jax.jit(lambda t, c=comp: compress.encode_tree(c, t, key))(tree)
        assert_same_payloads(got, leaf_by_leaf(comp, tree, key))


def test_buffers_split_by_dtype_and_skip_empty_leaves():
    xs = [
        jax.ShapeDtypeStruct(s, d)
        for s, d in [
            ((300,), jnp.float32),
            ((5,), jnp.bfloat16),
            ((0,), jnp.float32),
            ((), jnp.float32),
            ((9,), jnp.bfloat16),
        ]
    ]
    assert minmax_tree.packed_buffers(xs, CHUNK, GPU) == [[0, 3], [1, 4]]
    assert minmax_tree.packed_buffers(xs, CHUNK, platforms.Target("tpu", True)) == []
    assert minmax_tree.packed_buffers(xs, CHUNK, None) == []


def test_a_buffer_past_int32_offsets_starts_another(monkeypatch):
    """Each buffer stays below the kernel's 2**31 elements (here a 1000-element limit)."""
    from lpdec.kernels_pallas import minmax_gpu

    monkeypatch.setattr(minmax_gpu, "lowers", lambda size: size < 1000)
    xs = [jax.ShapeDtypeStruct((n,), jnp.float32) for n in (600, 300, 10, 700, 2000)]
    # Padded to 256: 768, 512, 256, 768; 2048 fits no buffer and is encoded alone.
    assert minmax_tree.packed_buffers(xs, CHUNK, GPU) == [[0], [1, 2], [3]]


@pytest.mark.parametrize("bad", [{"tree_layout": "flat"}, {"tree_layout": None}])
def test_minmax_rejects_unknown_tree_layouts(bad):
    with pytest.raises(ValueError, match="tree_layout"):
        lpdec.minmax(4, **bad)


@pytest.mark.parametrize("chunk", [0, 2.0, True])
def test_quantize_tree_packed_rejects_bad_chunks(chunk):
    x = jnp.ones(3)
    with pytest.raises(ValueError, match="chunk"):
        lpdec.kernels_pallas.minmax_quantize_tree_packed(
            [x], jnp.zeros((1, 2), jnp.uint32), bits=4, stochastic=False, chunk=chunk
        )


def test_train_py_chooses_the_tree_layout_by_config_and_refuses_a_bad_one():
    import pathlib  # noqa: PLC0415
    import sys  # noqa: PLC0415

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
    from configs import default  # noqa: PLC0415
    from train_lib import ConfigError  # noqa: PLC0415
    from train_lib import registry  # noqa: PLC0415
    from train_lib import tables  # noqa: PLC0415

    config = default.get_config()
    config.update(compressor="minmax", bits=4, tree_layout="packed")
    built = tables.build(config, "compressor", registry.COMPRESSORS)
    assert built == lpdec.minmax(4, tree_layout="packed")
    config.tree_layout = "flat"
    with pytest.raises(ConfigError, match="tree_layout must be one of") as info:
        tables.build(config, "compressor", registry.COMPRESSORS)
    assert "\n" not in str(info.value)
