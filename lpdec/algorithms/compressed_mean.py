r"""Centralized compressed all-reduce: QSGD-TF's two rounds (seed 001), hierarchical (seed 004).

Every node's incoming update (its gradient) is replaced by the mean over the
nodes, computed without an all-reduce and with compressed payloads on the
wire. Each leaf is flattened and cut into n chunks (n = the axis size; the
last chunk padded by repeating the leaf's last element, which leaves every
chunk's range unchanged):

1. scatter-reduce: node i encodes chunk c of its update and sends it to node c
   (one all-to-all). Node c decodes the n - 1 copies of its chunk and averages
   them with its own chunk in full precision.
2. all-gather: node c encodes its averaged chunk and every node receives all of
   them (one all-gather), decodes and concatenates.

Every node, chunk owners included, decodes the same round-2 payloads, so every
node ends with the same bits: data-parallel replicas stay identical.

With ``local_axis`` (seed 004, on a 2-axis mesh: `axis_name` between machines,
`local_axis` between the accelerators of a machine) the exchange becomes
hierarchical: a full-precision reduce-scatter within the machine, the two
compressed rounds between machines, a full-precision all-gather within the
machine. Seed 004 has the first GPU of each machine reduce, exchange and
broadcast the whole vector; here every local rank l reduces 1/L of it and runs
the compressed exchange for that shard with rank l of the other machines, so
the L ranks share the compression work and the inter-machine traffic in
parallel. The result is the same mean; the full-precision broadcast becomes an
all-gather of the shards.

Non-finite updates: a node whose update holds NaN/Inf sends NaN in every chunk
(counted in its ``health.nonfinite_updates``); every chunk owner drops the
non-finite copies it receives (counted in ``health.nonfinite_received``) and
averages the others, so the result is the mean over the nodes whose updates
were finite, the same on every node.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from lpdec import gossip
from lpdec.algorithms import _common
from lpdec.algorithms import health as health_lib
from lpdec.compress import base as compress_base
from lpdec.compress.modulo import Modulo

_SCATTER_REDUCE = 1
_ALL_GATHER = 2


class CompressedMeanState(NamedTuple):
    """State of `compressed_mean`.

    Attributes:
      count: shape=(), dtype=int32; steps taken.
      key: shape=(2,), dtype=uint32; shared by all nodes (see `_chunk_key`).
      health: non-finite counters (`lpdec.Health`), varying over both axes.
    """

    count: jax.Array
    key: jax.Array
    health: health_lib.Health


def init(
    params: optax.Params,
    *,
    seed: int | jax.Array = 0,
    axis_name: str = "nodes",
    local_axis: str | None = None,
) -> CompressedMeanState:
    """The state at step 0; must run under `axis_name` (and `local_axis`)."""
    del params
    gossip.require_axis(axis_name, "compressed_mean's init")
    axes = (axis_name,)
    if local_axis is not None:
        gossip.require_axis(local_axis, "compressed_mean's init")
        axes = (axis_name, local_axis)
    return CompressedMeanState(
        count=jnp.zeros((), jnp.int32),
        key=_common.key_from_seed(seed),
        health=health_lib.init(axes),
    )


def _chunk_key(
    key: jax.Array, step: jax.Array, sender: jax.Array, round_: int, leaf: int, chunk: jax.Array
) -> jax.Array:
    """The key `sender` encodes chunk `chunk` of leaf `leaf` with in round `round_` (1 or 2).

    `sender` is the device's global index (node * L + local rank with a local
    axis); receivers re-derive it for compressors that need the sender's key.
    """
    k = _common.node_key(key, step, sender)
    for value in (round_, leaf, chunk):
        k = jax.random.fold_in(k, value)
    return k


def _pad(vector: jax.Array, multiple: int) -> jax.Array:
    """Pads to a multiple of `multiple` by repeating the last element (ranges unchanged)."""
    extra = -vector.size % multiple
    return jnp.pad(vector, (0, extra), mode="edge") if extra else vector


def _decode_rows(compressor, rows, keys):
    """Decodes a payload with a leading row axis into float32 rows and per-row finiteness."""
    decoded = jax.vmap(lambda p, k: compressor.decode(p, key=k).astype(jnp.float32))(rows, keys)
    return decoded, jax.vmap(compressor.is_finite)(rows)


def _two_round_mean(
    vectors: list[jax.Array],
    state: CompressedMeanState,
    *,
    compressor: compress_base.Compressor,
    axis_name: str,
    device_id: Callable[[jax.Array], jax.Array],
) -> tuple[list[jax.Array], jax.Array]:
    """Seed 001's scatter-reduce + all-gather of flat float32 vectors over `axis_name`.

    Returns:
      (the mean vectors, trimmed to their input sizes; payloads dropped as non-finite).
    """
    n = jax.lax.axis_size(axis_name)
    me = gossip.node_index(axis_name)
    peers = jnp.arange(n)
    mine = peers == me
    senders = device_id(peers)

    def key_of(sender, round_, leaf, chunk):
        return _chunk_key(state.key, state.count, sender, round_, leaf, chunk)

    # Round 1: chunk c of every leaf goes to node c.
    chunks, outgoing = [], []
    for leaf, vector in enumerate(vectors):
        c = _pad(vector, n).reshape(n, -1)
        keys = jax.vmap(lambda ch, leaf=leaf: key_of(device_id(me), _SCATTER_REDUCE, leaf, ch))(
            peers
        )
        chunks.append(c)
        outgoing.append(jax.vmap(compressor.encode)(c, keys))
    incoming = gossip.all_to_all_payload(outgoing, axis_name=axis_name)

    skipped = jnp.int32(0)
    averages = []
    for leaf, (c, rows) in enumerate(zip(chunks, incoming, strict=True)):
        keys = jax.vmap(lambda s, leaf=leaf: key_of(s, _SCATTER_REDUCE, leaf, me))(senders)
        decoded, ok = _decode_rows(compressor, rows, keys)
        # This node's own chunk enters in full precision.
        own = jnp.take(c, me, axis=0)
        decoded = jnp.where(mine[:, None], own[None], decoded)
        ok = jnp.where(mine, jnp.all(jnp.isfinite(own)), ok)
        total = jnp.sum(jnp.where(ok[:, None], decoded, 0.0), axis=0)
        contributors = jnp.sum(ok.astype(jnp.int32))
        averages.append(total / jnp.maximum(contributors, 1).astype(jnp.float32))
        skipped = skipped + jnp.sum((~ok & ~mine).astype(jnp.int32))

    # Round 2: node c's averaged chunk goes to everyone, itself included.
    outgoing = [
        compressor.encode(avg, key_of(device_id(me), _ALL_GATHER, leaf, me))
        for leaf, avg in enumerate(averages)
    ]
    gathered = gossip.all_gather_payload(outgoing, axis_name=axis_name)
    means = []
    for leaf, (vector, rows) in enumerate(zip(vectors, gathered, strict=True)):
        keys = jax.vmap(lambda s, ch, leaf=leaf: key_of(s, _ALL_GATHER, leaf, ch))(senders, peers)
        decoded, ok = _decode_rows(compressor, rows, keys)
        decoded = jnp.where(ok[:, None], decoded, 0.0)
        skipped = skipped + jnp.sum((~ok).astype(jnp.int32))
        means.append(decoded.reshape(-1)[: vector.size])
    return means, skipped


def step(
    updates: optax.Updates,
    state: CompressedMeanState,
    *,
    compressor: compress_base.Compressor,
    axis_name: str = "nodes",
    local_axis: str | None = None,
) -> tuple[optax.Updates, CompressedMeanState]:
    """The compressed mean of `updates` over the nodes; must run under the named axes.

    Args:
      updates: this device's update (its gradient).
      state: the state from `init` or the previous step.
      compressor: Q, applied to the chunks in both rounds.
      axis_name: the nodes' axis.
      local_axis: None, or the axis of a node's accelerators.

    Returns:
      (the mean over both axes, in each leaf's dtype; the next state).
    """
    gossip.require_axis(axis_name, "compressed_mean")
    if local_axis is None:

        def device_id(node):
            return node

    else:
        local_size = gossip.require_axis(local_axis, "compressed_mean")
        rank = jax.lax.axis_index(local_axis)

        def device_id(node):
            return node * local_size + rank

    ok = _common.all_finite(updates)
    health = health_lib.count_update(state.health, ok)
    leaves, treedef = jax.tree.flatten(updates)
    # Empty leaves have nothing to send; NaN everywhere marks a non-finite update for every chunk.
    live = [i for i, u in enumerate(leaves) if u.size]
    vectors = [jnp.where(ok, leaves[i].astype(jnp.float32).reshape(-1), jnp.nan) for i in live]
    if local_axis is not None:
        shards = [_pad(v, local_size) for v in vectors]
        shards = gossip.local_reduce_scatter(shards, axis_name=local_axis)
        shard_means, skipped = _two_round_mean(
            shards, state, compressor=compressor, axis_name=axis_name, device_id=device_id
        )
        gathered = gossip.local_all_gather(shard_means, axis_name=local_axis)
        means = [g[: v.size] for g, v in zip(gathered, vectors, strict=True)]
    else:
        means, skipped = _two_round_mean(
            vectors, state, compressor=compressor, axis_name=axis_name, device_id=device_id
        )
    out = [jnp.zeros_like(u) for u in leaves]
    for i, mean in zip(live, means, strict=True):
        out[i] = mean.reshape(leaves[i].shape).astype(leaves[i].dtype)
    health = health_lib.count_received(health, skipped)
    return treedef.unflatten(out), CompressedMeanState(state.count + 1, state.key, health)


def compressed_mean(
    comp: compress_base.Compressor,
    *,
    axis_name: str = "nodes",
    local_axis: str | None = None,
    seed: int | jax.Array = 0,
) -> optax.GradientTransformationExtraArgs:
    r"""Mean of the updates over the nodes by a two-round compressed all-reduce (seeds 001, 004).

    .. math::

      a_c = \frac{1}{n}\Big(g_c^{(c)} + \sum_{j \ne c} Q\big(g_c^{(j)}\big)\Big),\qquad
      \bar g = \big[\,Q(a_0), \dots, Q(a_{n-1})\,\big]

    :math:`g^{(j)}_c` is chunk c of node j's incoming update (per leaf,
    flattened), Q is `comp` (encode then decode) and n the size of
    `axis_name`. Node c computes :math:`a_c`; every node receives every
    :math:`Q(a_c)`. For ``minmax(b, "nearest")`` each element of chunk c is
    within :math:`\frac{1}{n}\sum_{j \ne c} \frac{u_{jc}}{2} + \frac{u_c'}{2}`
    of the exact mean, :math:`u_{jc}` the step of node j's chunk c and
    :math:`u'_c` that of :math:`a_c` (range / (2^b - 1) per scale chunk);
    stochastic rounding makes the result unbiased. Each node sends, and
    receives, about 2 (n - 1)/n times the compressed size of its update per
    step, half in each round.

    With `local_axis`, the mean is over both axes: a full-precision
    reduce-scatter over `local_axis` first, then the two rounds between the
    nodes of `axis_name` on each 1/L shard, then a full-precision all-gather
    over `local_axis` (module docstring).

    A centralized transform: put it FIRST in the chain, on the gradients,
    followed by a local optimizer. It must run under `axis_name` (and
    `local_axis`), with `jax.shard_map` or `jax.vmap(axis_name=...)`.

    Args:
      comp: Q, an `lpdec` compressor other than `modulo`; seeds 001 and 004
        use ``lpdec.minmax(8, "stochastic")``.
      axis_name: the named axis whose instances are the nodes (machines).
      local_axis: optional second named axis, the accelerators within a node.
      seed: seeds the shared key for stochastic rounding / random-k (an int
        or an int scalar array, so ``optax.inject_hyperparams`` works).

    Returns:
      An optax transform whose `init` and `update` must run under `axis_name`
      (and `local_axis`); `update` ignores `params`.

    Example:
      >>> tx = optax.chain(
      ...     lpdec.compressed_mean(lpdec.minmax(8, "stochastic"), axis_name="nodes"),
      ...     optax.sgd(0.1, momentum=0.9),
      ... )

    References:
      Alistarh et al., QSGD: Communication-Efficient SGD via Gradient
      Quantization and Encoding, NeurIPS 2017, https://arxiv.org/abs/1610.02132;
      Bagua's low precision gradient all-reduce, https://github.com/BaguaSys/bagua
    """
    _common.check_compressor(comp, "compressed_mean", "lpdec.minmax(8)")
    if isinstance(comp, Modulo):
        raise ValueError(
            "compressed_mean cannot use modulo: it decodes against the receiver's own model, "
            "and a mean of updates has none."
        )
    if not isinstance(axis_name, str):
        raise TypeError(f"compressed_mean: axis_name must be a string; got {axis_name!r}.")
    if local_axis is not None and (not isinstance(local_axis, str) or local_axis == axis_name):
        raise ValueError(
            "compressed_mean: local_axis must be None or an axis name other than "
            f"axis_name={axis_name!r}; got {local_axis!r}."
        )

    def init_fn(params):
        return init(params, seed=seed, axis_name=axis_name, local_axis=local_axis)

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        return step(updates, state, compressor=comp, axis_name=axis_name, local_axis=local_axis)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
