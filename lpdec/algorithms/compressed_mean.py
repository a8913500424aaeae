r"""Centralized compressed all-reduce: QSGD-TF's two rounds (seed 001), hierarchical (seed 004).

Every node's incoming update (its gradient) is replaced by the mean over the
nodes, computed without an all-reduce and with compressed payloads on the
wire. The update's leaves are cast to float32, flattened and concatenated into
one vector, which is cut into n chunks (n = the axis size; the last chunk
padded by repeating the vector's last element, which leaves every chunk's
range unchanged):

1. scatter-reduce: node i encodes chunk c of its update and sends it to node c
   (one all-to-all). Node c decodes the n - 1 copies of its chunk and averages
   them with its own chunk in full precision.
2. all-gather: node c encodes its averaged chunk and every node receives all of
   them (one all-gather), decodes, concatenates and splits the vector back into
   the update's leaves.

A payload (codes and scales) travels as one uint8 buffer, so a step issues one
collective per round for the whole model, whatever its number of leaves: each
collective is a rendezvous of all the nodes, which costs latency on a real
link. Every node, chunk owners included, decodes the same round-2 payloads, so
every node ends with the same bits: data-parallel replicas stay identical.

With ``local_axis`` (seed 004, on a 2-axis mesh: `axis_name` between machines,
`local_axis` between the accelerators of a machine) the exchange becomes
hierarchical: a full-precision reduce-scatter within the machine (its mean),
the two compressed rounds between machines, a full-precision all-gather within
the machine. Seed 004 has the first GPU of each machine reduce, exchange and
broadcast the whole vector; here every local rank l reduces 1/L of it and runs
the compressed exchange for that shard with rank l of the other machines, so
the L ranks share the compression work and the inter-machine traffic in
parallel. The result is the same mean; the full-precision broadcast becomes an
all-gather of the shards.

Non-finite updates: a node whose update holds NaN/Inf sends NaN in every chunk
(counted in its ``health.nonfinite_updates``); every chunk owner drops the
non-finite copy it receives (counted in ``health.nonfinite_received``) and
averages the others, so the result is the mean over the nodes whose updates
were finite, the same on every node. With error feedback, such a node keeps
its residual unchanged for that step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from lpdec import gossip
from lpdec.algorithms import _common
from lpdec.algorithms import declaration
from lpdec.algorithms import health as health_lib
from lpdec.compress import Modulo
from lpdec.compress import base as compress_base
from lpdec.kernels_pallas import numerics

_SCATTER_REDUCE = 1
_ALL_GATHER = 2
_GATHER_ONLY = 3  # the one-round form's key stream (`rounds=1`)
ROUNDS = (1, 2)


class CompressedMeanState(NamedTuple):
    """State of `compressed_mean`.

    Attributes:
      count: shape=(), dtype=int32; steps taken.
      key: shape=(2,), dtype=uint32; shared by all nodes (see `_chunk_key`).
      health: non-finite counters (`lpdec.Health`), varying over both axes.
      residual: with error feedback, shape=(m,), dtype=float32: e, what this
        device's share of the update has sent short so far (m = the model's
        size, or with `local_axis` its 1/L shard, ceil(size / L)); ``()``
        without.
    """

    count: jax.Array  # type: ignore[assignment]  # a field shadowing tuple.count, as in optax
    key: jax.Array
    health: health_lib.Health
    residual: jax.Array | tuple


def _share_size(size: int, local_axis: str | None) -> int:
    """Elements of the vector this device runs the two rounds on: all, or its 1/L shard."""
    if local_axis is None:
        return size
    return -(-size // jax.lax.axis_size(local_axis))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hyperparams:
    """`compressed_mean`'s arguments, validated on construction; `init` and `step` read them."""

    compressor: compress_base.Compressor
    axis_name: gossip.AxisName = "nodes"
    local_axis: str | None = None
    seed: int | jax.Array = 0
    error_feedback: bool = False
    rounds: int = 2
    error_decay: float = 1.0

    def __post_init__(self):
        _common.check_compressor(self.compressor, "compressed_mean", "lpdec.minmax(8)")
        if self.rounds not in ROUNDS or isinstance(self.rounds, bool):
            raise ValueError(
                f"compressed_mean: rounds must be 2 (scatter-reduce + all-gather) or 1 (an "
                f"all-gather of every node's payload); got {self.rounds!r}."
            )
        decay = self.error_decay
        # A scalar array passes as is (optax.inject_hyperparams makes numbers arrays).
        number = isinstance(decay, (int, float)) and not isinstance(decay, bool)
        scalar_array = not number and not isinstance(decay, bool) and jnp.ndim(decay) == 0
        if not (number and 0 < decay <= 1) and not scalar_array:
            raise ValueError(
                f"compressed_mean: error_decay must be a number in (0, 1]; got {decay!r}."
            )
        if (not number or decay != 1) and not self.error_feedback:
            raise ValueError(
                "compressed_mean: error_decay applies to the error-feedback residual: set "
                "error_feedback=True, or leave error_decay at 1."
            )
        if isinstance(self.compressor, Modulo):
            raise ValueError(
                "compressed_mean cannot use modulo: it decodes against the receiver's own model, "
                "and a mean of updates has none."
            )
        if not _common.is_axis_name(self.axis_name):
            raise TypeError(
                "compressed_mean: axis_name must be an axis name or "
                "a tuple of distinct axis names; "
                f"got {self.axis_name!r}."
            )
        if self.local_axis is not None:
            if not isinstance(self.axis_name, str):
                raise ValueError(
                    "compressed_mean: with local_axis, axis_name must be one axis name (a string); "
                    f"got {self.axis_name!r}."
                )
            if not isinstance(self.local_axis, str) or self.local_axis == self.axis_name:
                raise ValueError(
                    "compressed_mean: local_axis must be None or an axis name other than "
                    f"axis_name={self.axis_name!r}; got {self.local_axis!r}."
                )
        if not isinstance(self.error_feedback, bool):
            raise TypeError(
                f"compressed_mean: error_feedback must be a bool; got {self.error_feedback!r}."
            )


