"""What tests/test_dpsgd.py and tests/test_choco.py share: the problem and the mixing
matrices written out."""

import numpy as np

import lpdec
from lpdec import testing as harness

N, D, T, LR = 8, 37, 20, 0.1


def problem(rng, n=N, steps=T):
    x0 = rng.standard_normal((n, D)).astype(np.float32)
    grads = rng.standard_normal((n, steps, D)).astype(np.float32)
    return x0, grads


def ring_w(n):
    """Ring mixing matrix written out: each node averages itself and its two neighbours."""
    w = np.zeros((n, n))
    for i in range(n):
        for j in (i - 1, i, i + 1):
            w[i, j % n] = 1 / 3
    return w


def torus_2x4_w():
    """torus(2, 4) written out: node r * 4 + c averages itself, its row neighbours c +- 1
    and the node in the other row (up and down coincide): 4 weights of 1/4."""
    w = np.zeros((8, 8))
    for r in range(2):
        for c in range(4):
            me = r * 4 + c
            for j in (me, r * 4 + (c + 1) % 4, r * 4 + (c - 1) % 4, (1 - r) * 4 + c):
                w[me, j] = 1 / 4
    return w


def check_zero_updates_preserve_the_node_average(rng, make):
    """Symmetric doubly stochastic W and u = 0: the average of the models never moves."""
    topology = lpdec.ring(N)
    x0, _ = problem(rng)
    zeros = np.zeros((N, 60, D), np.float32)
    params, _, _ = harness.run(make(topology), {"w": x0}, 60, updates={"w": zeros})
    trajectory = np.asarray(params["w"], np.float64)
    drift = np.abs(trajectory.mean(axis=0) - x0.astype(np.float64).mean(axis=0)).max()
    moved = np.abs(trajectory[:, -1] - x0).max()
    assert moved > 0.1  # the nodes did mix
    # Worst case float32 rounding: about 4 roundings of |x| per step, 60 steps.
    bound = 60 * 4 * np.finfo(np.float32).eps * np.abs(x0).max()
    assert drift < bound, (drift, bound)
