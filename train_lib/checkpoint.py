"""Checkpoints of a run in `workdir/checkpoints`, through orbax's `CheckpointManager`.

A checkpoint holds the train state `{"params", "opt_state", "model_state"}`
(every node's; the optimizer state with the algorithms' replicas, error
buffers, push-sum weights and keys) and a JSON `meta` `{"step", "batcher",
"divergence", "loss_jumps", "checksum", "fingerprint"}`: the data position,
which with the state is all a restarted run needs to end bit-identical to an
uninterrupted one; what the divergence and loss-jump checks have seen (the
streak of bad log intervals, the running minimum and the warnings), so that a
resumed run reaches the same verdict and summary; a checksum of the state's bits;
and the config fields that shape the state and the math.

Restoring is checked, newest step first:

- the fingerprint must match the new run's config, except for the fields in
  `RESUMABLE_FIELDS`; a mismatch is a `ConfigError` listing the fields (a
  changed algorithm or node count would otherwise load into the wrong state);
- the restored state's checksum must match the saved one and every float in it
  must be finite; a step that fails (or that orbax cannot read at all) is moved
  aside to `checkpoints/<step>.damaged`, with a one-line warning, and the next
  older step is tried; with none left, a `CheckpointError`.

`export_params` writes the final parameters as a plain `.npz` for other tools.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.experimental.multihost_utils
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

import lpdec
from train_lib.errors import ConfigError
from train_lib.errors import RunError
from train_lib.errors import flatten_config

PyTree = Any

# Config fields a resumed run may change: they decide how long to train and what
# to log or write, not the state's shapes or the update's math.
RESUMABLE_FIELDS = frozenset(
    {
        "num_epochs",
        "num_steps",
        "log_every",
        "checkpoint_every",
        "halt_after_steps",
        "eval_local_examples",
        "save_final_params",
        "data_dir",
        "divergence_factor",
        "divergence_patience",
    }
)


class CheckpointError(RunError):
    """No checkpoint in the workdir can be restored (all damaged)."""


def manager(workdir: str) -> ocp.CheckpointManager:
    """The run's manager; it keeps the last two checkpoints."""
    return ocp.CheckpointManager(
        os.path.join(workdir, "checkpoints"),
        options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True),
    )


def fingerprint(config) -> dict[str, Any]:
    """The config's fields that a resumed run must keep (all but `RESUMABLE_FIELDS`)."""
    flat = flatten_config(config)
    return {k: v for k, v in sorted(flat.items()) if k.split(".")[0] not in RESUMABLE_FIELDS}


def _words(x: jax.Array) -> jax.Array:
    """x's bits as a flat uint32 array (one word per element of up to 4 bytes)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.reshape(-1).astype(jnp.uint32)
    size = np.dtype(x.dtype).itemsize
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[size]
    return jax.lax.bitcast_convert_type(x, unsigned).reshape(-1).astype(jnp.uint32)


def _mix(h: jax.Array) -> jax.Array:
    """A 32-bit finaliser (MurmurHash3's): every input bit moves about half the output bits."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


@jax.jit
def _checksum(state: PyTree) -> jax.Array:
    total = jnp.uint32(0)
    for leaf_index, leaf in enumerate(jax.tree.leaves(state)):
        words = _words(leaf)
        position = jax.lax.iota(jnp.uint32, words.size) + jnp.uint32(
            (leaf_index * 0x9E3779B9) & 0xFFFFFFFF
        )
        # A sum of per-element hashes: integer addition is exact in any order, so the
        # value does not depend on how the arrays are sharded over devices or hosts.
        total = total + jnp.sum(_mix(words ^ _mix(position)), dtype=jnp.uint32)
    return total


def checksum(state: PyTree) -> int:
    """A 32-bit hash of every bit of `state` (position-dependent, layout-independent)."""
    return int(_checksum(state))


@jax.jit
def _all_finite(state: PyTree) -> jax.Array:
    floats = [x for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in floats] or [jnp.bool_(True)]))


