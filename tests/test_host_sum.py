"""lpdec.host_sum: the sum across processes over TCP that config.process_sum="host" routes
local_mean's all-reduce through (issue 51): its arithmetic against numpy, its refusal of
processes out of step, the routing inside a jitted program, and train.py's 2-process run
through it against the same run through jax's gloo."""

import csv
import json
import pathlib
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest
from test_train import TINY_FLAGS
from test_train import _two_processes
from test_train import final_params

from lpdec import host_sum

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _star(num_processes: int) -> list[host_sum.HostSum]:
    """P HostSums joined by socket pairs as train_lib.processes joins processes: a star."""
    hub: dict[int, socket.socket] = {}
    spokes = []
    for p in range(1, num_processes):
        a, b = socket.socketpair()
        hub[p] = a
        spokes.append(host_sum.HostSum(p, num_processes, {0: b}))
    return [host_sum.HostSum(0, num_processes, hub), *spokes]


def _in_threads(groups, arrays, outs=None):
    """Each group's sum of its array, every group in a thread of its own (its process)."""
    results, errors = [None] * len(groups), [None] * len(groups)

    def run(i):
        try:
            out = None if outs is None else outs[i]
            results[i] = groups[i](arrays[i], out)
        except host_sum.HostSumError as error:
            errors[i] = error
            groups[i].close()  # as the process would end: its peers see the close

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(groups))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    return results, errors


@pytest.mark.parametrize("num_processes", [2, 3, 4])
@pytest.mark.parametrize("shape", [(37, 5), (40_001,)], ids=["one-chunk", "four-chunks"])
def test_every_process_gets_the_left_fold_in_process_order(rng, num_processes, shape):
    groups = _star(num_processes)
    for repeat in range(3):  # the connections carry one sum after another
        arrays = [rng.standard_normal(shape).astype(np.float32) for _ in groups]
        expected = arrays[0].copy()
        for a in arrays[1:]:
            expected = expected + a  # ((x0 + x1) + x2) + ..., float32
        outs = [np.empty_like(a) for a in arrays] if repeat == 1 else None
        results, errors = _in_threads(groups, arrays, outs)
        assert errors == [None] * num_processes
        for i, r in enumerate(results):
            np.testing.assert_array_equal(r, expected)
            if outs is not None:
                assert r is outs[i]
    for g in groups:
        g.close()


def test_processes_out_of_step_fail_with_one_line_on_every_side(rng):
    groups = _star(3)
    arrays = [rng.standard_normal(n).astype(np.float32) for n in (8, 8, 9)]
    _, errors = _in_threads(groups, arrays)
    assert "sum 1 of 32 bytes met process 2's sum 1 of 36 bytes" in str(errors[0])
    # Process 0 stopped (here: closed its connections); the others hear of it, as a
    # close or as a reset (process 0 left their bytes unread).
    for error in errors[1:]:
        assert isinstance(error, host_sum.HostSumError), errors
        assert "process 0 closed its host-sum connection" in str(
            error
        ) or "the host-sum connection to process 0 failed" in str(error)


def test_a_star_needs_its_connections():
    with pytest.raises(ValueError, match=r"needs connections to \[1, 2\], got \[1\]"):
        host_sum.HostSum(0, 3, {1: socket.socket()})


_ROUTING = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
from lpdec import gossip, host_sum
mesh = Mesh(np.array(jax.devices()), ("machines",))
x = {"a": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(4)}
def local(t):
    return gossip.local_sum(t, axis_name="machines")
def program(tree):
    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P(), out_specs=P()))
    return f.lower(tree).as_text(), f(tree)
for installed in (False, True):
    host_sum.install(host_sum.HostSum(0, 1, {}) if installed else None)
    text, out = program(x)
    same = all(np.array_equal(out[k], x[k]) for k in x)
    # Under vmap the axis is not the processes' mesh axis: jax's own sum.
    vmapped = jax.jit(jax.vmap(lambda t: gossip.local_sum(t, axis_name="v"), axis_name="v"))
    vtext = vmapped.lower(jnp.ones((1, 3))).as_text()
    print(installed, "callback" in text, "all_reduce" in text, same, "callback" in vtext)
"""


def test_a_sum_over_the_processes_axis_is_a_callback_only_when_installed():
    """One process of one device: with a HostSum installed, local_mean's sum over the
    mesh axis becomes a callback (no all-reduce left in the program) whose total is the
    process's own values; not installed, or over a vmap axis, jax's all-reduce."""
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", _ROUTING], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[:2] == [
        "False False True True False",
        "True True False True False",
    ], proc.stdout


def test_train_py_through_the_host_sum_ends_where_gloo_ends_bit_for_bit(tmp_path):
    """2 processes of one device, the fp32 all-reduce (20 steps of the tiny MLP): by
    default ("auto") through lpdec.host_sum, with the same parameters, losses and
    counted bytes as through jax's gloo ("jax"; 2 processes: a + b either way)."""
    flags = TINY_FLAGS + ["--config.num_nodes=2", "--config.algorithm=allreduce"]
    runs = {}
    for mode in ("jax", "auto"):
        workdir = tmp_path / mode
        _two_processes(workdir, flags + [f"--config.process_sum={mode}"], devices=1)
        rows = list(csv.DictReader(open(workdir / "metrics.csv")))
        summary = json.loads((workdir / "summary.json").read_text())
        runs[mode] = (final_params(workdir), rows, summary)
    (p_jax, rows_jax, s_jax), (p_host, rows_host, s_host) = runs["jax"], runs["auto"]
    for name in p_jax:
        np.testing.assert_array_equal(p_host[name], p_jax[name], name)
    timing = {"step_time_s", "eval_time_s", "wall_time_s"}
    for a, b in zip(rows_jax, rows_host, strict=True):
        assert {k: v for k, v in a.items() if k not in timing} == {
            k: v for k, v in b.items() if k not in timing
        }
    # The HLO holds no all-reduce through the host sum: the trace-time meter counts.
    assert s_jax["wire_bytes_source"] == "compiled HLO"
    assert s_host["wire_bytes_source"] == "trace-time meter"
    assert float(rows_host[-1]["wire_bytes_per_step"]) > 0
