"""Training-side measurements: consensus distance, averaged model, wire bytes from compiled HLO.

The functions on parameters take trees whose leaves carry a leading node axis
(what a `shard_map` over the node axis returns to the caller), so they need no
collective of their own.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any

_DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}

COLLECTIVES = (
    "collective-permute",
    "all-gather",
    "all-reduce",
    "all-to-all",
    "reduce-scatter",
    "collective-broadcast",
)

_ARRAY = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([0-9,]*)\]")
# `%name = <shape> <opcode>(<operands>), attributes`
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s+([a-z][a-z0-9\-]*)\((.*)$")


def average_model(params: PyTree) -> PyTree:
    """The node-averaged model: mean over the leading node axis of every leaf."""
    return jax.tree.map(lambda x: jnp.mean(x.astype(jnp.float32), axis=0).astype(x.dtype), params)


def consensus_distance(params: PyTree) -> jax.Array:
    """(1/n) sum_i ||x_i - x_bar||^2 over all leaves (leading node axis), float32 scalar."""
    total = jnp.float32(0)
    for x in jax.tree.leaves(params):
        x = x.astype(jnp.float32)
        total = total + jnp.sum(jnp.square(x - jnp.mean(x, axis=0)))
    n = jax.tree.leaves(params)[0].shape[0]
    return total / n


def hierarchical_average(params: PyTree, machine_axis: str, worker_axis: str) -> PyTree:
    """The mean of every node's `params`, for one node under machines x workers axes.

    Call it where both axes are bound (`NodeLayout.map` on a layout of machines). Each
    leaf is cut into k slices (k workers; zero-padded): worker w receives slice w of its
    machine's k models (an all-to-all over the fast links) and sums them in worker
    order, the machines' sums of slice w meet (an all-gather over the machines: each
    machine receives M - 1 models in all, once) and are summed in machine order, and
    the workers gather the slices back. The sums' order is fixed, so one process and
    several give the same bits, and the link carries the models once, not n times.
    """
    workers = jax.lax.axis_size(worker_axis)
    nodes = workers * jax.lax.axis_size(machine_axis)

    def in_order(stack):
        total = stack[0]
        for i in range(1, stack.shape[0]):
            total = total + stack[i]
        return total

    def mean(x):
        flat = jnp.ravel(x).astype(jnp.float32)
        flat = jnp.pad(flat, (0, -flat.size % workers))
        mine = jax.lax.all_to_all(flat.reshape(workers, -1), worker_axis, 0, 0)
        machines = jax.lax.all_gather(in_order(mine), machine_axis)
        total = in_order(machines) / nodes
        whole = jax.lax.all_gather(total, worker_axis, tiled=True)
        return whole[: x.size].reshape(x.shape).astype(x.dtype)

    return jax.tree.map(mean, params)


def _array_bytes(shape_text: str) -> list[tuple[str, int]]:
    out = []
    for dtype, dims in _ARRAY.findall(shape_text):
        size = 1
        for d in filter(None, dims.split(",")):
            size *= int(d)
        out.append((dtype, size * _DTYPE_BYTES[dtype]))
    return out


@dataclasses.dataclass(frozen=True)
class CollectiveTraffic:
    """What one device sends through each kind of collective in one program run.

    Attributes:
      bytes_by_op: {opcode: bytes of the operands that device contributes}.
      count_by_op: {opcode: number of instructions}.
      bytes_by_dtype: {(opcode, dtype): bytes}, e.g. ("collective-permute", "u8").
    """

    bytes_by_op: dict[str, int]
    count_by_op: dict[str, int]
    bytes_by_dtype: dict[tuple[str, str], int]

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_op.values())

    def ops(self) -> set[str]:
        return set(self.count_by_op)


def _alone(attributes: str) -> bool:
    """Whether a collective's replica groups each hold one device (an axis of size 1, e.g.
    FSDP over a machine of one worker): it sends nothing."""
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]", attributes)
    if iota:
        return int(iota.group(2)) == 1
    listed = re.search(r"replica_groups=\{((?:\{[^{}]*\},?)+)\}", attributes)
    if listed:
        groups = re.findall(r"\{([^{}]*)\}", listed.group(1))
        return all("," not in group for group in groups)
    return False


def collective_traffic(hlo_text: str) -> CollectiveTraffic:
    """Parses compiled HLO text (`jax.jit(f).lower(...).compile().as_text()`).

    Counts, per collective opcode, the bytes of each instruction's operands
    (for async `-start` forms, the operands of the start; `-done` is skipped),
    looking operand shapes up by name where the text does not spell them out.
    In an SPMD program these are the bytes one device sends (or contributes)
    per run; a collective-permute in which a device is no source sends nothing
    from it, so this is an upper bound for devices outside the permutation. A
    collective whose replica groups each hold one device sends nothing and is not
    counted.
    """
    shapes: dict[str, str] = {}
    instructions = []
    for line in hlo_text.splitlines():
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        name = line.split("=", 1)[0].replace("ROOT", "").strip().lstrip("%")
        result_shape, opcode, rest = match.groups()
        shapes[name] = result_shape
        instructions.append((result_shape, opcode, rest))
    by_op: dict[str, int] = collections.Counter()
    count: dict[str, int] = collections.Counter()
    by_dtype: dict[tuple[str, str], int] = collections.Counter()
    for result_shape, opcode, rest in instructions:
        base = opcode.removesuffix("-start")
        if base not in COLLECTIVES or opcode.endswith("-done") or _alone(rest):
            continue
        # Operands run to the closing parenthesis before the attributes.
        operands = rest.split("), ")[0].rstrip(")")
        arrays = _array_bytes(operands)
        if not arrays:
            for name in re.findall(r"%([\w.\-]+)", operands):
                arrays.extend(_array_bytes(shapes.get(name, "")))
        if not arrays:
            arrays = _array_bytes(result_shape)
        count[base] += 1
        for dtype, nbytes in arrays:
            by_op[base] += nbytes
            by_dtype[(base, dtype)] += nbytes
    return CollectiveTraffic(dict(by_op), dict(count), dict(by_dtype))


def compiled_traffic(fn, *args, **kwargs) -> CollectiveTraffic:
    """Compiles `jax.jit(fn)` for `args` and returns its `collective_traffic`."""
    text = jax.jit(fn).lower(*args, **kwargs).compile().as_text()
    if text is None:
        raise RuntimeError("this backend gives no text of the compiled program to count.")
    return collective_traffic(text)


def tree_bytes(tree: PyTree) -> int:
    """Bytes of every array leaf of a tree (e.g. a payload tree)."""
    return int(
        sum(np.dtype(x.dtype).itemsize * int(np.prod(x.shape)) for x in jax.tree.leaves(tree))
    )