def _check_fingerprint(saved: dict[str, Any] | None, config, step: int, directory: str) -> None:
    if saved is None:
        return  # a checkpoint written before fingerprints existed
    now = fingerprint(config)
    changed = [
        f"config.{k}: {saved.get(k, '(absent)')!r} -> {now.get(k, '(absent)')!r}"
        for k in sorted(set(saved) | set(now))
        if saved.get(k, "(absent)") != now.get(k, "(absent)")
    ]
    if changed:
        raise ConfigError(
            f"the checkpoint at step {step} in {directory} was written with a different config "
            f"({'; '.join(changed)}); resume with the same values, or use a new workdir "
            f"(only {', '.join(sorted(RESUMABLE_FIELDS))} may change on resume)."
        )


def _restore_step(mngr: ocp.CheckpointManager, step: int, state: PyTree, config):
    """(state, meta) of `step`, or raises ValueError/OSError saying what is wrong with it."""
    meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    _check_fingerprint(meta.get("fingerprint"), config, step, str(mngr.directory))
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )
    restored = mngr.restore(
        step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
    )["state"]
    if "checksum" in meta and checksum(restored) != meta["checksum"]:
        raise ValueError("its arrays do not match the checksum saved with them")
    if not bool(_all_finite(restored)):
        raise ValueError("it holds NaN or Inf")
    return restored, meta


def _set_aside(mngr: ocp.CheckpointManager, step: int) -> str:
    """Moves a damaged step out of the manager's view (kept for inspection)."""
    path = os.path.join(str(mngr.directory), str(step))
    aside = f"{path}.damaged"
    if jax.process_index() == 0 and os.path.exists(path):
        if os.path.exists(aside):
            aside = f"{aside}-{os.getpid()}"
        os.rename(path, aside)
    jax.experimental.multihost_utils.sync_global_devices(f"lpdec checkpoint {step} set aside")
    mngr.reload()
    return aside


def restore_latest(
    mngr: ocp.CheckpointManager, state: PyTree, config
) -> tuple[PyTree, dict[str, Any] | None]:
    """(state, meta) of the newest intact checkpoint, or (`state`, None) when there is none.

    `state` gives the shapes, dtypes and shardings to restore into; `config` is
    the new run's, checked against the checkpoint's fingerprint.

    Raises:
      ConfigError: the checkpoint was written with a different config.
      CheckpointError: there are checkpoints, but none is intact.
    """
    damaged = []
    for step in sorted(mngr.all_steps(), reverse=True):
        try:
            return _restore_step(mngr, step, state, config)
        except ConfigError:
            raise
        except Exception as error:  # noqa: BLE001 - orbax raises many types for unreadable files
            reason = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
            reason = f"{type(error).__name__}: {reason}" if reason else type(error).__name__
            aside = _set_aside(mngr, step)
            damaged.append(f"step {step} ({reason})")
            logging.warning(
                "checkpoint step %d is damaged (%s); moved to %s, trying the next older one",
                step,
                reason,
                aside,
            )
    if damaged:
        raise CheckpointError(
            f"no intact checkpoint in {mngr.directory}: {'; '.join(damaged)}; the damaged "
            "steps were moved aside (*.damaged); start a new run in a new workdir or remove them."
        )
    return state, None


def save(
    mngr: ocp.CheckpointManager,
    step: int,
    state: PyTree,
    meta: dict[str, Any],
    config,
) -> None:
    """Saves `state` and the JSON-able `meta` as checkpoint `step` (asynchronously).

    The meta also records the state's checksum and the config's fingerprint.
    """
    meta = dict(meta, checksum=checksum(state), fingerprint=fingerprint(config))
    mngr.save(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
    )


def export_params(workdir: str, params: PyTree, shards: lpdec.fsdp.ShardPlan | None = None) -> None:
    """Every node's parameters to `workdir/final_params.npz`, keyed by tree path.

    With `shards` (the machines' models split over their workers), one whole model
    per machine: each leaf [M, *shape]. Every process must call it (the arrays span
    all hosts); process 0 writes.
    """
    gathered = jax.experimental.multihost_utils.process_allgather(params, tiled=True)
    if shards is not None:
        gathered = shards.unshard(gathered)
    if jax.process_index() == 0:
        write_params(workdir, gathered)


def write_params(workdir: str, params: PyTree) -> None:
    """`params` (host arrays) to `workdir/final_params.npz`, keyed by tree path."""
    flat = {
        jax.tree_util.keystr(path): np.asarray(leaf)
        for path, leaf in jax.tree.leaves_with_path(params)
    }
    np.savez(os.path.join(workdir, "final_params.npz"), **flat)