def init(params: optax.Params, hp: Hyperparams) -> CompressedMeanState:
    """The state at step 0; must run under `axis_name` (and `local_axis`)."""
    gossip.require_axis(hp.axis_name, "compressed_mean's init")
    axes = (hp.axis_name,) if isinstance(hp.axis_name, str) else tuple(hp.axis_name)
    if hp.local_axis is not None:
        gossip.require_axis(hp.local_axis, "compressed_mean's init")
        axes = (*axes, hp.local_axis)
    residual = ()
    if hp.error_feedback:
        size = sum(x.size for x in jax.tree.leaves(params))
        residual = gossip.to_varying(jnp.zeros(_share_size(size, hp.local_axis), jnp.float32), axes)
    return CompressedMeanState(
        count=jnp.zeros((), jnp.int32),
        key=_common.key_from_seed(hp.seed),
        health=health_lib.init(axes),
        residual=residual,
    )


def _chunk_key(
    key: jax.Array, step: jax.Array, sender: jax.Array, round_: int, chunk: jax.Array | int
) -> jax.Array:
    """The key `sender` encodes chunk `chunk` with in round `round_` (1 or 2).

    `sender` is the device's global index (node * L + local rank with a local
    axis); receivers re-derive it for compressors that need the sender's key.
    """
    k = _common.node_key(key, step, sender)
    return jax.random.fold_in(jax.random.fold_in(k, round_), chunk)


def one_round_key(key: jax.Array, count: jax.Array, sender: jax.Array) -> jax.Array:
    """The key `sender` encodes its whole share with at exchange `count` (``rounds=1``).

    `key` is the state's shared key (from `seed`), `count` the exchanges before this
    one. Receivers re-derive it to decode. An elastic machine (`train_lib.elastic`)
    encodes its pseudo-gradient with the key of its slot, so that its payload is the
    one this exchange would send for it.
    """
    return _chunk_key(key, count, sender, _GATHER_ONLY, 0)


