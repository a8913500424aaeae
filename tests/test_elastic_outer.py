"""One DiLoCo (issue 49): an elastic machine's round is the synchronous run's pieces.

- its exchange's codec (`train_lib.elastic_outer.OuterStep.encode` / `decode`,
  then the elastic mean) gives the bits of `lpdec.compressed_mean`'s one-round
  exchange run as a collective over the same machines: the mean and every
  machine's error-feedback residual, exchange after exchange;
- its outer step is DiLoCo's optax outer optimizer, held against the paper's
  Nesterov update with the momentum warm-up written out in float64;
- its config goes through `setup.check_values` (the one check): every refusal the
  synchronous run makes (tests/test_train.py's BAD_CONFIGS, and the values the
  issue found unchecked), the elastic machine makes, in the same line.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
import sys

import jax
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import lpdec  # noqa: E402
from configs import default  # noqa: E402
from configs import elastic_mlp  # noqa: E402
from lpdec import elastic  # noqa: E402
from train_lib import elastic as elastic_lib  # noqa: E402
from train_lib import setup  # noqa: E402
from train_lib.elastic_outer import OuterStep  # noqa: E402
from train_lib.errors import ConfigError  # noqa: E402


def _config(**fields):
    config = default.get_config()
    config.algorithm, config.exchange = "diloco", "compressed_mean"
    config.compressor, config.bits, config.mean_rounds = "minmax", 4, 1
    config.error_feedback, config.seed = True, 7
    config.outer_lr, config.outer_momentum = 0.7, 0.9
    config.update(fields)
    return config


def _tree(rng, scale=1.0):
    return {
        "b": (scale * rng.normal(size=(7,))).astype(np.float32),
        "w": (scale * rng.normal(size=(40, 33))).astype(np.float32),
    }


@pytest.mark.parametrize(
    "rounding,decay,feedback",
    [("nearest", 1.0, True), ("stochastic", 0.9, True), ("stochastic", 1.0, False)],
)
def test_the_elastic_codec_is_compressed_means_one_round_exchange_bit_for_bit(
    rounding, decay, feedback
):
    """Two machines, three exchanges: the elastic machines' mean and residuals equal
    the synchronous `compressed_mean(rounds=1)` over a 2-node axis, bit for bit."""
    machines = 2
    compressor = lpdec.minmax(bits=4, rounding=rounding)
    config = _config(error_feedback=feedback, error_decay=decay)
    rng = np.random.default_rng(3)
    like = _tree(rng)
    sync = lpdec.compressed_mean(
        compressor, axis_name="m", seed=config.seed, error_feedback=feedback, rounds=1,
        error_decay=decay,
    )  # fmt: skip
    stacked = jax.tree.map(lambda x: np.stack([x] * machines), like)
    sync_state = jax.vmap(sync.init, axis_name="m")(stacked)
    sync_update = jax.jit(jax.vmap(lambda u, s: sync.update(u, s), axis_name="m"))
    outer = OuterStep(config, like, compressor)
    states = [outer.init(like) for _ in range(machines)]
    for _ in range(3):
        deltas = [_tree(rng, 0.1) for _ in range(machines)]
        want, sync_state = sync_update(jax.tree.map(lambda *x: np.stack(x), *deltas), sync_state)
        payloads = []
        for m in range(machines):
            payload, residual = outer.encode(deltas[m], states[m], "outer", m)
            states[m]["residual"]["outer"] = residual
            payloads.append(payload)
        for m in range(machines):
            decoded = [outer.decode(p, states[m], "outer", s) for s, p in enumerate(payloads)]
            mean = outer.unflatten(elastic.slot_mean(decoded, machines))
            for key in like:
                np.testing.assert_array_equal(mean[key], np.asarray(want[key][m]), err_msg=key)
            if feedback:
                np.testing.assert_array_equal(
                    states[m]["residual"]["outer"], np.asarray(sync_state.residual[m])
                )
        for state in states:  # what `OuterStep.apply` does after the mean
            state["count"]["outer"] += 1


def test_a_non_finite_contribution_decodes_as_none_and_keeps_the_residual():
    config = _config()
    like = _tree(np.random.default_rng(0))
    outer = OuterStep(config, like, lpdec.minmax(bits=4))
    state = outer.init(like)
    state["residual"]["outer"] = np.full(outer.size, 0.25, np.float32)
    bad = jax.tree.map(np.copy, like)
    bad["w"][3, 4] = np.nan
    payload, residual = outer.encode(bad, state, "outer", 0)
    assert outer.decode(payload, state, "outer", 0) is None
    np.testing.assert_array_equal(residual, state["residual"]["outer"])


def _nesterov_reference(anchor, deltas, lr, mu, warmup):
    """The outer Nesterov step with its momentum warmed up linearly over `warmup` rounds
    (DiLoCo's outer optimizer; optax.trace's form: m <- d + mu_t m, a <- a - lr (d + mu_t m)),
    in float64."""
    a = {k: v.astype(np.float64) for k, v in anchor.items()}
    m = {k: np.zeros_like(v) for k, v in a.items()}
    for t, d in enumerate(deltas):
        mu_t = mu * min(t, warmup) / warmup if warmup else mu
        for k in a:
            m[k] = d[k] + mu_t * m[k]
            a[k] = a[k] - lr * (d[k] + mu_t * m[k])
    return a


@pytest.mark.parametrize("warmup", [0, 3])
def test_the_outer_step_is_nesterov_with_the_momentum_warm_up(warmup):
    rng = np.random.default_rng(5)
    config = _config(exchange="mean", error_feedback=False, outer_warmup_rounds=warmup)
    anchor = _tree(rng)
    outer = OuterStep(config, anchor, lpdec.identity())
    state = outer.init(anchor)
    deltas = [_tree(rng, 0.1) for _ in range(6)]
    got = anchor
    for d in deltas:
        got = outer.apply(got, state, "outer", outer.flatten(d))
    want = _nesterov_reference(anchor, deltas, 0.7, 0.9, warmup)
    for key in anchor:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6)
    assert int(state["count"]["outer"]) == 6


def test_the_warm_up_rounds_take_a_plain_step_to_the_mean():
    """sync_steps: the warm-up's exchange moves the anchor by the mean (outer step 1,
    no momentum), whatever the outer optimizer; its state is its own."""
    rng = np.random.default_rng(6)
    config = _config(exchange="mean", error_feedback=False)
    anchor = _tree(rng)
    outer = OuterStep(config, anchor, lpdec.identity())
    state = outer.init(anchor)
    mean = _tree(rng, 0.1)
    got = outer.apply(anchor, state, "sync", outer.flatten(mean))
    for key in anchor:
        np.testing.assert_allclose(got[key], anchor[key] - mean[key], rtol=1e-6, atol=1e-7)
    assert int(state["count"]["sync"]) == 1 and int(state["count"]["outer"]) == 0


# -- the one check ----------------------------------------------------------------------


def _bad_configs():
    spec = importlib.util.spec_from_file_location("_train_tests", ROOT / "tests" / "test_train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.BAD_CONFIGS


# What the issue found an elastic machine did not refuse (it trained, or crashed).
UNCHECKED_BEFORE = [
    ({"local_steps": 0}, r"config.local_steps=0 must be an integer >= 1"),
    ({"outer_momentum": 1.5}, r"config.outer_momentum=1.5 must be in \[0, 1\)"),
    ({"mean_rounds": 3}, r"config.mean_rounds=3 must be 2"),
    ({"outer_lr": -1.0}, r"config.outer_lr=-1.0 must be > 0"),
    ({"error_decay": 1.5}, r"config.error_decay=1.5 must be in \(0, 1\]"),
]
# Refusals of how a synchronous run's nodes fit its devices: an elastic machine is a
# process of its own and fits one machine's workers instead (tested below).
LAYOUT = ("not a multiple of 8", "does not divide the 8", "workers on each machine's 4",
          "in one process needs config.machines", "machines=-1",
          "sums over processes of one device")  # fmt: skip


@pytest.mark.parametrize("overrides,message", _bad_configs() + UNCHECKED_BEFORE)
def test_every_refusal_of_the_synchronous_run_is_the_elastic_machines_too(overrides, message):
    config = elastic_mlp.get_config()
    config.num_nodes = 8 if "num_nodes" not in overrides else config.num_nodes
    config.update({k: v for k, v in overrides.items() if k != "num_nodes"})
    if "num_nodes" in overrides:
        config.num_nodes = overrides["num_nodes"]
    options = elastic_lib.ElasticOptions(
        service="127.0.0.1:1", machine=0, machines=4 if config.num_nodes % 4 == 0 else 2,
        token=b"t",
    )  # fmt: skip
    if any(part in message for part in LAYOUT):
        pytest.skip("a layout of the synchronous run's devices")
    try:
        setup.check_values(config)
    except ConfigError as error:
        sync_error = error
    else:
        # test_train's premise is its own base (8-bit CHOCO on 8 nodes); on this one the
        # values pass, or are a rule checked where its object is built (a topology, a
        # compressor's bits), before an elastic machine connects too.
        pytest.skip("this base takes these values: nothing to refuse")
    with pytest.raises(ConfigError) as elastic_error:
        elastic_lib.check(config, options)
    assert str(elastic_error.value) == str(sync_error)
    assert "\n" not in str(elastic_error.value)


@pytest.mark.parametrize(
    "fields,machines,message",
    [
        ({"num_nodes": 6}, 4, "config.num_nodes=6 .the workers. is not a multiple of the 4"),
        ({"overlap": True}, 2, "config.overlap=True is not supported elastic"),
        (
            {"exchange": "gossip", "mean_rounds": 2, "error_feedback": False},
            2,
            "an elastic round's members are whoever is alive",
        ),
        ({"algorithm": "choco"}, 2, "needs config.algorithm='diloco'"),
        # A machine is one process: no sum over processes to route.
        ({"process_sum": "host"}, 3, "config.process_sum='host' sums over processes of one"),
        # One machine's 16 workers on this process's 8 devices, split (FSDP) over them.
        (
            {"num_nodes": 32, "shard_model": True, "hierarchical": True, "machines": 2},
            2,
            "config.shard_model=True needs one worker on every device of a machine",
        ),
    ],
)
def test_what_only_an_elastic_run_cannot_do_is_refused_in_one_line(fields, machines, message):
    config = elastic_mlp.get_config()
    config.update(fields)
    options = elastic_lib.ElasticOptions(
        service="127.0.0.1:1", machine=0, machines=machines, token=b"t"
    )
    with pytest.raises(ConfigError, match=message) as error:
        elastic_lib.check(config, options)
    assert "\n" not in str(error.value)


def test_a_language_model_config_is_an_elastic_config():
    """configs/lm_study.py (2 machines x 4 workers, FSDP inside a machine, the outer
    momentum warm-up) passes the elastic check: one machine of 4 workers fits the 8
    devices of this process (the first 4)."""
    from configs import lm_study  # noqa: PLC0415

    config = lm_study.get_config()
    options = elastic_lib.ElasticOptions(service="127.0.0.1:1", machine=1, machines=2, token=b"t")
    elastic_lib.check(config, options)
    machine = setup.machine_config(config, 2)
    assert (machine.num_nodes, machine.machines, machine.shard_model) == (4, 1, True)
    assert machine.devices == (4 if jax.device_count() > 4 else 0)


def test_options_are_still_checked_after_the_config():
    config = elastic_mlp.get_config()
    options = elastic_lib.ElasticOptions(service="127.0.0.1:1", machine=0, machines=3, token=b"t")
    with pytest.raises(ConfigError, match=r"--elastic_machine=3 must be in \[0, 3\)"):
        elastic_lib.check(config, dataclasses.replace(options, machine=3))
