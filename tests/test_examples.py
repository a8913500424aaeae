"""The programs in examples/ run, at a small size, as a user starts them (a subprocess)."""

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def _run(script, *flags, devices=8):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *flags],
        env=env,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


def _figure(pattern, text):
    match = re.search(pattern, text)
    assert match, text
    return float(match[1])


def test_flax_choco_learns_from_non_iid_nodes():
    """At skew 1 each node holds one or two digits: without gossip the averaged model
    reaches about 0.50 after 150 steps, with CHOCO about 0.86 (the example's docstring)."""
    out = _run("flax_choco.py", "--steps=150")
    assert _figure(r"test accuracy of the averaged model: (\d\.\d+)", out) >= 0.75, out


def test_many_nodes_nests_nodes_and_reaches_the_closed_form_optimum():
    """16 nodes on 8 devices. The start is 12.3 away from w*; the mean of the nodes' own
    minimisers (no gossip) 0.68; DCD ends about 0.04 away with consensus distance 0.05
    (without gossip the nodes stay about 4.3 apart, a consensus distance near 18)."""
    out = _run("many_nodes.py", "--steps=200")
    assert "16 nodes on 8 devices: axis_name=('nodes', 'local')" in out, out
    assert _figure(r"step 200: \|mean\(w\) - w\*\| = (\S+),", out) < 0.1, out
    assert _figure(r"step 200: .*consensus distance (\S+)", out) < 0.5, out


def test_two_processes_end_where_one_process_ends():
    """2 processes x 4 devices over jax.distributed (gloo) against 1 process x 8: the same
    digits, since every collective moves the same bits; and the run converges (start
    12.3 from w*, the mean of the nodes' own minimisers 0.68 from it)."""
    multi = _run("two_processes.py", "--steps=200")
    single = _run("two_processes.py", "--steps=200", "--single")
    assert "process 0 of 2: 8 devices, 8 nodes" in multi, multi
    assert "process 0 of 1: 8 devices, 8 nodes" in single, single
    steps = re.compile(r"^step .*$", re.M)
    assert steps.findall(multi) == steps.findall(single), (multi, single)
    assert len(steps.findall(multi)) == 2, multi
    assert _figure(r"step 200: \|mean\(w\) - w\*\| = (\S+)", multi) < 0.3, multi
