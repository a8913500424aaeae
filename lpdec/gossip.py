"""Communication along a topology's edges: the only module of lpdec that calls collectives.

Every function here must run under the named axis `axis_name` (inside
`jax.shard_map` over a mesh axis of that name, or `jax.vmap(...,
axis_name=...)`), with one program instance per node.

A gossip step sends a payload pytree along each edge class of the step's round
(one `lax.ppermute` per class: two for a ring) and combines what arrives with
the receiver's weights. Time-varying topologies pick their round with
`lax.switch` on the (traced) step, so one compiled program serves every step.

The centralized transforms (`compressed_mean`, `local_mean`) use the
all-to-all / all-gather / reduce-scatter helpers below; each maps over a
pytree, so a payload tree (codes, scales) travels in one call, and each works
under `shard_map`, `vmap` and both nested (a 2-axis mesh).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from lpdec import host_sum
from lpdec import wire
from lpdec.compress import base as compress_base
from lpdec.topology import Round
from lpdec.topology import Topology

PyTree = Any
AxisName = str | tuple[str, ...]


def require_axis(axis_name: AxisName, who: str, *, topology: Topology | None = None) -> int:
    """The size of `axis_name`; a one-line ValueError naming `who` if it is not bound here.

    With `topology`, also checks that its node count equals the axis size
    (the trace-time half of a topology check; the algorithms' factories check
    the matrix itself when they are built).
    """
    try:
        size = jax.lax.axis_size(axis_name)
    except NameError:
        mesh_axes = tuple(jax.sharding.get_abstract_mesh().axis_names)
        scope = (
            f"the mesh axes in scope are {mesh_axes}"
            if mesh_axes
            else "no shard_map mesh axis is in scope"
        )
        raise ValueError(
            f"{who} communicates over the named axis {axis_name!r}, which is not bound here "
            f"({scope}; vmap axis names cannot be listed): run it inside jax.shard_map over a "
            f"mesh with an axis {axis_name!r} or inside jax.vmap(..., axis_name={axis_name!r}) "
            "(lpdec.init_nodes and NodeLayout.map do this for you), or fix axis_name."
        ) from None
    if topology is not None:
        topology.check_axis_size(size, axis_name)
    return size


def _split_axes(axis_name: AxisName) -> tuple[str, str] | None:
    """(outer, inner) where jax cannot run one collective over `axis_name`: two axes,
    not both `shard_map` mesh axes (a vmap axis among them); else None."""
    names = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    manual = jax.sharding.get_abstract_mesh().manual_axes
    if len(names) == 1 or all(name in manual for name in names):
        return None
    if len(names) != 2:
        raise ValueError(f"axis_name={axis_name!r}: at most (mesh axis, vmap axis) here.")
    return names


def all_to_all_payload(payload_chunks: PyTree, *, axis_name: AxisName) -> PyTree:
    """Personalised exchange: row c of every leaf goes to node c.

    Args:
      payload_chunks: a pytree whose leaves have a leading axis of size n (the
        axis size); row c is what this node sends to node c (row `me` stays).
      axis_name: the nodes' axis, or (mesh axis, vmap axis) for several nodes per
        device: node (o, i) is then node o * L + i, as `lax.axis_index` numbers it.

    Returns:
      The same structure and shapes; row c is what node c sent to this node.
    """
    # The operand counted like compiled HLO counts it (all n rows); its link bytes, n - 1.
    wire.record(payload_chunks, axis_name, collective="all_to_all")
    split = _split_axes(axis_name)
    if split is None:
        return jax.lax.all_to_all(payload_chunks, axis_name, 0, 0)
    # jax has no all-to-all over a mesh axis and a vmap axis at once: one per axis.
    # Rows [O * L] as [O, L]: the vmap axis exchanges the column block (row (p, q) of
    # node (o, i) reaches node (o, q) at (p, i)), then the mesh axis the row block.
    outer, inner = split
    sizes = (jax.lax.axis_size(outer), jax.lax.axis_size(inner))

    def exchange(x):
        x = x.reshape(sizes + x.shape[1:])
        x = jax.lax.all_to_all(x, inner, 1, 1)
        x = jax.lax.all_to_all(x, outer, 0, 0)
        return x.reshape((-1,) + x.shape[2:])

    return jax.tree.map(exchange, payload_chunks)


def all_gather_payload(payload: PyTree, *, axis_name: AxisName) -> PyTree:
    """Every node's `payload`, stacked along a new leading axis of size n (row c: node c's).

    `axis_name` as in `all_to_all_payload`; over (mesh axis, vmap axis) it gathers
    over the vmap axis, then the mesh axis (jax cannot gather over both at once).
    """
    wire.record(payload, axis_name, collective="all_gather")
    split = _split_axes(axis_name)
    if split is None:
        return jax.lax.all_gather(payload, axis_name)
    outer, inner = split

    def gather(x):
        x = jax.lax.all_gather(jax.lax.all_gather(x, inner), outer)  # [O, L, ...]
        return x.reshape((-1,) + x.shape[2:])

    return jax.tree.map(gather, payload)


def local_reduce_scatter(x: PyTree, *, axis_name: str) -> PyTree:
    """Full-precision mean over `axis_name`, scattered: rank l gets block l of the leading axis.

    Each leaf's leading dimension must be a multiple of the axis size L; the
    result's is 1/L of it.
    """
    size = jax.lax.axis_size(axis_name)
    wire.record(x, axis_name, collective="psum_scatter")
    summed = jax.lax.psum_scatter(x, axis_name, scatter_dimension=0, tiled=True)
    return jax.tree.map(lambda s: s / size, summed)


def local_all_gather(x: PyTree, *, axis_name: str) -> PyTree:
    """Concatenation of every rank's `x` along the leading axis, in rank order (tiled)."""
    wire.record(x, axis_name, collective="all_gather")
    return jax.lax.all_gather(x, axis_name, tiled=True)


