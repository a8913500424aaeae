"""train.py with config.shard_model: each machine's model split over its workers (lpdec.fsdp).

The reference is the replicated hierarchical run of the same config: every worker
holds its machine's whole model, the workers average their gradients, the algorithm
runs between the machines. With the identity compressor both compute the same
thing in other shapes, so they agree to float32 rounding. Both runs are
test_train.hierarchical_run's, shared with the other tests that compare against them.
"""

import json
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from test_train import _two_processes  # noqa: E402
from test_train import final_params  # noqa: E402
from test_train import hierarchical_config  # noqa: E402
from test_train import hierarchical_flags  # noqa: E402
from test_train import hierarchical_run  # noqa: E402

import lpdec  # noqa: E402
import train_lib  # noqa: E402
from train_lib import ConfigError  # noqa: E402

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")

# The algorithms between the machines (test_train.HIERARCHICAL: 2 machines of 4 workers,
# fp32, the identity compressor, 20 steps).
ALGORITHMS = {
    "allreduce": dict(algorithm="allreduce"),
    "choco": dict(algorithm="choco"),
    "compressed_mean": dict(algorithm="compressed_mean"),
    "diloco": dict(algorithm="diloco", local_steps=5, exchange="compressed_mean"),
}


def test_diloco_on_one_machine_with_h1_and_a_plain_outer_step_is_the_all_reduce(shared_run):
    """DiLoCo's sanity check (issue 41): one machine of all 8 workers (config.machines=1),
    H=1, the exact mean and outer SGD 1 without momentum take the all-reduce's steps: the
    inner optimizer sees the 8 workers' mean gradient, and the outer step lands on its
    result. The reference is the all-reduce over 2 machines of 4 (the same mean)."""
    ar_dir, ar = hierarchical_run(shared_run, **ALGORITHMS["allreduce"])
    plain = dict(local_steps=1, exchange="mean", outer_lr=1.0, outer_momentum=0.0)
    dl_dir, dl = hierarchical_run(shared_run, algorithm="diloco", machines=1, **plain)
    reference, diloco = final_params(ar_dir), final_params(dl_dir)
    for name, whole in reference.items():
        np.testing.assert_allclose(diloco[name], whole, rtol=0, atol=1e-5, err_msg=name)
    assert dl["final"]["train_loss"] == pytest.approx(ar["final"]["train_loss"], abs=1e-5)


def test_a_run_that_is_all_synchronous_warm_up_is_diloco_at_h1_with_a_plain_step(shared_run):
    """config.sync_steps (post-local SGD's warm-up): its steps end on the exchanged mean
    with a plain step of 1 whatever the outer setting, and the rounds wait for its end.
    A run of 20 steps that is all warm-up (H=5, outer Nesterov 0.7 / 0.9 never used) is
    DiLoCo with H=1 and outer SGD 1 step for step."""
    plain = dict(local_steps=1, exchange="mean", outer_lr=1.0, outer_momentum=0.0)
    ref_dir, ref = hierarchical_run(shared_run, algorithm="diloco", **plain)
    warm = dict(local_steps=5, exchange="mean", outer_lr=0.7, outer_momentum=0.9)
    sync_dir, sync = hierarchical_run(shared_run, algorithm="diloco", sync_steps=20, **warm)
    reference, warmed = final_params(ref_dir), final_params(sync_dir)
    for name, whole in reference.items():
        np.testing.assert_allclose(warmed[name], whole, rtol=0, atol=1e-6, err_msg=name)
    assert sync["final"]["train_loss"] == pytest.approx(ref["final"]["train_loss"], abs=1e-6)


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_a_sharded_run_lands_where_the_replicated_run_lands(shared_run, algorithm):
    rep_dir, rep = hierarchical_run(shared_run, **ALGORITHMS[algorithm])
    fsdp_dir, fsdp = hierarchical_run(shared_run, shard_model=True, **ALGORITHMS[algorithm])
    replicated, sharded = final_params(rep_dir), final_params(fsdp_dir)
    for name, whole in replicated.items():
        # Replicated: one row per worker, the 4 workers of a machine equal; sharded: one
        # row per machine.
        assert sharded[name].shape == (2,) + whole.shape[1:], name
        # float32 rounding: the reduce-scatter and the mean sum in other orders, and
        # DiLoCo's outer momentum carries the difference along (jax 0.12: 7e-6 after 40
        # steps of the 32-wide MLP; jax 0.10: 1.2e-7 after test_train.HIERARCHICAL's 20
        # steps of the default MLP, where a gradient 1% off misses by 1.1e-4).
        np.testing.assert_allclose(sharded[name], whole[[0, 4]], rtol=0, atol=3e-5, err_msg=name)
    for metric in ("train_loss", "test_accuracy_avg_model"):
        assert fsdp["final"][metric] == pytest.approx(rep["final"][metric], abs=1e-5), metric


