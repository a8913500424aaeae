"""A run's metrics: read from the devices, written by process 0.

`MetricWriter` writes one row every `log_every` steps to stderr (absl
logging), `workdir/metrics.csv` (columns `METRIC_FIELDS`) and TensorBoard
event files in `workdir/tensorboard`, and moves a tqdm progress bar on a
terminal; `write_summary` writes `workdir/summary.json` at the end.
"""

from __future__ import annotations

import csv
import json
import math
import os
import sys
from typing import Any

import jax
import jax.experimental.multihost_utils
import numpy as np
import tqdm
from absl import logging

import lpdec

METRIC_FIELDS = (
    "step",
    "epoch",
    "train_loss",
    "train_accuracy",
    "test_accuracy_avg_model",
    "test_accuracy_local_mean",
    "consensus_distance",
    "wire_bytes_per_step",
    "step_time_s",
    "eval_time_s",
    "wall_time_s",
    "learning_rate",
    "nonfinite_updates",
    "nonfinite_received",
    "theta_warnings",
    "loss_jump",
    "test_loss_avg_model",
    "test_loss_local_mean",
)

#: A language model's columns (`next_token`): validation loss in nats and bits per
#: byte and next-byte accuracy of the node-averaged model and of each node's own
#: (averaged over the nodes), and tokens trained per second per machine.
LM_METRIC_FIELDS = (
    "step",
    "epoch",
    "train_loss",
    "train_accuracy",
    "val_loss_avg_model",
    "val_bits_per_byte_avg_model",
    "val_accuracy_avg_model",
    "val_loss_local_mean",
    "val_bits_per_byte_local_mean",
    "val_accuracy_local_mean",
    *METRIC_FIELDS[6:11],
    "tokens_per_s_per_machine",
    *METRIC_FIELDS[11:16],
)


def to_host(tree):
    """Per-node global arrays -> numpy on every process (they span all hosts' devices)."""
    if jax.process_count() > 1:
        tree = jax.experimental.multihost_utils.process_allgather(tree, tiled=True)
    return jax.tree.map(np.asarray, tree)


def evaluation(sums, count: int, model: str, next_token: bool) -> dict[str, float]:
    """The evaluation metrics of `model` ("avg_model", "local_mean") from per-node sums.

    Args:
      sums: (summed losses, correct predictions), each one value per node.
      count: the predictions summed over all nodes (examples, or tokens).
      model: the metrics' suffix.
      next_token: a language model: validation loss in nats and in bits per byte
        (one token is one byte), and next-byte accuracy; else test accuracy and
        test loss (mean cross-entropy in nats).
    """
    losses, correct = (np.asarray(x, np.float64) for x in sums)
    loss = float(losses.sum() / count)
    if not next_token:
        return {f"test_accuracy_{model}": float(correct.sum() / count), f"test_loss_{model}": loss}
    return {
        f"val_loss_{model}": loss,
        f"val_bits_per_byte_{model}": loss / math.log(2),
        f"val_accuracy_{model}": float(correct.sum() / count),
    }


def health_counts(opt_state) -> tuple[int, int, int]:
    """Every node's `lpdec.Health` counters summed over the optimizer state: non-finite
    updates, non-finite received payloads, Moniqua's θ warnings."""
    is_health = lambda x: isinstance(x, lpdec.Health)  # noqa: E731
    found = to_host([h for h in jax.tree.leaves(opt_state, is_leaf=is_health) if is_health(h)])
    if not found:
        return 0, 0, 0
    return tuple(int(sum(np.sum(x) for x in field)) for field in zip(*found, strict=True))


def wire_bytes(compiled, meter: lpdec.wire.TrafficMeter, per_device: int) -> tuple[float, str]:
    """(bytes one node sends per step, where the count comes from).

    Read from the compiled program when every node has its own device and every
    collective runs on every step; otherwise the trace-time `meter` counts them
    (the two agree where both apply: tests/test_algorithms.py,
    tests/test_wire_counts.py). Where nodes share devices the HLO shows none (or
    inflated) collectives. A collective that runs on only some steps (DiLoCo's
    exchange, once per local_steps steps; a round of a time-varying
    topology) sits whole in a branch of a conditional, beside the ones every step
    runs (the gradient's mean inside a machine, FSDP's gathers), so no one divisor
    of the HLO's total is right: the meter weighs each collective by its share of
    the steps. Sums through `lpdec.host_sum` leave the HLO as callbacks, not
    collectives: with one installed the meter counts.
    """
    if per_device == 1 and not meter.occasional and lpdec.host_sum.installed() is None:
        traffic = lpdec.metrics.collective_traffic(compiled.as_text()).total_bytes
        return traffic, "compiled HLO"
    return meter.bytes, "trace-time meter"


