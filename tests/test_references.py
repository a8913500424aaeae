"""What the dense-simulation references share, written here rather than imported from lpdec.

A reference that re-draws a node's randomness (stochastic rounding, random-k
positions) must use the node's own random bits to follow its trajectory bit for
bit, so it cannot be independent of *which* key a node uses. What it can avoid
is deriving that key with the library's code: `node_key` and `leaf_keys` below
are written from the contract in `lpdec/algorithms/_common.py` (the key of node
i at step t is fold_in(fold_in(key, t), i), split once per leaf in
`jax.tree.leaves` order), the shared key comes from the seed, and the step is
the reference's own counter. `test_node_key_is_the_documented_fold_in_chain`
pins the library to that contract, so a bug in the key derivation fails there
and in every reference that uses these helpers; it cannot hide in a copy.

`np_round_trip` is decode(encode(x, key)) in numpy, from the formulas in the
compressors' docstrings: min-max through tests/test_kernels_pallas.py's float32 numpy
quantizer (tests/test_compress.py checks the `minmax` compressor against it bit
for bit, chunking and stochastic seeds included), top-k as an argsort.
Random-k draws its positions with `jax.random.choice` on the sender's key, as
`random_k`'s contract says; they cannot be re-derived without jax's sampler, and
tests/test_compress.py checks that they are k distinct positions both ends agree
on and that the values are the input's.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from test_kernels_pallas import np_dequantize
from test_kernels_pallas import np_minmax_quantize

import lpdec
from lpdec import compress
from lpdec.algorithms import _common


def base_key(seed):
    """The raw uint32[2] key an algorithm built with `seed=seed` shares between its nodes."""
    return jax.random.key_data(jax.random.key(seed))


def node_key(key, step, node):
    """Node `node`'s key at step `step`: fold in the step, then the node."""
    return jax.random.fold_in(jax.random.fold_in(key, step), node)


@functools.partial(jax.jit, static_argnames=("num_nodes", "num_leaves"))
def leaf_keys(key, step, *, num_nodes, num_leaves):
    """keys[i, k]: the key node i encodes its k-th leaf with at `step` (raw, [n, L, 2])."""
    nodes = jnp.arange(num_nodes)
    return jax.vmap(lambda i: jax.random.split(node_key(key, step, i), num_leaves))(nodes)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _random_positions(key, d, k):
    return jax.random.choice(key, d, (k,), replace=False)


@jax.jit
def _seeds(key):
    return jax.random.bits(key, (1, 2), jnp.uint32)


def np_round_trip(comp, x, key=None):
    """decode(encode(x, key)) of one float32 array, computed in numpy."""
    x = np.asarray(x, np.float32)
    flat = x.reshape(-1)
    d = flat.size
    if isinstance(comp, compress.Identity):
        return x.copy()
    if isinstance(comp, compress.MinMax):
        chunk = max(1, min(comp.chunk_size, d))
        rows = -(-d // chunk)
        padded = np.pad(flat, (0, rows * chunk - d), mode="edge").reshape(rows, chunk)
        stochastic = comp.rounding == "stochastic"
        seeds = np.asarray(_seeds(key)) if stochastic else None
        codes, lo, unit = np_minmax_quantize(padded, seeds, comp.bits, stochastic)
        return np_dequantize(codes, lo, unit).reshape(-1)[:d].reshape(x.shape)
    k = min(d, max(1, round(comp.ratio * d)))
    out = np.zeros_like(flat)
    if isinstance(comp, compress.TopK):
        magnitude = np.where(np.isfinite(flat), np.abs(flat), np.inf)
        kept = np.argsort(-magnitude, kind="stable")[:k]
        out[kept] = flat[kept]
    elif isinstance(comp, compress.RandomK):
        kept = np.asarray(_random_positions(key, d, k))
        out[kept] = flat[kept] if np.isfinite(flat).all() else np.nan
    else:
        raise NotImplementedError(comp)
    return out.reshape(x.shape)


# ----------------------------------------------------------------------------
# The shared key cannot hide a bug in the key derivation.
# ----------------------------------------------------------------------------


def test_node_key_is_the_documented_fold_in_chain():
    """_common.node_key is fold_in(fold_in(key, step), node), traced or not, and gives
    every (step, node) pair its own key.

    The dense references re-derive each node's key with `node_key` above, so they
    would follow a library that derived keys differently only if this test did too.
    """
    steps, nodes = 6, 8
    grid = (jnp.arange(steps)[:, None], jnp.arange(nodes)[None, :])
    library, written = (
        jax.jit(jnp.vectorize(f, signature="(k),(),()->(k)")) for f in (_common.node_key, node_key)
    )
    for seed in (0, 123456789):
        key = base_key(seed)
        got = np.asarray(library(key, *grid))
        expected = np.asarray(written(key, *grid))
        np.testing.assert_array_equal(got, expected)
        # Eagerly with Python integers too, written out: the step first, then the node.
        for t, i in ((0, 0), (2, 5), (5, 1)):
            np.testing.assert_array_equal(
                got[t, i], jax.random.fold_in(jax.random.fold_in(key, t), i)
            )
        distinct = {tuple(k) for k in got.reshape(-1, 2).tolist()} | {tuple(np.asarray(key))}
        assert len(distinct) == steps * nodes + 1
    # The shared key itself is the seed's: nodes agree on it without communicating.
    tx = lpdec.choco(lpdec.ring(2), lpdec.minmax(8, "stochastic"), seed=3)
    state = jax.vmap(tx.init, axis_name="nodes")(jnp.zeros((2, 4)))
    np.testing.assert_array_equal(np.asarray(state.key), np.stack([base_key(3)] * 2))