def test_a_machine_sends_one_compressed_model_per_exchange(shared_run):
    """DiLoCo with a 4-bit compressed mean every 5 steps, 2 machines: each worker runs the
    two compressed rounds over the machines on its blocks alone (one vector of s
    elements, cut into 2 halves), so the program's all-to-all and all-gather over the
    machines axis carry 2 + 1 rows of a half's 4-bit payload per worker (the audit counts
    the all-to-all's row to itself, which stays on the device). Across the link a
    machine sends 4 workers x 2 rows: one 4-bit payload of its whole model, not 4; the
    meter's link bytes say so."""
    overrides = dict(
        ALGORITHMS["diloco"],
        compressor="minmax",
        bits=4,
        error_feedback=True,
        model_kwargs={"hidden_sizes": (256,)},
    )
    _, summary = hierarchical_run(shared_run, shard_model=True, **overrides)
    plan = train_lib.build(hierarchical_config(shard_model=True, **overrides)).shard_plan
    is_shape = lambda x: isinstance(x, tuple)  # noqa: E731
    size = lambda shapes: sum(int(np.prod(s)) for s in jax.tree.leaves(shapes, is_leaf=is_shape))  # noqa: E731
    s, parameters = size(plan.block_shapes), size(plan.shapes)
    assert 4 * s == parameters
    row = lpdec.minmax(bits=4).wire_bytes(-(-s // 2))
    per_exchange = summary["wire_bytes_by_axis"]["machines"] * 5
    assert per_exchange == pytest.approx(3 * row), (per_exchange, row)
    crossing = 4 * 2 * row
    assert crossing <= 1.02 * lpdec.minmax(bits=4).wire_bytes(parameters), crossing
    # The meter's link bytes count those 2 rows a worker (lpdec.wire.LINK_SHARE).
    assert summary["link_bytes_by_axis"]["machines"] * 5 == pytest.approx(2 * row)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(hierarchical=False, machines=0), "needs machines"),
        (dict(num_nodes=4), "one worker on every device"),
        (dict(model_kwargs={"hidden_sizes": (30,), "groups": 2}), r"has shape \(30,\)"),
    ],
)
def test_bad_sharding_requests_fail_in_one_line_before_training(tmp_path, overrides, message):
    config = hierarchical_config(shard_model=True, **overrides)
    with pytest.raises(ConfigError, match=message) as info:
        train_lib.train_and_evaluate(config, str(tmp_path))
    assert "\n" not in str(info.value)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_two_processes_of_four_workers_match_two_simulated_machines(tmp_path, shared_run):
    """Sharded DiLoCo across 2 real processes (each a machine of 4 CPU devices) lands
    where the one-process simulation of 2 machines lands (gloo sums the in-machine
    reduce-scatter in another order: float32 rounding), and each process's devices hold
    a quarter of what a device of the replicated run holds (both one-process runs are
    test_a_sharded_run_lands_where_the_replicated_run_lands[diloco]'s)."""
    overrides = dict(ALGORITHMS["diloco"], shard_model=True)
    single, _ = hierarchical_run(shared_run, **overrides)
    _, replicated = hierarchical_run(shared_run, **ALGORITHMS["diloco"])
    _two_processes(tmp_path / "multi", hierarchical_flags(**overrides))
    summary = json.loads((tmp_path / "multi" / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["devices"] == 8
    # Read from the arrays' shards on process 0's devices: parameters, Nesterov momentum,
    # DiLoCo's anchor and outer momentum, 4 whole models on a device of the replicated run.
    model_bytes = 4 * sum(x[0].size for x in jax.tree.leaves(final_params(single)))
    assert replicated["state_bytes_per_device"] >= 4 * model_bytes
    assert summary["state_bytes_per_device"] <= 1.1 * replicated["state_bytes_per_device"] / 4
    a, b = final_params(single), final_params(tmp_path / "multi")
    for name in a:
        assert a[name].shape[0] == 2, name  # one whole model per machine
        np.testing.assert_allclose(b[name], a[name], rtol=0, atol=2e-6, err_msg=name)