def _pad(vector: jax.Array, multiple: int) -> jax.Array:
    """Pads to a multiple of `multiple` by repeating the last element (ranges unchanged)."""
    extra = -vector.size % multiple
    return jnp.pad(vector, (0, extra), mode="edge") if extra else vector


def _pack_rows(payload: Any) -> jax.Array:
    """A payload tree with a leading row axis as one uint8 array [rows, bytes]."""
    leaves = jax.tree.leaves(payload)
    rows = leaves[0].shape[0]
    as_bytes = [
        x if x.dtype == jnp.uint8 else jax.lax.bitcast_convert_type(x, jnp.uint8) for x in leaves
    ]
    return jnp.concatenate([b.reshape(rows, -1) for b in as_bytes], axis=1)


def _unpack_rows(packed: jax.Array, row: Any) -> Any:
    """Inverse of `_pack_rows`; `row` is one row of the payload (shapes and dtypes)."""
    leaves, treedef = jax.tree.flatten(row)
    rows, offset, out = packed.shape[0], 0, []
    for x in leaves:
        width = jnp.dtype(x.dtype).itemsize
        raw = packed[:, offset : offset + x.size * width]
        offset += x.size * width
        if x.dtype == jnp.uint8:
            out.append(raw.reshape((rows, *x.shape)))
        else:
            out.append(jax.lax.bitcast_convert_type(raw.reshape((rows, *x.shape, width)), x.dtype))
    return jax.tree.unflatten(treedef, out)


def _row_of(payload: Any) -> Any:
    """Shapes and dtypes of one row of a payload with a leading row axis."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), payload)


def _decode_rows(compressor, rows, keys):
    """Decodes a payload with a leading row axis into float32 rows and per-row finiteness."""
    decoded = jax.vmap(lambda p, k: compressor.decode(p, key=k).astype(jnp.float32))(rows, keys)
    return decoded, jax.vmap(compressor.is_finite)(rows)


def _two_round_mean(
    vector: jax.Array,
    state: CompressedMeanState,
    *,
    compressor: compress_base.Compressor,
    axis_name: gossip.AxisName,
    device_id: Callable[[jax.Array], jax.Array],
    error_feedback: bool,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Seed 001's scatter-reduce + all-gather of one flat float32 vector over `axis_name`.

    Args:
      vector: v, this node's share (its update, plus its residual with error feedback).

    Returns:
      (the mean, trimmed to the input's size; payloads dropped as non-finite;
       with `error_feedback` the new residual v - t (compressed_mean's docstring), else None).
    """
    n = jax.lax.axis_size(axis_name)
    me = gossip.node_index(axis_name)
    peers = jnp.arange(n)
    mine = peers == me
    senders = device_id(peers)

    def key_of(sender, round_, chunk):
        return _chunk_key(state.key, state.count, sender, round_, chunk)

    # Round 1: chunk c goes to node c, all chunks in one all-to-all.
    chunks = _pad(vector, n).reshape(n, -1)
    sent_keys = jax.vmap(lambda c: key_of(device_id(me), _SCATTER_REDUCE, c))(peers)
    outgoing = jax.vmap(compressor.encode)(chunks, sent_keys)
    incoming = _unpack_rows(
        gossip.all_to_all_payload(_pack_rows(outgoing), axis_name=axis_name), _row_of(outgoing)
    )
    keys = jax.vmap(lambda s: key_of(s, _SCATTER_REDUCE, me))(senders)
    decoded, ok = _decode_rows(compressor, incoming, keys)
    # This node's own chunk enters in full precision.
    own = jnp.take(chunks, me, axis=0)
    decoded = jnp.where(mine[:, None], own[None], decoded)
    ok = jnp.where(mine, jnp.all(jnp.isfinite(own)), ok)
    # Summed in node order, as `_gathered_mean` does: the same bits in every layout
    # (a reduction's order may differ between compiled programs).
    decoded = jnp.where(ok[:, None], decoded, 0.0)
    total = decoded[0]
    for j in range(1, n):
        total = total + decoded[j]
    contributors = jnp.sum(ok.astype(jnp.int32))
    average = total / jnp.maximum(contributors, 1).astype(jnp.float32)  # a_me
    skipped = jnp.sum((~ok & ~mine).astype(jnp.int32))

    # Round 2: node c's averaged chunk goes to everyone, itself included.
    payload = compressor.encode(average, key_of(device_id(me), _ALL_GATHER, me))
    rows = jax.tree.map(lambda x: x[None], payload)
    gathered = gossip.all_gather_payload(_pack_rows(rows)[0], axis_name=axis_name)
    gathered = _unpack_rows(gathered, _row_of(rows))
    keys = jax.vmap(lambda s, c: key_of(s, _ALL_GATHER, c))(senders, peers)
    decoded, ok = _decode_rows(compressor, gathered, keys)
    decoded = jnp.where(ok[:, None], decoded, 0.0)
    skipped = skipped + jnp.sum((~ok).astype(jnp.int32))
    mean = decoded.reshape(-1)[: vector.size]
    if not error_feedback:
        return mean, skipped, None

    # e = v - t: Q(v_c) fell short of v_c on the chunks sent to others; on its own
    # chunk, the round-2 error Q(a_me) - a_me enters the mean n times over.
    sent = jax.vmap(lambda p, k: compressor.decode(p, key=k).astype(jnp.float32))(
        outgoing, sent_keys
    )
    own_error = n * (average - jnp.take(decoded, me, axis=0))
    error = jnp.where(mine[:, None], own_error[None], chunks - sent)
    return mean, skipped, error.reshape(-1)[: vector.size]