def local_sum(x: PyTree, *, axis_name: AxisName) -> PyTree:
    """Full-precision sum over `axis_name`: one all-reduce of one buffer per dtype.

    The leaves of each dtype are concatenated into one vector before the
    all-reduce and split after it (DDP's buckets): the sums are the same, element
    by element, but a collective's fixed cost is paid once. XLA:CPU's collectives
    across processes (gloo) run one all-reduce per operand of a tree's psum: for
    lm_tiny's 29 gradient arrays across 2 processes, 11-16 ms against 1-4 ms for the
    same bytes as one array (BENCHMARKS.md, "The step across processes").

    Over two axes (outer, inner), a hierarchical run's (machines, workers), the
    buffer is summed in three steps: a reduce-scatter over `inner` (each worker sums
    1/L of it across its machine), a sum of that block over `outer`, an all-gather
    over `inner`. Between machines the blocks add up to one buffer, where one
    all-reduce over both axes runs a ring over all O x L workers and puts 2 (OL - 1)
    / OL buffers on a machine's link (the MLP's 2 x 4 layout: 7.74 MB a step against
    4.41, BENCHMARKS.md "bench/link.py parity mlp 2x4"). Every worker gets the same
    sum (each block is gathered from the one worker that summed it).
    """
    # With one device per process and the axis exactly the processes, a process may
    # have installed lpdec's TCP sum (`lpdec.host_sum`: jax's gloo stalls on one core;
    # its star sends 2 (P - 1) / P of the buffer a process on average, as a ring does).
    routed = host_sum.routes(axis_name)

    def total(flat: jax.Array) -> jax.Array:
        if routed:
            wire.record(flat, axis_name, collective="psum")
            return host_sum.psum(flat)
        split = _splits(flat, axis_name)
        wire.record(flat, axis_name, collective="hierarchical_psum" if split else "psum")
        return _hierarchical_sum(flat, *axis_name) if split else jax.lax.psum(flat, axis_name)

    leaves, treedef = jax.tree.flatten(x)
    groups: dict[Any, list[int]] = {}
    for i, leaf in enumerate(leaves):
        groups.setdefault(jnp.result_type(leaf), []).append(i)
    out: list[Any] = list(leaves)
    for indices in groups.values():
        summed = total(jnp.concatenate([jnp.ravel(leaves[i]) for i in indices]))
        at = 0
        for i in indices:
            size = int(np.size(leaves[i]))
            out[i] = summed[at : at + size].reshape(jnp.shape(leaves[i]))
            at += size
    return jax.tree.unflatten(treedef, out)


def _splits(flat: jax.Array, axis_name: AxisName) -> bool:
    """Whether a sum of `flat` over `axis_name` runs as `_hierarchical_sum`: two manual
    mesh axes (outer, inner), each of more than one device, and at least a block per
    inner rank (a vmap axis among them: one psum, which jax's psum_scatter cannot batch)."""
    if isinstance(axis_name, str) or len(axis_name) != 2:
        return False
    outer, inner = axis_name
    manual = jax.sharding.get_abstract_mesh().manual_axes
    if outer not in manual or inner not in manual:
        return False
    blocks = jax.lax.axis_size(inner)
    return blocks > 1 and jax.lax.axis_size(outer) > 1 and flat.size >= blocks


