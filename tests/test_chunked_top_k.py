"""lpdec.chunked_top_k (SparseLoCo's compressor) against a numpy reference written from its
docstring: per chunk, sort the magnitudes, keep k, quantize sign and magnitude level, scatter
back; and inside compressed_mean with error feedback, alone and as DiLoCo's exchange."""

import functools
import math
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_compressed_mean_error_feedback import _flat
from test_compressed_mean_error_feedback import _gradients
from test_compressed_mean_error_feedback import _np_flat
from test_compressed_mean_error_feedback import _np_two_rounds

import lpdec
from lpdec import compress
from lpdec import testing

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from configs import default  # noqa: E402
from train_lib import ConfigError  # noqa: E402
from train_lib import registry  # noqa: E402
from train_lib import tables  # noqa: E402

N = 8


@functools.partial(jax.jit, static_argnums=0)
def _encode(comp, x):
    return comp.encode(x)


@functools.partial(jax.jit, static_argnums=0)
def _decode(comp, payload):
    return comp.decode(payload)


def _reference(x, k, chunk_size, bits):
    """The decoded array, in float32 numpy, from `chunked_top_k`'s docstring.

    An array smaller than chunk_size is one chunk; the last chunk of a longer one keeps
    min(k, its length) entries (its padding ranks last and is never decoded).
    """
    flat = np.asarray(x, np.float32).reshape(-1)
    chunk = max(1, min(chunk_size, flat.size))
    levels = 2 ** (bits - 1)
    out = np.zeros_like(flat)
    for start in range(0, flat.size, chunk):
        part = flat[start : start + chunk]
        kept = np.argsort(-np.abs(part), kind="stable")[: min(k, part.size)]
        magnitude = np.abs(part[kept])
        if levels == 1:
            lo, unit = np.float32(magnitude.sum(dtype=np.float32) / magnitude.size), 0
        else:
            lo = magnitude.min()
            unit = (magnitude.max() - lo) / np.float32(levels - 1)
        level = 0
        if unit > 0:
            level = np.clip(np.round((magnitude - lo) / unit), 0, levels - 1)
        value = (lo + level * np.float32(unit)).astype(np.float32)
        out[start + kept] = np.where(part[kept] < 0, -value, value)
    return out.reshape(np.shape(x))


def _halfway(x, k, chunk_size, bits):
    """Where the reference's (|x| - lo) / unit is exactly halfway between two levels."""
    flat = np.asarray(x, np.float32).reshape(-1)
    chunk = max(1, min(chunk_size, flat.size))
    out = np.zeros(flat.shape, bool)
    if bits == 1:
        return out.reshape(np.shape(x))
    for start in range(0, flat.size, chunk):
        part = flat[start : start + chunk]
        kept = np.argsort(-np.abs(part), kind="stable")[: min(k, part.size)]
        magnitude = np.abs(part[kept])
        unit = (magnitude.max() - magnitude.min()) / np.float32(2 ** (bits - 1) - 1)
        if unit > 0:
            q = (magnitude - magnitude.min()) / unit
            out[start + kept] = np.abs(q - np.floor(q) - 0.5) < 1e-5
    return out.reshape(np.shape(x))


def _spacing(values):
    """An upper bound of one level's spacing near `values` (for the halfway entries)."""
    return np.abs(values) * 0.5


def _expected_wire_bytes(d, k, chunk_size, bits):
    """Counted from the payload's description: m = chunks * kept entries."""
    chunk = max(1, min(chunk_size, d))
    chunks, kept = math.ceil(d / chunk), min(k, chunk)
    m = chunks * kept
    p = math.ceil(math.log2(chunk)) if kept < chunk else 0
    planes = [min(p, 8), p - 8] if p > 8 else [p]
    return math.ceil(m * bits / 8) + sum(math.ceil(m * b / 8) for b in planes) + 8 * chunks


CASES = {
    # name: (shape, k, chunk_size, bits, dtype)
    "three-whole-chunks": ((3 * 4096,), 64, 4096, 2, jnp.float32),
    "partial-last-chunk": ((10000,), 64, 4096, 2, jnp.bfloat16),
    "last-chunk-shorter-than-k": ((4096 + 5,), 64, 4096, 2, jnp.float32),
    "smaller-than-a-chunk": ((300,), 64, 4096, 2, jnp.float32),
    "k-covers-the-leaf": ((40,), 64, 4096, 2, jnp.float32),
    "k-equals-chunk": ((64, 70), 256, 256, 8, jnp.float32),
    "2d-8-bit-positions": ((37, 29), 16, 256, 3, jnp.float32),
    "2d-bfloat16": ((33, 65), 8, 1000, 4, jnp.bfloat16),
    "scaled-sign": ((5000,), 100, 4096, 1, jnp.float32),
}


