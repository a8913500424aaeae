r"""Gossip between machines, one slice of the model per worker: hierarchical gossip.

On a layout of machines x workers (`lpdec.make_layout(n, machines=M)`) whose
workers of a machine hold the SAME model (their gradients were averaged first,
``lpdec.local_mean(axis_name=layout.worker_axis)``), a gossip algorithm needs
to run once per machine, not once per worker. `shard_over` runs it once per
machine, split into k parts: the model is flattened into one float32 vector
(padded to a multiple of k, the number of workers), worker w runs the
inner algorithm, between machines, on slice w only, and the workers then
all-gather their slices of the update in full precision over the fast links
inside the machine:

.. math::

  v = [\,x\,;\,x_d, \dots, x_d\,],\quad v_w = v[w s : (w + 1) s],\quad
  u^{+} = \mathrm{gather}_w\big(\mathcal{A}(u_w, x_w)\big)

with :math:`s = \lceil d / k \rceil` and :math:`\mathcal{A}` the inner
algorithm. Each machine thus sends one model-sized payload per edge in total
(1/k of it from each worker) instead of k copies, and keeps 1/k of the inner
algorithm's state on each worker.

It is exact, i.e. the machines follow the inner algorithm's rule on their
whole models, for the elementwise gossip algorithms (every one of lpdec's)
with the compressor applied slice by slice, which is the compressor a
reference must apply. For min-max with ``chunk_size`` dividing s this is the
whole-model compressor itself (its chunks fall within slices); otherwise each
slice starts new chunks. top_k / random_k keep their ratio of each slice, not
of the whole model. The padding repeats the last element: an elementwise
algorithm keeps each padded entry equal to the last entry on every machine,
so no chunk's range ever changes (zeros would widen the last chunk's).
Randomness: the workers of a machine draw with their machine's key, so their
slices see the same stream (random_k picks the same positions in every
slice).
"""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from lpdec import gossip
from lpdec.algorithms import _common
from lpdec.algorithms import declaration

PyTree = Any


class ShardOverState(NamedTuple):
    """State of `shard_over`.

    Attributes:
      inner: the inner algorithm's state for this worker's slice of the model
        (its buffers hold s = ceil(d / k) elements, not d).
    """

    inner: Any


def _flatten(tree: PyTree, workers: int) -> jax.Array:
    """Every leaf, flattened and concatenated in float32, padded to a multiple of `workers`.

    The padding repeats the last element, which leaves every chunk's range unchanged.
    """
    leaves = jax.tree.leaves(tree)
    vector = jnp.concatenate([jnp.ravel(x).astype(jnp.float32) for x in leaves])
    extra = -vector.size % workers
    return jnp.pad(vector, (0, extra), mode="edge") if extra else vector


def _my_slice(tree: PyTree, axis_name: gossip.AxisName) -> jax.Array:
    """This worker's slice of the flattened, padded `tree`."""
    workers = jax.lax.axis_size(axis_name)
    vector = _flatten(tree, workers)
    size = vector.size // workers
    return jax.lax.dynamic_slice_in_dim(vector, gossip.node_index(axis_name) * size, size)


def _unflatten(vector: jax.Array, like: PyTree) -> PyTree:
    """The leading elements of `vector` as a tree shaped (and typed) like `like`."""
    leaves, treedef = jax.tree.flatten(like)
    out, start = [], 0
    for leaf in leaves:
        out.append(vector[start : start + leaf.size].reshape(leaf.shape).astype(leaf.dtype))
        start += leaf.size
    return jax.tree.unflatten(treedef, out)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hyperparams:
    """`shard_over`'s arguments, validated on construction; `init` and `step` read them."""

    inner: optax.GradientTransformation
    axis_name: gossip.AxisName

    def __post_init__(self):
        if not isinstance(self.inner, optax.GradientTransformation):
            raise TypeError(
                "shard_over needs an optax transform to run between the machines (e.g. lpdec.choco("
                "lpdec.ring(2), lpdec.minmax(8), axis_name='machines')); "
                f"got {self.inner!r}."
            )
        if not isinstance(self.axis_name, (str, tuple)):
            raise TypeError(f"shard_over: axis_name must be an axis name; got {self.axis_name!r}.")


def init(params: optax.Params, hp: Hyperparams) -> ShardOverState:
    """`inner`'s state for this worker's slice of `params`; must run under `axis_name`."""
    gossip.require_axis(hp.axis_name, "shard_over's init")
    return ShardOverState(hp.inner.init(_my_slice(params, hp.axis_name)))


def step(
    updates: optax.Updates,
    state: ShardOverState,
    params: optax.Params,
    hp: Hyperparams,
    **extra_args: Any,
) -> tuple[optax.Updates, ShardOverState]:
    """`inner` on this worker's slice, then the slices gathered over `axis_name`."""
    gossip.require_axis(hp.axis_name, "shard_over")
    sliced, inner_state = hp.inner.update(
        _my_slice(updates, hp.axis_name), state.inner, _my_slice(params, hp.axis_name), **extra_args
    )
    # Every worker ends with the same full update: the machine's model stays one model.
    # Over a pair of axes (workers, nested vmap) the inner axis is gathered first, which
    # is the row-major order of the slices (jax cannot gather a mesh and a vmap axis at once).
    whole = sliced
    for name in reversed((hp.axis_name,) if isinstance(hp.axis_name, str) else hp.axis_name):
        whole = gossip.local_all_gather(whole, axis_name=name)
    return _unflatten(whole, updates), ShardOverState(inner_state)


def shard_over(
    inner: optax.GradientTransformation, *, axis_name: gossip.AxisName
) -> optax.GradientTransformationExtraArgs:
    r"""Runs a gossip algorithm between machines on 1/k of the model per worker.

    .. math::

      u^{+} = \mathrm{gather}_{w}\big(\mathcal{A}(u[w], x[w])\big)

    :math:`\mathcal{A}` is `inner`, x[w] and u[w] the slice of worker w (the
    index along `axis_name`, of k) of the flattened, padded parameters and
    update (module docstring). The workers of a machine must hold the same
    parameters and receive the same update: put
    ``lpdec.local_mean(axis_name=axis_name)`` first in the chain.

    Args:
      inner: a gossip algorithm communicating between the machines, e.g.
        ``lpdec.choco(lpdec.ring(M), lpdec.minmax(8), axis_name="machines")``;
        it sees a flat float32 vector of ceil(d / k) elements.
      axis_name: the named axis of a machine's workers (``layout.worker_axis``).

    Returns:
      An optax transform to put last in the chain; `update` needs `params`.
      `init` and `update` must run under `axis_name` and `inner`'s axis.

    Example:
      >>> layout = lpdec.make_layout(8, machines=2)
      >>> tx = optax.chain(
      ...     lpdec.local_mean(axis_name=layout.worker_axis),
      ...     optax.sgd(0.1),
      ...     lpdec.shard_over(
      ...         lpdec.choco(lpdec.ring(2), lpdec.minmax(8), axis_name=layout.machine_axis),
      ...         axis_name=layout.worker_axis,
      ...     ),
      ... )

    References:
      Seed 004's hierarchy (reduce inside a machine, exchange between), applied
      to gossip; Koloskova et al., CHOCO-SGD, https://arxiv.org/abs/1907.09356
    """
    hp = Hyperparams(**locals())

    def init_fn(params):
        return init(params, hp)

    def update_fn(updates, state, params=None, **extra_args):
        params = _common.require_params(params, "shard_over")
        return step(updates, state, params, hp, **extra_args)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


DECLARATION = declaration.Declaration(shard_over, "wrapper", (ShardOverState,), Hyperparams)