class MetricWriter:
    """stderr (absl logging) + metrics.csv + TensorBoard + a progress bar, from process 0 only.

    A resumed run (`resume_step` > 0) keeps the CSV rows up to `resume_step`
    and drops later ones, which the restored run writes again.
    """

    def __init__(
        self,
        workdir: str,
        resume_step: int,
        total_steps: int,
        fields: tuple[str, ...] = METRIC_FIELDS,
    ):
        self.enabled = jax.process_index() == 0
        self.fields = fields
        self.path = os.path.join(workdir, "metrics.csv")
        self.tensorboard = None
        # disable=None: no bar when stderr is not a terminal.
        self.bar = tqdm.tqdm(
            total=total_steps,
            initial=resume_step,
            unit="step",
            disable=None if self.enabled else True,
        )
        if not self.enabled:
            return
        rows = []
        if resume_step and os.path.exists(self.path):
            with open(self.path) as f:
                rows = [r for r in csv.DictReader(f) if int(r["step"]) <= resume_step]
        with open(self.path, "w", newline="") as f:
            writer = csv.DictWriter(f, fields)
            writer.writeheader()
            writer.writerows(rows)
        try:
            from tensorboardX import SummaryWriter

            self.tensorboard = SummaryWriter(os.path.join(workdir, "tensorboard"))
        except ImportError:
            logging.warning("tensorboardX is not installed: no TensorBoard event files.")

    def write(self, metrics: dict[str, Any]) -> None:
        """One row of the writer's `fields`; a field `metrics` lacks (the nodes' own
        models' `*_local_mean` when `config.eval_local_examples` = 0) is an empty cell."""
        if not self.enabled:
            return
        step = metrics["step"]
        # The bar steps aside for the line (both go to stderr) and comes back under it.
        with tqdm.tqdm.external_write_mode(file=sys.stderr):
            logging.info(
                "step %d: %s",
                step,
                ", ".join(f"{k}={v:.4g}" for k, v in metrics.items() if k != "step"),
            )
        with open(self.path, "a", newline="") as f:
            csv.DictWriter(f, self.fields).writerow(metrics)
        if self.tensorboard is not None:
            for k, v in metrics.items():
                if k != "step":
                    self.tensorboard.add_scalar(k, v, step)
            self.tensorboard.flush()
        self.bar.update(step - self.bar.n)

    def close(self) -> None:
        self.bar.close()
        if self.tensorboard is not None:
            self.tensorboard.close()


def device_bytes(tree) -> int:
    """The most bytes of `tree` that one of this process's devices holds (its arrays'
    addressable shards): what a device keeps of parameters and state between steps."""
    held: dict[Any, int] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in getattr(leaf, "addressable_shards", ()):
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return max(held.values(), default=0)