@pytest.mark.parametrize("case", CASES)
def test_decode_matches_the_numpy_reference(rng, case):
    shape, k, chunk_size, bits, dtype = CASES[case]
    x = jnp.asarray(rng.standard_normal(shape) * rng.uniform(0.5, 4.0), dtype)
    comp = lpdec.chunked_top_k(k, chunk_size=chunk_size, bits=bits)
    payload = _encode(comp, x)
    got = _decode(comp, payload)
    assert got.shape == shape and got.dtype == dtype
    expected = _reference(np.asarray(x, np.float32), k, chunk_size, bits)
    # The same entries are kept, and each decodes to its quantized value.
    got32 = np.asarray(got, np.float32)
    np.testing.assert_array_equal(got32 != 0, expected != 0)
    rtol = 1e-6 if dtype == jnp.float32 else 2**-8
    expected = np.asarray(expected).astype(dtype).astype(np.float32)
    # An entry exactly halfway between two levels (common on bfloat16's coarse grid) may
    # round either way: XLA may divide by the level spacing as a multiply by its
    # reciprocal, a last bit the reference's division does not share. Both are nearest.
    tie = _halfway(np.asarray(x, np.float32), k, chunk_size, bits)
    np.testing.assert_allclose(got32[~tie], expected[~tie], rtol)
    assert np.all(np.abs(got32[tie] - expected[tie]) <= _spacing(expected[tie]) + 1e-6)
    assert bool(comp.is_finite(payload))
    assert compress.payload_nbytes(payload) == comp.wire_bytes(x.size, dtype)


def test_two_bits_send_each_chunks_extreme_magnitudes_with_their_signs():
    """At b = 2 a kept value decodes to +-lo or +-hi of its chunk (the docstring's example)."""
    comp = lpdec.chunked_top_k(3, chunk_size=5)
    x = jnp.array([0.5, -2.0, 3.0, 0.1, -2.9, 1.0, 0.0, 8.0, -4.0, 6.5, 7.0])
    np.testing.assert_array_equal(
        _decode(comp, _encode(comp, x)), [0, -2, 3, 0, -3, 0, 0, 8, -4, 8, 7]
    )


@pytest.mark.parametrize("bits", [2, 5])
@pytest.mark.parametrize("k,chunk_size", [(64, 4096), (1, 1), (3, 256), (5, 257), (9, 65536)])
def test_wire_bytes_equal_the_payload_bytes(k, chunk_size, bits):
    comp = lpdec.chunked_top_k(k, chunk_size=chunk_size, bits=bits)
    for d in (0, 1, 2, 256, 257, 4097, 10000, 3 * 65536 + 17):
        shapes = jax.eval_shape(comp.encode, jax.ShapeDtypeStruct((d,), jnp.float32))
        assert compress.payload_nbytes(shapes) == comp.wire_bytes(d), d
        assert comp.wire_bytes(d, jnp.bfloat16) == _expected_wire_bytes(d, k, chunk_size, bits)


@pytest.mark.parametrize("d", [0, 3, 4097])
def test_the_encoded_arrays_hold_the_wire_bytes(d):
    comp = lpdec.chunked_top_k(5, chunk_size=300, bits=3)
    payload = _encode(comp, jnp.ones((d,), jnp.bfloat16))
    assert compress.payload_nbytes(payload) == _expected_wire_bytes(d, 5, 300, 3)
    assert _decode(comp, payload).shape == (d,)


def test_bytes_per_element_at_the_defaults_against_minmax():
    d = 256 * 4096
    comp = lpdec.chunked_top_k()
    assert comp == lpdec.compress.ChunkedTopK(k=64, chunk_size=4096, bits=2)
    # 64 codes of 2 bits, 64 positions of 12 bits, 8 bytes of scales per 4096 elements.
    assert comp.wire_bytes(d) == 256 * (16 + 96 + 8)
    assert comp.wire_bytes(d) / d == pytest.approx(0.0293, abs=1e-4)
    assert lpdec.minmax(bits=2).wire_bytes(d) / d == pytest.approx(0.2510, abs=1e-4)
    assert lpdec.minmax(bits=4).wire_bytes(d) / d == pytest.approx(0.5020, abs=1e-4)


