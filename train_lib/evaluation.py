"""What the loop logs about the models after each chunk, at the least communication.

Which model stands for "the node-averaged model":

- a mean of the gradients (the all-reduce, the compressed mean): every node's
  own model, which all hold with the same bits; nothing is sent.
- DiLoCo (without overlap) after an exchange: its anchor, the
  synchronised parameters in its state, which every node holds with the same
  bits, so it is evaluated where it is, with nothing crossing the link. (The
  nodes' parameters there equal the anchor to one float32 rounding.)
- otherwise, the nodes' mean, computed ONCE per log interval and shared by
  every metric that needs it (the evaluation and the consensus distance). On
  a layout of machines the link carries the models once: with the machines'
  models split over their workers (`lpdec.fsdp`) each worker averages its
  blocks over the machines, and with whole models per worker
  `lpdec.metrics.hierarchical_average` sums inside each machine first. (A
  layout without machines still gathers every node's model on every device.)

Every evaluated sum is kept per node and added on the host in node order in
float64, so the logged values do not depend on which collective carried them.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

import lpdec
from train_lib import metrics as metrics_lib
from train_lib import setup as setup_lib

PyTree = Any


def diloco_anchor(opt_state: PyTree) -> PyTree | None:
    """The anchor of the DiLoCo state inside `opt_state`, or None if there is none."""
    found = [
        s
        for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, lpdec.DiLoCoState))
        if isinstance(s, lpdec.DiLoCoState)
    ]
    return found[0].anchor if len(found) == 1 else None


class Evaluator:
    """Places the test data once; `evaluate(params, opt_state, model_state)` -> metrics.

    Args:
      exp: the experiment.
      programs: `steps.make_programs`'s jitted functions.
      anchor: evaluate DiLoCo's anchor as the averaged model after the steps that end
        an exchange round (see the module docstring).
      identical: every node holds the same bits (a mean of the gradients): each
        node's model is the averaged model, evaluated where it is.
    """

    def __init__(
        self, exp: setup_lib.Experiment, programs: dict, *, anchor: bool, identical: bool = False
    ):
        layout, dataset, n = exp.layout, exp.dataset, exp.layout.num_nodes
        self.layout, self.programs = layout, programs
        self.anchor, self.identical = anchor, identical
        self.exchange_every = exp.exchange_every
        self.next_token = dataset.task == "next_token"
        self.sharded = exp.shard_plan is not None
        # Predictions per example: one label, or the T next tokens of a window.
        targets = dataset.x_test.shape[1] - 1 if self.next_token else 1
        # The averaged model sees a 1/n share of the test set on every node.
        per_node = len(dataset.x_test) // n
        self.shard_x, self.shard_y = (
            layout.put(a[: per_node * n].reshape((n, per_node) + a.shape[1:]))
            for a in (dataset.x_test, dataset.y_test)
        )
        self.avg_count = per_node * n * targets
        # Each node's own model: the first eval_local_examples test examples; sharded,
        # a machine's workers evaluate its model on 1/k of them each.
        count = min(exp.loop.eval_local_examples, len(dataset.x_test))
        if self.sharded:
            workers = exp.shard_plan.workers
            per = count // workers
            count = per * workers

            def spread(a):
                # Device m * k + w evaluates slice w of the examples, on every machine m.
                slices = np.stack([a[w * per : (w + 1) * per] for w in range(workers)])
                return layout.put(np.concatenate([slices] * layout.machines))

            self.local_x, self.local_y = spread(dataset.x_test), spread(dataset.y_test)
            self.local_total = layout.machines * count * targets
        else:
            self.local_x = layout.put(dataset.x_test[:count], per_node=False)
            self.local_y = layout.put(dataset.y_test[:count], per_node=False)
            self.local_total = n * count * targets
        self.local_count = count

    def evaluate(
        self, params: PyTree, opt_state: PyTree, model_state: PyTree, step: int
    ) -> dict[str, float]:
        """The evaluation metrics and the consensus distance of the models after `step`."""
        programs = self.programs
        if self.identical:
            reference, reference_state, per_node = params, model_state, True
        elif self.anchor and step % self.exchange_every == 0:
            reference, reference_state = diloco_anchor(opt_state), model_state
            per_node = True
        else:
            reference = programs["average"](params)
            reference_state = programs["average"](model_state)
            per_node = programs["average_per_node"]
        evaluate = programs["node_eval"] if per_node else programs["shared_eval"]
        avg = evaluate(reference, reference_state, self.shard_x, self.shard_y)
        distance = programs["node_distance" if per_node else "shared_distance"](params, reference)
        out = metrics_lib.evaluation(
            metrics_lib.to_host(avg), self.avg_count, "avg_model", self.next_token
        )
        # With no examples for them (config.eval_local_examples = 0, or fewer than a
        # sharded machine's workers) the nodes' own models go unevaluated and their
        # metrics are left out, rather than logged as NaN.
        if self.local_count:
            local = programs["local_eval"](params, model_state, self.local_x, self.local_y)
            out |= metrics_lib.evaluation(
                metrics_lib.to_host(local), self.local_total, "local_mean", self.next_token
            )
        # (1/models) sum_i ||x_i - x_bar||^2: one model per node, or per machine when sharded.
        models = self.layout.machines if self.sharded else self.layout.num_nodes
        distances = np.asarray(metrics_lib.to_host(distance), np.float64)
        out["consensus_distance"] = float(np.sum(distances) / models)
        return out