def write_summary(workdir: str, summary: dict[str, Any]) -> None:
    """`summary` to `workdir/summary.json` (process 0)."""
    if jax.process_index() == 0:
        with open(os.path.join(workdir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2, default=str)


class DivergenceMonitor:
    """Says when a run has diverged, from the mean train loss of each log interval.

    An interval is bad when its loss is NaN/Inf or above `factor` times
    `reference`: train.py passes ln(num_classes), the cross-entropy of a uniform
    guess (an absolute yardstick: a run can already have diverged in its first
    interval); None takes the first finite interval's loss. Mid-run, `patience`
    bad intervals in a row end the run; a good one resets the count, so one bad
    interval (a NaN gradient that lpdec's guards drop) does not. The run's last
    interval has no later one to recover in: a run that ends on a bad interval has
    diverged, however short its streak. `factor=0` never stops a run.

    The streak is part of a checkpoint (`state`, `restore`), so a resumed run
    reaches the verdict an uninterrupted one would.
    """

    def __init__(self, factor: float, patience: int, reference: float | None = None):
        self.factor, self.patience = factor, patience
        self.reference, self.bad = reference, 0

    def update(self, step: int, loss: float, *, last: bool = False) -> str | None:
        """Records the interval ending at `step` (`last`: the run's final one); returns
        why the run has diverged, or None."""
        if not self.factor:
            return None
        finite = bool(np.isfinite(loss))
        if self.reference is None and finite:
            self.reference = loss
        exploding = finite and self.reference is not None and loss > self.factor * self.reference
        self.bad = self.bad + 1 if (not finite or exploding) else 0
        if not self.bad or (self.bad < self.patience and not last):
            return None
        what = "not finite" if not finite else f"above {self.factor:g} x {self.reference:.4g}"
        if self.bad < self.patience:
            return (
                f"diverged: train_loss {loss:.4g} at step {step} ({what}) when the run ended, "
                f"bad for its last {self.bad} log interval(s) (config.divergence_factor; "
                "config.divergence_patience only spares a run that goes on)"
            )
        return (
            f"diverged: train_loss {loss:.4g} at step {step} ({what}) for {self.bad} log "
            "intervals in a row (config.divergence_factor, config.divergence_patience)"
        )

    def state(self) -> dict[str, Any]:
        """The bad intervals in a row so far, for a checkpoint's JSON meta."""
        return {"bad": self.bad}

    def restore(self, state: dict[str, Any]) -> None:
        """The streak `state` saved (a checkpoint written before it was saved: none)."""
        self.bad = int(state.get("bad", 0))


#: A log interval's mean train loss has jumped when it is above LOSS_JUMP_RATIO times
#: the run's lowest so far AND more than LOSS_JUMP_MARGIN times a uniform guess's loss
#: above it. The margin keeps a small loss's noise quiet (0.003 -> 0.01 is no jump):
#: giving back a quarter of the way from a perfect model to a uniform guess is a
#: collapse, and an interval's mean over log_every x nodes x batch examples is far
#: steadier than that. The ratio keeps a high loss's wobbles quiet (early training, a
#: hard task). Together they catch a fall back to a uniform guess from any minimum
#: below 2/3 of its loss, and EXPERIMENTS.md's torus runs (0.003 -> 0.9 with 10
#: classes: 0.9 > 1.5 x 0.003 and 0.9 - 0.003 > 0.25 x ln 10 = 0.58).
LOSS_JUMP_RATIO = 1.5
LOSS_JUMP_MARGIN = 0.25


class LossJumpMonitor:
    """Warns when the train loss jumps far above its running minimum and stays finite.

    Such a collapse (a model that had learned and lost it) is no divergence:
    the run goes on (`DivergenceMonitor` stops runs). Each log interval's mean
    train loss is compared with the lowest before it (see `LOSS_JUMP_RATIO`);
    `jumping` says whether the last one jumped, and `warnings` holds one entry
    per episode of jumping intervals, made by its first: `{"step",
    "train_loss", "running_min", "running_min_step"}`. NaN/Inf intervals are
    the divergence check's: they neither jump nor lower the minimum.

    Args:
      reference: the loss of a uniform guess (train.py: ln(num_classes)), the
        yardstick of the margin.
    """

    def __init__(
        self, reference: float, ratio: float = LOSS_JUMP_RATIO, margin: float = LOSS_JUMP_MARGIN
    ):
        self.reference, self.ratio, self.margin = reference, ratio, margin
        self.running_min: float | None = None
        self.running_min_step: int | None = None
        self.jumping = False
        self.warnings: list[dict[str, Any]] = []

    def update(self, step: int, loss: float) -> str | None:
        """Records the interval ending at `step`; returns a warning line when a jump
        begins (the interval before did not jump), else None."""
        low, before = self.running_min, self.jumping
        finite = math.isfinite(loss)
        self.jumping = (
            finite
            and low is not None
            and loss > self.ratio * low
            and loss - low > self.margin * self.reference
        )
        if finite and (low is None or loss < low):
            self.running_min, self.running_min_step = loss, step
        if not self.jumping or before:
            return None
        self.warnings.append(
            {
                "step": step,
                "train_loss": loss,
                "running_min": low,
                "running_min_step": self.running_min_step,
            }
        )
        return (
            f"loss jump: train_loss {loss:.4g} at step {step}, up from its lowest "
            f"{low:.4g} (step {self.running_min_step}): above {self.ratio:g} x that and "
            f"more than {self.margin:g} x {self.reference:.4g} over it; the run goes on"
        )

    def state(self) -> dict[str, Any]:
        """Everything `update` has recorded, for a checkpoint's JSON meta."""
        return {
            "running_min": self.running_min,
            "running_min_step": self.running_min_step,
            "jumping": self.jumping,
            "warnings": self.warnings,
        }

    def restore(self, state: dict[str, Any]) -> None:
        """What `state` saved (a checkpoint written before it was saved: nothing)."""
        self.running_min = state.get("running_min")
        self.running_min_step = state.get("running_min_step")
        self.jumping = bool(state.get("jumping", False))
        self.warnings = [dict(w) for w in state.get("warnings", [])]