@pytest.mark.parametrize("bits", [1, 2])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", [5000, 8193])  # a whole chunk, the 3-element last one
def test_a_non_finite_entry_is_flagged_and_decodes_non_finite(rng, bits, bad, where):
    x = rng.standard_normal(8195).astype(np.float32)
    x[where] = bad
    comp = lpdec.chunked_top_k(bits=bits)
    payload = _encode(comp, jnp.asarray(x))
    assert not bool(comp.is_finite(payload))
    decoded = np.asarray(_decode(comp, payload))
    assert not np.isfinite(decoded[where])
    other_chunks = np.arange(x.size) // 4096 != where // 4096
    assert np.all(np.isfinite(decoded[other_chunks]))
    assert bool(comp.is_finite(_encode(comp, jnp.asarray(np.nan_to_num(x)))))


@pytest.mark.parametrize("d,dtype", [(300, jnp.bfloat16), (10000, jnp.float32)])
def test_decode_accumulate_is_acc_plus_weight_times_decode(rng, dtype, d):
    comp = lpdec.chunked_top_k(16, chunk_size=1024, bits=3)
    payload = _encode(comp, jnp.asarray(rng.standard_normal(d), dtype))
    acc = jnp.asarray(rng.standard_normal(d), jnp.float32)
    got = jax.jit(comp.decode_accumulate)(payload, acc, 0.37)
    expected = acc + 0.37 * _decode(comp, payload).astype(jnp.float32)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)


def test_jit_and_vmap_give_each_row_its_own_compression(rng):
    """compressed_mean encodes its chunks under vmap, with a key per row."""
    comp = lpdec.chunked_top_k(4, chunk_size=32)
    x = rng.standard_normal((5, 100)).astype(np.float32)
    keys = jax.random.split(jax.random.key(0), 5)
    payloads = jax.jit(jax.vmap(comp.encode))(jnp.asarray(x), keys)
    got = jax.jit(jax.vmap(comp.decode))(payloads)
    np.testing.assert_allclose(got, np.stack([_reference(r, 4, 32, 2) for r in x]), rtol=1e-6)


def _quantize(k, chunk_size, bits):
    return lambda v: _reference(v, k, chunk_size, bits)


def test_compressed_mean_with_error_feedback_matches_numpy_on_a_layout(rng):
    """8 nodes on make_layout(8): each step's mean and residuals are the dense numpy
    simulation of the two rounds with error feedback (Q = the reference above). The
    model (223 values) gives each node a 28-value share: 3 chunks of 8 and one of 4."""
    steps, k, chunk_size, bits = 5, 3, 8, 2
    layout = lpdec.make_layout(N)
    comp = lpdec.chunked_top_k(k, chunk_size=chunk_size, bits=bits)
    tx = lpdec.compressed_mean(comp, axis_name=layout.axis_name, error_feedback=True)
    grads = _gradients(rng, (N,), steps)

    def node(g):
        def body(state, g_t):
            mean, state = tx.update(g_t, state)
            return state, (mean, state.residual)

        return jax.lax.scan(body, tx.init(jax.tree.map(lambda x: x[0], g)), g)[1]

    means, residuals = jax.jit(layout.map(node, (True,)))(layout.put(grads))
    expected, expected_residuals = _np_flat(_flat(grads, 1), _quantize(k, chunk_size, bits))
    got = _flat(testing.to_numpy(means), 1)
    np.testing.assert_allclose(got, np.broadcast_to(expected, got.shape), rtol=0, atol=1e-5)
    np.testing.assert_allclose(
        np.asarray(residuals), expected_residuals.transpose(1, 0, 2), rtol=0, atol=1e-5
    )
    # Most entries were dropped, and the feedback brought them back later.
    assert np.mean(expected[0] == 0) > 0.5
    plain = _np_two_rounds(_flat(grads, 1)[:, 1], _quantize(k, chunk_size, bits))[0]
    assert np.abs(expected[1] - plain).max() > 0.1


