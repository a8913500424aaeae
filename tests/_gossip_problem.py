"""What tests/test_dpsgd.py and tests/test_choco.py share: the problem and the mixing
matrices written out."""

import numpy as np

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