def _hierarchical_sum(flat: jax.Array, outer: str, inner: str) -> jax.Array:
    """`psum(flat, (outer, inner))` over two mesh axes as reduce-scatter over inner, sum
    over outer, all-gather over inner (where `_splits` holds)."""
    blocks = jax.lax.axis_size(inner)
    padded = jnp.pad(flat, (0, -flat.size % blocks))
    block = jax.lax.psum_scatter(padded, inner, scatter_dimension=0, tiled=True)
    block = jax.lax.psum(block, outer)
    return jax.lax.all_gather(block, inner, tiled=True)[: flat.size]


def node_index(axis_name: AxisName) -> jax.Array:
    """This node's index along `axis_name` (int32 scalar)."""
    return jax.lax.axis_index(axis_name)


def per_node(values: np.ndarray, axis_name: AxisName) -> jax.Array:
    """Picks this node's entry of a static per-node numpy array."""
    return jnp.asarray(values)[node_index(axis_name)]


def to_varying(tree: PyTree, axis_name: str | Sequence[str]) -> PyTree:
    """Marks every leaf as varying over `axis_name` under `shard_map` (no-op elsewhere).

    State that differs between nodes after one step must start out varying, or
    carrying it through `lax.scan` inside `shard_map(check_vma=True)` fails with
    a type mismatch between the carry's input and output.
    """
    names = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    manual = jax.sharding.get_abstract_mesh().manual_axes
    names = tuple(n for n in names if n in manual)
    if not names:
        return tree

    def cast(x):
        missing = tuple(n for n in names if n not in jax.typeof(x).manual_axis_type.varying)
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree)


def in_round(topology: Topology, step: jax.Array, fn: Callable[[Round], PyTree]) -> PyTree:
    """`fn(round)` for the round used at `step`: a `lax.switch` if the topology varies in time.

    `fn`'s output must have the same structure for every round.
    """
    if topology.period == 1:
        return fn(topology.rounds[0])

    def branch(round_):
        with wire.share(1.0 / topology.period):
            return fn(round_)

    branches = [lambda r=r: branch(r) for r in topology.rounds]
    return jax.lax.switch(jnp.asarray(step, jnp.int32) % topology.period, branches)


class Received(NamedTuple):
    """What one node receives in one round, class by class.

    Attributes:
      payloads: one payload tree per edge class (zeros where nothing arrived).
      weights: W_{i, s_c(i)} per class: float32 scalars, 0 where nothing arrived.
      senders: s_c(i) per class: int32 scalars, -1 where nothing arrived.
      self_weight: W_ii, float32 scalar.
    """

    payloads: list[PyTree]
    weights: list[jax.Array]
    senders: list[jax.Array]
    self_weight: jax.Array


def ppermute(tree: PyTree, perm: Sequence[tuple[int, int]], *, axis_name: AxisName) -> PyTree:
    """`lax.ppermute` of a tree along a partial permutation; non-receivers get zeros.

    The tree travels as few buffers (`pack`): its large leaves and one uint8
    buffer holding all the small ones.

    Under `vmap` jax only batches full permutations, so there the permutation
    is completed with pairs from the idle senders to the idle receivers and
    what those pairs deliver is zeroed (no bandwidth is involved in a vmap).
    Under `shard_map` the partial permutation is sent as is. A pair of axis
    names (a mesh axis, then a vmap axis nested inside it: several simulated
    nodes per device) goes through `_nested_ppermute`.
    """
    buffers, unpack = wire.pack(tree)
    senders = len(perm) / jax.lax.axis_size(axis_name)
    wire.record(buffers, axis_name, senders, collective="ppermute")
    return unpack(_ppermute_array(buffers, perm, axis_name))