def test_diloco_exchanges_through_it_with_error_feedback(rng):
    """DiLoCo (inner SGD, H = 3) whose exchange is compressed_mean(chunked_top_k, error
    feedback) and outer SGD(1): the anchor moves by minus the compressed mean of the
    pseudo-gradients, against a numpy float32 simulation."""
    d, h, steps, lr = 200, 3, 9, np.float32(0.1)
    k, chunk_size, bits = 2, 8, 2
    targets = rng.standard_normal((N, d)).astype(np.float32)
    x0 = rng.standard_normal(d).astype(np.float32)
    comp = lpdec.chunked_top_k(k, chunk_size=chunk_size, bits=bits)
    outer = optax.chain(
        lpdec.compressed_mean(comp, axis_name=testing.AXIS, error_feedback=True), optax.sgd(1.0)
    )
    tx = lpdec.diloco(optax.sgd(float(lr)), outer, local_steps=h, axis_name=testing.AXIS)
    t = jnp.asarray(targets)
    ps, _, _ = testing.run(
        tx,
        {"w": np.broadcast_to(x0, (N, d))},
        steps,
        grad_fn=lambda p, node, step: {"w": p["w"] - t[node]},
        mode="shard_map",
    )
    anchor, x = x0.copy(), np.broadcast_to(x0, (N, d)).copy()
    residual = np.zeros((N, d), np.float32)
    expected = []
    for step in range(steps):
        x = x + (x - targets) * -lr
        if (step + 1) % h == 0:
            mean, residual = _np_two_rounds(anchor - x + residual, _quantize(k, chunk_size, bits))
            anchor = anchor - mean
            x = np.broadcast_to(anchor, (N, d)).copy()
        expected.append(x)
    np.testing.assert_allclose(np.asarray(ps["w"]), np.stack(expected, 1), rtol=0, atol=1e-5)
    assert np.abs(anchor - x0).max() > 0.1


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"k": 0}, r"k must be an integer in \[1, 4096\]; got 0"),
        ({"k": 4097}, r"k must be an integer in \[1, 4096\]; got 4097"),
        ({"k": 2.5}, r"k must be an integer in \[1, 4096\]; got 2.5"),
        ({"k": True}, r"k must be an integer in \[1, 4096\]; got True"),
        ({"chunk_size": 0}, r"chunk_size must be an integer in \[1, 65536\]; got 0"),
        ({"chunk_size": 1 << 17}, r"chunk_size must be an integer in \[1, 65536\]"),
        ({"k": 8, "chunk_size": 4}, r"k must be an integer in \[1, 4\]; got 8"),
        ({"bits": 0}, r"bits must be"),
        ({"bits": 9}, r"bits must be"),
    ],
)
def test_bad_arguments_raise_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        lpdec.chunked_top_k(**kwargs)
    assert "\n" not in str(info.value)


def test_it_is_exported_and_hashable():
    assert lpdec.chunked_top_k is lpdec.compress.chunked_top_k
    assert "chunked_top_k" in lpdec.__all__ and "ChunkedTopK" in lpdec.compress.__all__
    assert isinstance(lpdec.chunked_top_k(), lpdec.Compressor)
    assert hash(lpdec.chunked_top_k()) == hash(lpdec.chunked_top_k(np.int64(64)))


def _config(**fields):
    config = default.get_config()
    config.update(compressor="chunked_top_k", **fields)
    return config


def test_the_registry_entry_reads_ratio_chunk_size_and_bits():
    build = lambda config: tables.build(config, "compressor", registry.COMPRESSORS)  # noqa: E731
    assert build(_config(ratio=1 / 64, bits=2)) == lpdec.chunked_top_k(64, bits=2)
    assert build(_config(ratio=0.25, chunk_size=256, bits=4)) == lpdec.chunked_top_k(
        64, chunk_size=256, bits=4
    )
    bad = [
        (_config(ratio=1e-4), r"config.ratio=0.0001 keeps round\(ratio \* chunk_size\) = 0 "),
        (_config(ratio=0.5, rounding="stochastic"), r"rounds to nearest only"),
        (_config(chunk_size=0), r"chunk_size must be an integer in \[1, 65536\]; got 0"),
    ]
    for config, message in bad:
        with pytest.raises(ConfigError, match=message) as info:
            build(config)
        assert "\n" not in str(info.value)
