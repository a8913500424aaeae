"""Checkpoints of a run in `workdir/checkpoints`, through orbax's `CheckpointManager`.

A checkpoint holds the train state `{"params", "opt_state", "model_state"}`
(every node's; the optimizer state with the algorithms' replicas, error
buffers, push-sum weights and keys) and a JSON `meta` `{"step", "batcher"}`
(the data position), which is all a restarted run needs to end bit-identical
to an uninterrupted one. `export_params` writes the final parameters as a
plain `.npz` for other tools.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.experimental.multihost_utils
import numpy as np
import orbax.checkpoint as ocp

PyTree = Any


def manager(workdir: str) -> ocp.CheckpointManager:
    """The run's manager; it keeps the last two checkpoints."""
    return ocp.CheckpointManager(
        os.path.join(workdir, "checkpoints"),
        options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True),
    )


def restore_latest(
    mngr: ocp.CheckpointManager, state: PyTree
) -> tuple[PyTree, dict[str, Any] | None]:
    """(state, meta) of the latest checkpoint, or (`state`, None) when there is none.

    `state` gives the shapes, dtypes and shardings to restore into.
    """
    step = mngr.latest_step()
    if step is None:
        return state, None
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )
    restored = mngr.restore(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
        ),
    )
    return restored["state"], restored["meta"]


def save(mngr: ocp.CheckpointManager, step: int, state: PyTree, meta: dict[str, Any]) -> None:
    """Saves `state` and the JSON-able `meta` as checkpoint `step` (asynchronously)."""
    mngr.save(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
    )


def export_params(workdir: str, params: PyTree) -> None:
    """Every node's parameters to `workdir/final_params.npz`, keyed by tree path.

    Every process must call it (the arrays span all hosts); process 0 writes.
    """
    gathered = jax.experimental.multihost_utils.process_allgather(params, tiled=True)
    if jax.process_index() == 0:
        flat = {
            jax.tree_util.keystr(path): np.asarray(leaf)
            for path, leaf in jax.tree.leaves_with_path(gathered)
        }
        np.savez(os.path.join(workdir, "final_params.npz"), **flat)