def _gathered_mean(
    vector: jax.Array,
    state: CompressedMeanState,
    *,
    compressor: compress_base.Compressor,
    axis_name: gossip.AxisName,
    device_id: Callable[[jax.Array], jax.Array],
    error_feedback: bool,
    residual: jax.Array | None = None,
    decay=1.0,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """One round: every node's whole payload to every node (one all-gather), averaged.

    Nothing is compressed twice: each node decodes the n payloads and sums them in
    node order, so every node ends with the same bits. Returns what `_two_round_mean`
    returns; the residual is v - Q(v). With error feedback `vector` is the update
    and v = vector + decay * residual is formed inside the compressor's
    `encode_feedback` (one fused pass on GPU for min-max).
    """
    n = jax.lax.axis_size(axis_name)
    me = gossip.node_index(axis_name)
    senders = device_id(jnp.arange(n))

    def key_of(sender):
        return one_round_key(state.key, state.count, sender)

    if error_feedback:
        assert residual is not None  # the caller passes the state's residual with feedback
        payload, error = compressor.encode_feedback(vector, residual, key_of(device_id(me)), decay)
    else:
        payload = compressor.encode(vector, key_of(device_id(me)))
    rows = jax.tree.map(lambda x: x[None], payload)
    gathered = gossip.all_gather_payload(_pack_rows(rows)[0], axis_name=axis_name)
    decoded, ok = _decode_rows(
        compressor, _unpack_rows(gathered, _row_of(rows)), jax.vmap(key_of)(senders)
    )
    decoded = jnp.where(ok[:, None], decoded, 0.0)
    total = decoded[0]
    for j in range(1, n):
        total = total + decoded[j]
    mean = total / jnp.maximum(jnp.sum(ok.astype(jnp.int32)), 1).astype(jnp.float32)
    skipped = jnp.sum((~ok).astype(jnp.int32))
    if not error_feedback:
        return mean, skipped, None
    return mean, skipped, error


def step(
    updates: optax.Updates,
    state: CompressedMeanState,
    hp: Hyperparams,
) -> tuple[optax.Updates, CompressedMeanState]:
    """The compressed mean of `updates` over the nodes; must run under the named axes.

    Args:
      updates: this device's update (its gradient).
      state: the state from `init` or the previous step.
      hp: the hyperparameters (`compressed_mean`'s arguments).

    Returns:
      (the mean over both axes, in each leaf's dtype; the next state).
    """
    gossip.require_axis(hp.axis_name, "compressed_mean")
    if hp.local_axis is None:

        def device_id(node):
            return node

    else:
        local_size = gossip.require_axis(hp.local_axis, "compressed_mean")
        rank = jax.lax.axis_index(hp.local_axis)

        def device_id(node):
            return node * local_size + rank

    ok = _common.all_finite(updates)
    health = health_lib.count_update(state.health, ok)
    leaves, treedef = jax.tree.flatten(updates)
    live = [i for i, u in enumerate(leaves) if u.size]
    out = [jnp.zeros_like(u) for u in leaves]
    if not live:  # nothing to send
        return jax.tree.unflatten(treedef, out), state._replace(
            count=state.count + 1, health=health
        )
    # NaN everywhere marks a non-finite update in every chunk.
    flat = jnp.concatenate([leaves[i].astype(jnp.float32).reshape(-1) for i in live])
    flat = jnp.where(ok, flat, jnp.nan)
    share = flat
    if hp.local_axis is not None:
        share = gossip.local_reduce_scatter(_pad(flat, local_size), axis_name=hp.local_axis)
    common: dict[str, Any] = dict(
        compressor=hp.compressor,
        axis_name=hp.axis_name,
        device_id=device_id,
        error_feedback=hp.error_feedback,
    )
    if hp.rounds == 1:
        # One round sends the whole share once: the residual enters inside the encode.
        residual = None
        if hp.error_feedback:
            assert not isinstance(state.residual, tuple)  # init_fn's residual: an array
            residual = state.residual
        mean, skipped, error = _gathered_mean(
            share, state, residual=residual, decay=hp.error_decay, **common
        )
    else:
        if hp.error_feedback:
            share = numerics.feedback_sum(share, state.residual, hp.error_decay)
        mean, skipped, error = _two_round_mean(share, state, **common)
    new_residual = state.residual
    if hp.error_feedback:
        # v = share (+ decay * residual) non-finite: keep the old residual.
        assert error is not None and not isinstance(state.residual, tuple)  # both arrays here
        new_residual = jnp.where(jnp.all(jnp.isfinite(error)), error, state.residual)
    if hp.local_axis is not None:
        mean = gossip.local_all_gather(mean, axis_name=hp.local_axis)[: flat.size]
    offset = 0
    for i in live:
        leaf = leaves[i]
        out[i] = mean[offset : offset + leaf.size].reshape(leaf.shape).astype(leaf.dtype)
        offset += leaf.size
    health = health_lib.count_received(health, skipped)
    return jax.tree.unflatten(treedef, out), CompressedMeanState(
        state.count + 1, state.key, health, new_residual
    )


def compressed_mean(
    compressor: compress_base.Compressor,
    *,
    axis_name: gossip.AxisName = "nodes",
    local_axis: str | None = None,
    seed: int | jax.Array = 0,
    error_feedback: bool = False,
    rounds: int = 2,
    error_decay: float = 1.0,
) -> optax.GradientTransformationExtraArgs:
    r"""Mean of the updates over the nodes by a two-round compressed all-reduce (seeds 001, 004).

    .. math::

      a_c = \frac{1}{n}\Big(v_c^{(c)} + \sum_{j \ne c} Q\big(v_c^{(j)}\big)\Big),\qquad
      \bar g = \big[\,Q(a_0), \dots, Q(a_{n-1})\,\big]

    :math:`v^{(j)} = g^{(j)}` is node j's incoming update, its leaves
    flattened and concatenated into one vector, and :math:`v^{(j)}_c` its
    chunk c; Q is `compressor` (encode then decode) and n the size of `axis_name`.
    Node c computes :math:`a_c`; every node receives every :math:`Q(a_c)`.
    For ``minmax(b, "nearest")`` each element of chunk c is within
    :math:`\frac{1}{n}\sum_{j \ne c} \frac{u_{jc}}{2} + \frac{u_c'}{2}` of the
    exact mean, :math:`u_{jc}` the step of node j's chunk c and :math:`u'_c`
    that of :math:`a_c` (range / (2^b - 1) per scale chunk); stochastic
    rounding makes the result unbiased. Each node sends, and receives, about
    2 (n - 1)/n times the compressed size of its update per step, half in each
    round, in one all-to-all and one all-gather.

    Error feedback (``error_feedback=True``): node j keeps a residual
    :math:`e^{(j)}` (zero at first), sends :math:`v^{(j)} = g^{(j)} + e^{(j)}`
    in the rounds above, and keeps what its transmission fell short by:

    .. math::

      t^{(j)}_c = Q\big(v^{(j)}_c\big)\ (c \ne j),\qquad
      t^{(j)}_j = v^{(j)}_j + n\big(Q(a_j) - a_j\big),\qquad
      e^{(j)} \leftarrow v^{(j)} - t^{(j)}

    Since :math:`Q(a_c) = a_c + (Q(a_c) - a_c)`, the result is exactly
    :math:`\bar g = \frac{1}{n}\sum_j t^{(j)}` (node c's own term carries the
    round-2 error n times), so over T steps the errors telescope:
    :math:`\sum_t \bar g_t = \sum_t \frac{1}{n}\sum_j g^{(j)}_t + \frac{1}{n}
    \sum_j \big(e^{(j)}_0 - e^{(j)}_T\big)`: the accumulated error stays
    that of one step instead of growing. A step whose v is not finite keeps
    the residual unchanged (and the identity then holds over the steps where
    all nodes' v were finite).

    One round (``rounds=1``, SparseLoCo's sparse aggregation): every node sends
    its whole payload :math:`Q(v^{(j)})` to every node (one all-gather) and each
    averages the n decoded payloads, :math:`\bar g = \frac{1}{n}\sum_j Q(v^{(j)})`;
    nothing is compressed twice, so top-k supports add up instead of being cut
    again, and the residual is :math:`e^{(j)} \leftarrow v^{(j)} - Q(v^{(j)})`.
    Each node receives n - 1 payloads per step (the two rounds: about 2): the
    right form for payloads that are small next to the model (sparse ones) or
    few nodes. A decayed residual (``error_decay`` = β < 1, SparseLoCo's
    :math:`e \leftarrow \beta e + \Delta`) sends :math:`v^{(j)} = g^{(j)} + \beta e^{(j)}`.

    With `local_axis`, the mean is over both axes: a full-precision
    reduce-scatter (mean) over `local_axis` first, then the two rounds between
    the nodes of `axis_name` on each 1/L shard, then a full-precision
    all-gather over `local_axis` (module docstring). There v is the machine's
    mean shard plus the residual of the local rank that holds it, and n is the
    number of machines.

    A centralized transform: put it FIRST in the chain, on the gradients,
    followed by a local optimizer. It must run under `axis_name` (and
    `local_axis`), with `jax.shard_map` or `jax.vmap(axis_name=...)`.

    Args:
      compressor: Q, an `lpdec` compressor other than `modulo`; seeds 001 and 004
        use ``lpdec.minmax(8, "stochastic")``.
      axis_name: the named axis whose instances are the nodes (machines); a
        tuple of axis names (e.g. ``("machines", "workers")``) makes their
        product one flat node axis when `local_axis` is None.
      local_axis: optional second named axis, the accelerators within a node.
      seed: seeds the shared key for stochastic rounding / random-k (an int
        or an int scalar array, so ``optax.inject_hyperparams`` works).
      error_feedback: keep a float32 residual of this device's share in the
        state and feed it back (above).
      rounds: 2, the scatter-reduce and all-gather above; or 1, an all-gather of
        every node's payload, averaged without compressing again (above).
      error_decay: β in (0, 1], the residual's decay before it is added back
        (error feedback only; 1 keeps it whole).

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
      Bagua's low precision gradient all-reduce, https://github.com/BaguaSys/bagua;
      Karimireddy et al., Error Feedback Fixes SignSGD and other Gradient
      Compression Schemes, ICML 2019, https://arxiv.org/abs/1901.09847;
      Sarfi et al., Communication Efficient LLM Pre-training with SparseLoCo,
      2025, https://arxiv.org/abs/2508.15706
    """
    hp = Hyperparams(**locals())

    def init_fn(params):
        _common.check_float_params(params, "compressed_mean")
        return init(params, hp)

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        return step(updates, state, hp)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


DECLARATION = declaration.Declaration(compressed_mean, "mean", (CompressedMeanState,), Hyperparams)