def _ppermute_array(tree: PyTree, perm, axis_name: AxisName) -> PyTree:
    if isinstance(axis_name, tuple):
        if len(axis_name) == 1:
            axis_name = axis_name[0]
        elif set(axis_name) <= set(jax.sharding.get_abstract_mesh().manual_axes):
            # Mesh axes only (machines, workers): jax permutes over their row-major product.
            return jax.lax.ppermute(tree, axis_name, perm)
        else:
            return _nested_ppermute(tree, perm, axis_name)
    n = jax.lax.axis_size(axis_name)
    if len(perm) == n or axis_name in jax.sharding.get_abstract_mesh().manual_axes:
        return jax.lax.ppermute(tree, axis_name, perm)
    sources = {s for s, _ in perm}
    targets = {d for _, d in perm}
    idle_sources = [i for i in range(n) if i not in sources]
    idle_targets = [i for i in range(n) if i not in targets]
    full = list(perm) + list(zip(idle_sources, idle_targets, strict=True))
    receives = np.zeros(n, dtype=bool)
    receives[list(targets)] = True
    received = jax.lax.ppermute(tree, axis_name, full)
    keep = per_node(receives, axis_name)
    return jax.tree.map(lambda x: jnp.where(keep, x, jnp.zeros_like(x)), received)


