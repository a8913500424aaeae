"""An elastic machine's DiLoCo arithmetic: the synchronous run's own pieces, on host trees.

The synchronous DiLoCo (`lpdec.diloco`, built by `train_lib.registry`) ends each
round with an optax chain: the exchange's mean (`lpdec.local_mean`, or
`lpdec.compressed_mean` with its compressor and error feedback) and the outer
optimizer (`train_lib.optimizers.outer`: Nesterov, its momentum warmed up over
`outer_warmup_rounds`). An elastic machine cannot run the mean as a collective
(its round's members are whoever the service hears), so the round is cut where
the wire is:

- `encode`: this machine's pseudo-gradient, flattened as `compressed_mean`
  flattens an update, encoded with the compressor's own `encode` /
  `encode_feedback` (error feedback, `error_decay`) under the key
  `compressed_mean` gives the machine's slot at this exchange
  (`one_round_key`): the payload the one-round exchange (``mean_rounds=1``)
  would send for it. "mean" sends the float32 vector.
- `decode`: a member's payload back to float32, with the sender's key, and
  whether it is finite (`Compressor.is_finite`), as `compressed_mean` decodes.
- the mean of the decoded contributions: the elastic weighting
  (`lpdec.elastic.slot_mean` / `step_weighted_mean`, in the decision's order;
  with every machine and equal steps, the plain sum in machine order over the
  count, the synchronous exchange's arithmetic).
- `apply`: the outer optimizer's optax `update` on that mean and the anchor
  plus its update in float32, as `lpdec.diloco`'s exchange branch does.

The synchronous warm-up (`sync_steps`) is the same exchange with a plain outer
step of 1 (`optimizers.PLAIN_STEP`), state of its own, as `registry.make_chain`
builds it: rounds of one local step before the rounds of H.

Each piece is compiled once (`jax.jit`); the state (outer optimizer, warm-up,
residual, the exchange counts that key the encoding) is a pytree that a joining
machine receives with the anchor.
"""

from __future__ import annotations

import types
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from lpdec.algorithms.compressed_mean import one_round_key
from train_lib import optimizers

PyTree = Any


