"""lpdec.algorithms.naive_quantized against numpy references of seed 003 with an explicit W
(tests/_moniqua_reference.py), and the floor Theorem 1 of seed 003 puts under it."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _moniqua_reference import CASES
from _moniqua_reference import RING
from _moniqua_reference import N
from _moniqua_reference import check_each_step_matches_dense_reference

from lpdec import testing as harness
from lpdec.algorithms import choco
from lpdec.algorithms import moniqua
from lpdec.algorithms import naive_quantized
from lpdec.compress import base as compress_base
from lpdec.compress import identity
from lpdec.compress import minmax
from lpdec.compress import modulo


@pytest.mark.parametrize("mode", harness.MODES)
@pytest.mark.parametrize("name", [n for n in CASES if CASES[n].kind == "naive"])
def test_each_step_matches_dense_reference(name, mode, rng):
    check_each_step_matches_dense_reference(name, mode, rng)


@compress_base.payload_dataclass(data=("codes",))
class LatticePayload:
    codes: jax.Array
    shape: tuple[int, ...]
    dtype: jnp.dtype


@dataclasses.dataclass(frozen=True)
class Lattice(compress_base.Compressor):
    """Theorem 1's premise: an unbiased linear quantizer on the fixed points {delta n}.

    `lpdec.minmax` does not realise it: its grid spans each chunk's [min, max],
    so it shrinks as the models agree and naive gossip with it converges (on
    this problem it reaches E||grad||^2 < 1e-7). Stochastic rounding to delta Z:
    floor, plus delta with probability equal to the fraction.
    """

    delta: float = 1.0

    @property
    def needs_key(self):
        return True

    def encode(self, x, key=None):
        scaled = x.astype(jnp.float32) / self.delta
        low = jnp.floor(scaled)
        up = jax.random.uniform(key, x.shape) < scaled - low
        return LatticePayload((low + up).astype(jnp.int32), tuple(x.shape), x.dtype)

    def decode(self, payload, *, reference=None, key=None):
        del reference, key
        return (payload.codes.astype(jnp.float32) * self.delta).astype(payload.dtype)

    def wire_bytes(self, num_elements, dtype=jnp.float32):
        del dtype
        return 4 * num_elements

    def is_finite(self, payload):
        del payload
        return jnp.bool_(True)


def test_theorem1_naive_quantization_stays_above_the_floor():
    # Seed 003, Theorem 1 (the text extraction drops symbols; reconstructed as):
    # with an unbiased linear quantizer of representable points {delta n} on
    # f(x) = (x - (delta/2) 1)^T (x - (delta/2) 1) / 2 (the extraction's
    # "x - - 1/2" is "x - delta 1/2": the optimum sits midway between two grid
    # points), for every step size, iteration k and node i,
    #   E ||grad f(x_{k,i})||^2 >= delta^2 rho^2 / (8 (1 + rho^2)),
    # rho the smallest non-zero entry of W (1/3 on ring(8)). The mechanism is per
    # coordinate: node i's next model carries W_ij^2 Var(Q(x_j)) >= rho^2 (delta^2/4
    # - (x_j - delta/2)^2) of rounding noise from each neighbour j, large unless x_j
    # is far from the optimum. The coordinates evolve independently and alike (the
    # lattice rounds each one independently), so they are d copies of the 1-D
    # problem, and their mean estimates E (df/dx)^2 of one copy; checking it against
    # the floor is stronger than checking E ||grad f||^2 (d times larger). delta = 1
    # gives f(x) = ||x - 1/2||^2 / 2. One leaf per step size, each with gradient
    # lr * (x - 1/2) under sgd(1): independent experiments in one run.
    delta, rho = 1.0, 1.0 / 3.0
    floor = delta**2 * rho**2 / (8 * (1 + rho**2))
    lrs = (0.5, 0.2, 0.05, 0.02)
    d, steps = 128, 400
    params = {f"lr{i}": jnp.zeros((N, d), jnp.float32) for i in range(len(lrs))}

    def grad_fn(p, node, t):
        del node, t
        return {f"lr{i}": lr * (p[f"lr{i}"] - delta / 2) for i, lr in enumerate(lrs)}

    def mean_sq_grad(alg):
        ps, _, _ = harness.run(
            optax.chain(optax.sgd(1.0), alg), params, steps, grad_fn=grad_fn, mode="vmap"
        )
        # [leaf, node, step]: mean over coordinates.
        return np.stack([np.mean((np.asarray(ps[k], np.float64) - delta / 2) ** 2, -1) for k in ps])

    naive = mean_sq_grad(naive_quantized.naive_quantized(RING, Lattice(delta)))
    assert naive.min() > floor, (naive.min(), floor)  # every step size, node and step
    for alg in (
        moniqua.moniqua(RING, modulo(8, 0.5, "stochastic")),
        choco.choco(RING, minmax(8, "stochastic"), gamma=1.0),
    ):
        tail = mean_sq_grad(alg)[:, :, -50:].mean(-1)
        assert tail.max() < floor / 100, (tail.max(), floor)


@pytest.mark.parametrize(
    ("build", "error", "message"),
    [
        (
            lambda: naive_quantized.naive_quantized(RING, modulo(8)),
            TypeError,
            "moniqua",
        ),
        (lambda: naive_quantized.naive_quantized(RING, "minmax"), TypeError, "compressor"),
    ],
)
def test_bad_arguments_raise_clear_errors(build, error, message):
    with pytest.raises(error, match=message):
        build()


@pytest.mark.parametrize(
    "tx",
    [
        naive_quantized.naive_quantized(RING, identity()),
    ],
)
def test_missing_params_raise(tx):
    params = {"w": jnp.zeros((N, 3))}
    with pytest.raises(ValueError, match="parameters"):
        jax.vmap(lambda p: tx.update(p, tx.init(p)), axis_name="nodes")(params)