def _nested_ppermute(tree: PyTree, perm, axis_name: tuple[str, ...]) -> PyTree:
    """ppermute over (outer..., inner) axes: node g = outer_index * L + inner_index.

    jax cannot ppermute over a mesh axis and a vmap axis at once, so each
    class is split by device shift delta = (destination device - source
    device) mod D: one ppermute over the outer axis moves every slot by delta
    devices, then the receiving slot picks its source slot from an all-gather
    over the inner (vmap) axis, which stays on the device. A device shift moves
    all L slots of a device even where fewer are needed: this path is for
    simulating many nodes per device, and bytes on the wire should be counted
    from payload sizes, not from its HLO.
    """
    if len(axis_name) < 2:
        raise ValueError(f"nested axes must be (mesh_axes..., vmap_axis); got {axis_name!r}.")
    # The mesh axes (one, or machines and workers) act as one outer axis, row-major.
    outer = axis_name[0] if len(axis_name) == 2 else axis_name[:-1]
    inner = axis_name[-1]
    devices = jax.lax.axis_size(outer)
    local = jax.lax.axis_size(inner)
    n = devices * local
    me = jax.lax.axis_index(axis_name)
    shift_of = np.full(n, -1, dtype=np.int32)  # device shift that feeds each destination
    slot_of = np.zeros(n, dtype=np.int32)  # source slot each destination reads
    for src, dst in perm:
        shift_of[dst] = (dst // local - src // local) % devices
        slot_of[dst] = src % local
    my_shift = jnp.asarray(shift_of)[me]
    my_slot = jnp.asarray(slot_of)[me]
    out = jax.tree.map(jnp.zeros_like, tree)
    for delta in sorted(set(shift_of[shift_of >= 0].tolist())):
        moved = tree
        if delta:
            pairs = [(d, (d + delta) % devices) for d in range(devices)]
            moved = jax.lax.ppermute(tree, outer, pairs)
        block = jax.lax.all_gather(moved, inner)  # every slot of this device, after the shift
        take = my_shift == delta
        out = jax.tree.map(lambda o, b, t=take: jnp.where(t, b[my_slot], o), out, block)
    return out


def exchange(payload: PyTree, round_: Round, *, axis_name: AxisName) -> Received:
    """Sends `payload` along every edge class of `round_` (one ppermute each)."""
    return Received(
        payloads=[ppermute(payload, c.perm, axis_name=axis_name) for c in round_.edge_classes],
        weights=[per_node(c.recv_weight, axis_name) for c in round_.edge_classes],
        senders=[per_node(c.senders, axis_name) for c in round_.edge_classes],
        self_weight=per_node(round_.self_weight, axis_name),
    )


def mix(tree: PyTree, round_: Round, *, axis_name: AxisName) -> tuple[PyTree, jax.Array]:
    """Full-precision gossip: sum_j W_ij x_j in float32 (one ppermute per edge class).

    A neighbour whose tree holds NaN/Inf is replaced by the node's own value
    (its weight moves to the diagonal), so rows of W still sum to what they did.

    Returns:
      (the mixed tree in float32, number of non-finite neighbour trees replaced).
    """
    received = exchange(tree, round_, axis_name=axis_name)
    leaves, treedef = jax.tree.flatten(tree)
    own = [x.astype(jnp.float32) for x in leaves]
    acc = [received.self_weight * x for x in own]
    skipped = jnp.int32(0)
    for payload, weight in zip(received.payloads, received.weights, strict=True):
        neighbor = compress_base.flatten_up_to(treedef, payload)
        ok = jnp.all(jnp.stack([jnp.all(jnp.isfinite(y)) for y in neighbor]))
        acc = [
            a + weight * jnp.where(ok, y.astype(jnp.float32), x)
            for a, y, x in zip(acc, neighbor, own, strict=True)
        ]
        skipped = skipped + jnp.where(ok, 0, 1).astype(jnp.int32)
    return jax.tree.unflatten(treedef, acc), skipped


def payload_is_finite(compressor: compress_base.Compressor, payload: PyTree) -> jax.Array:
    """bool scalar: every leaf payload of a payload tree is finite."""
    flags = [
        compressor.is_finite(p) for p in jax.tree.leaves(payload, is_leaf=compress_base.is_payload)
    ]
    return jnp.all(jnp.stack(flags)) if flags else jnp.bool_(True)


def accumulate(
    compressor: compress_base.Compressor,
    received: Received,
    acc: PyTree,
    *,
    reference: PyTree | None = None,
    sender_key: Callable[[jax.Array], jax.Array] | None = None,
    substitute: PyTree | None = None,
) -> tuple[PyTree, jax.Array]:
    """acc + sum_c W_{i, s_c(i)} decode(payload_c): the weighted neighbour sum.

    Each class is decoded into the float32 accumulator directly
    (`Compressor.decode_accumulate`), so no decoded copy per neighbour is kept.
    A payload that is not finite (the sender's state held NaN/Inf) is never
    added: one failing node cannot poison its neighbours.

    Args:
      compressor: how the payloads were encoded.
      received: the output of `exchange`.
      acc: float32 tree shaped like the model.
      reference: the receiver's own model, for compressors that decode against
        it (modulo).
      sender_key: maps a sender's index to the key it encoded with, for
        compressors whose receivers need it (random-k).
      substitute: what a non-finite payload stands for (float32 tree, e.g. the
        receiver's own decoded value, which keeps the row sums of W); None
        drops it (right for increments, which the sender drops too).

    Returns:
      (acc, number of non-finite payloads not used, int32 scalar).
    """
    skipped = jnp.int32(0)
    leaves, treedef = jax.tree.flatten(acc)
    n = len(leaves)
    refs = [None] * n if reference is None else compress_base.flatten_up_to(treedef, reference)
    subs = None if substitute is None else compress_base.flatten_up_to(treedef, substitute)
    for payload, weight, sender in zip(
        received.payloads, received.weights, received.senders, strict=True
    ):
        payload_leaves = compress_base.flatten_up_to(treedef, payload)
        keys: list[jax.Array | None] = [None] * n
        if sender_key is not None:
            keys = list(jax.random.split(sender_key(sender), n))
        ok = payload_is_finite(compressor, payload)
        new = [
            compressor.decode_accumulate(p, a, weight, reference=r, key=k)
            for p, a, r, k in zip(payload_leaves, leaves, refs, keys, strict=True)
        ]
        if subs is None:
            fallback = leaves
        else:
            fallback = [a + weight * x for a, x in zip(leaves, subs, strict=True)]
        leaves = [jnp.where(ok, a, b) for a, b in zip(new, fallback, strict=True)]
        skipped = skipped + jnp.where(ok, 0, 1).astype(jnp.int32)
    return jax.tree.unflatten(treedef, leaves), skipped


def accumulate_per_class(
    compressor: compress_base.Compressor,
    received: Received,
    replicas: Sequence[PyTree],
    *,
    sender_key: Callable[[jax.Array], jax.Array] | None = None,
) -> tuple[tuple[PyTree, ...], jax.Array]:
    """Per-peer replicas: x_hat_c += decode(payload_c), one replica per edge class.

    Each class's payload is added with weight exactly 1 (0 where nothing
    arrived in that class), the same float32 add its owner makes, so a replica
    stays bit-identical to the public copy it mirrors. Used by the
    ``replicas="per_peer"`` variants of CHOCO and DCD.

    Returns:
      (the updated replicas, number of non-finite payloads not used).
    """
    updated, skipped = [], jnp.int32(0)
    for c, replica in enumerate(replicas):
        one = received._replace(
            payloads=[received.payloads[c]],
            weights=[jnp.where(received.weights[c] > 0, 1.0, 0.0).astype(jnp.float32)],
            senders=[received.senders[c]],
        )
        replica, dropped = accumulate(compressor, one, replica, sender_key=sender_key)
        updated.append(replica)
        skipped = skipped + dropped
    return tuple(updated), skipped