class OuterStep:
    """The exchange's codec and the outer optimizer of one elastic machine.

    Args:
      config: the run's config (its exchange and outer fields; `registry.EXCHANGES`).
      anchor: the model (host float32 tree): the structure of every pseudo-gradient.
      compressor: the run's compressor (used with exchange="compressed_mean").
    """

    def __init__(self, config: ml_collections.ConfigDict, anchor: PyTree, compressor):
        self.compressed = config.exchange == "compressed_mean"
        self.feedback = self.compressed and bool(config.error_feedback)
        self.decay = float(config.error_decay)
        self.compressor = compressor
        # compressed_mean's shared key (its state's `key`, from its `seed`).
        self.key = jax.random.key_data(jax.random.key(int(config.seed)))
        self.leaves, self.treedef = jax.tree.flatten(anchor)
        self.sizes = [int(np.size(x)) for x in self.leaves]
        self.size = sum(self.sizes)
        self.outer = optimizers.outer(config)
        plain = types.SimpleNamespace(**optimizers.PLAIN_STEP)
        self.plain = optimizers.outer(plain)
        vector = jax.ShapeDtypeStruct((self.size,), jnp.float32)
        self._encode = jax.jit(self._encode_fn)
        self._decode = jax.jit(self._decode_fn)
        self._apply = jax.jit(self._apply_fn, static_argnums=0)
        self.payload_like = (
            jax.eval_shape(lambda v: compressor.encode(v, self.key), vector)
            if self.compressed
            else vector
        )

    # -- state -------------------------------------------------------------------

    def init(self, anchor: PyTree) -> dict:
        """The state at round 0: the outer optimizer's and the warm-up's, the residual,
        and the exchanges each has made (they key the encoding, as the counts of the
        synchronous run's two `compressed_mean` states do)."""
        host = lambda tree: jax.tree.map(np.asarray, tree)  # noqa: E731
        return {
            "outer": host(self.outer.init(anchor)),
            "sync": host(self.plain.init(anchor)),
            "residual": {
                "outer": np.zeros(self.size, np.float32),
                "sync": np.zeros(self.size, np.float32),
            },
            "count": {"outer": np.int64(0), "sync": np.int64(0)},
        }

    # -- flat vectors --------------------------------------------------------------

    def flatten(self, tree: PyTree) -> np.ndarray:
        """The tree's leaves as one float32 vector (`compressed_mean`'s order)."""
        leaves = jax.tree.leaves(tree)
        return np.concatenate([np.ravel(np.asarray(x, np.float32)) for x in leaves])

    def unflatten(self, flat: np.ndarray) -> PyTree:
        out, at = [], 0
        for x, n in zip(self.leaves, self.sizes, strict=True):
            out.append(np.asarray(flat[at : at + n]).reshape(np.shape(x)))
            at += n
        return jax.tree.unflatten(self.treedef, out)

    # -- the exchange's codec --------------------------------------------------------

    def _encode_fn(self, vector, residual, count, sender):
        if not self.compressed:
            return vector, residual
        key = one_round_key(self.key, count, sender)
        if not self.feedback:
            return self.compressor.encode(vector, key), residual
        payload, error = self.compressor.encode_feedback(vector, residual, key, self.decay)
        # v = update + decay * residual non-finite: the residual stays (compressed_mean).
        return payload, jnp.where(jnp.all(jnp.isfinite(error)), error, residual)

    def encode(self, delta: PyTree, state: dict, phase: str, sender: int) -> tuple[Any, np.ndarray]:
        """(payload, the residual it leaves) of this machine's pseudo-gradient `delta`
        in `phase` ("outer", or "sync" in the warm-up)."""
        vector = self.flatten(delta)
        if not np.isfinite(vector).all():
            vector = np.full_like(vector, np.nan)  # as compressed_mean marks it
        payload, residual = self._encode(
            vector, state["residual"][phase], np.int32(state["count"][phase]), np.int32(sender)
        )
        return jax.tree.map(np.asarray, payload), np.asarray(residual)

    def _decode_fn(self, payload, count, sender):
        if not self.compressed:
            return payload, jnp.all(jnp.isfinite(payload))
        key = one_round_key(self.key, count, sender)
        decoded = self.compressor.decode(payload, key=key).astype(jnp.float32)
        return decoded, self.compressor.is_finite(payload)

    def decode(self, payload: Any, state: dict, phase: str, sender: int) -> np.ndarray | None:
        """Member `sender`'s payload as a float32 vector, or None if it is not finite."""
        decoded, ok = self._decode(payload, np.int32(state["count"][phase]), np.int32(sender))
        decoded = np.asarray(decoded)
        return decoded if bool(ok) and np.isfinite(decoded).all() else None

    # -- the outer step ---------------------------------------------------------------

    def _apply_fn(self, phase, mean, opt_state, anchor):
        tx = self.outer if phase == "outer" else self.plain
        updates, opt_state = tx.update(mean, opt_state, anchor)
        updates = jax.tree.map(lambda u: jnp.asarray(u, jnp.float32), updates)
        return jax.tree.map(jnp.add, anchor, updates), opt_state

    def apply(self, anchor: PyTree, state: dict, phase: str, mean: np.ndarray | None) -> PyTree:
        """The anchor after this round's outer step on `mean` (a flat vector; None: no
        contribution, a zero pseudo-gradient); advances `state` (counts, optimizer)."""
        mean_tree = self.unflatten(mean if mean is not None else np.zeros(self.size, np.float32))
        anchor, opt_state = self._apply(phase, mean_tree, state[phase], anchor)
        state[phase] = jax.tree.map(np.asarray, opt_state)
        state["count"][phase] = np.int64(state["count"][phase] + 1)
        return jax.tree.map(np.asarray, anchor)


def describe(config: ml_collections.ConfigDict) -> str:
    """One line naming the exchange and outer step an elastic machine runs (its log)."""
    exchange = "float32 mean"
    if config.exchange == "compressed_mean":
        exchange = f"{config.compressor} compressed mean" + (
            f" with error feedback (decay {config.error_decay:g})" if config.error_feedback else ""
        )
    warm = f", momentum warm-up over {config.outer_warmup_rounds} rounds"
    return (
        f"{exchange}, outer Nesterov {config.outer_lr:g} / {config.outer_momentum:g}"
        + (warm if config.outer_warmup_rounds else "")
        + (f", {config.sync_steps} synchronous steps first" if config.sync_steps else "")
    )
