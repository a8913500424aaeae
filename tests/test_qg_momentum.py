"""lpdec.algorithms.qg_momentum (quasi-global momentum) against the paper's formulas in numpy.

The reference is QG-DSGDm (Lin et al. 2021, Alg. 1) with D-PSGD's gossip and an
explicit mixing matrix, in float64.
"""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lpdec import testing as harness
from lpdec.algorithms.dpsgd import dpsgd
from lpdec.algorithms.qg_momentum import qg_momentum
from lpdec.topology import ring

N = 8


AXIS = harness.AXIS


def _qgm_reference(x0, grads, w, lr, beta, nesterov):
    """QG-DSGDm (Lin et al. 2021, Alg. 1) with D-PSGD's gossip, numpy float64.

    x0: [n, d]; grads: [n, T, d]. Returns the params and m_hat after each step.
    """
    x, m_hat = x0.astype(np.float64), np.zeros(x0.shape)
    x_prev, lr_prev = None, 0.0
    xs, m_hats = [], []
    for t in range(grads.shape[1]):
        g = grads[:, t].astype(np.float64)
        if t > 0 and lr_prev != 0:
            m_hat = beta * m_hat + (1 - beta) * (x_prev - x) / lr_prev
        m = g + beta * m_hat
        update = -lr(t) * (g + beta * m if nesterov else m)
        x_prev, lr_prev = x, lr(t)
        x = w @ x + update  # D-PSGD: x+ = sum_j W_ij x_j + u
        xs.append(x)
        m_hats.append(m_hat)
    return np.stack(xs, 1), np.stack(m_hats, 1)


WARMUP = optax.linear_schedule(0.0, 0.1, 5)


@pytest.mark.parametrize(
    "nesterov, schedule, mode",
    [
        (False, "constant", "shard_map"),
        (True, "constant", "vmap"),
        (False, "warmup", "vmap"),
        (True, "warmup", "shard_map"),
    ],
)
def test_qg_momentum_matches_paper_formulas(nesterov, schedule, mode, rng):
    steps, beta, topo = 25, 0.9, ring(N)
    learning_rate = 0.05 if schedule == "constant" else WARMUP
    lr = (lambda t: 0.05) if schedule == "constant" else (lambda t: float(WARMUP(t)))
    params0 = {"v": rng.standard_normal((N, 6)).astype(np.float32)}
    grads = {"v": rng.standard_normal((N, steps, 6)).astype(np.float32)}
    tx = optax.chain(
        qg_momentum(learning_rate, momentum=beta, nesterov=nesterov), dpsgd(topo, axis_name=AXIS)
    )
    ps, ss, _ = harness.run(tx, params0, steps, updates=grads, mode=mode)
    xs, m_hats = _qgm_reference(params0["v"], grads["v"], topo.mixing_matrix(), lr, beta, nesterov)
    np.testing.assert_allclose(ps["v"], xs, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ss[0].m_hat["v"], m_hats, rtol=1e-4, atol=1e-4)
    # The buffer is quasi-global: it is not plain local momentum of the gradients.
    assert np.abs(m_hats[:, -1]).max() > 0.1


def test_qg_momentum_under_inject_hyperparams_matches_fixed_hyperparameters():
    tx = optax.inject_hyperparams(qg_momentum)(learning_rate=0.05, momentum=0.8)
    reference = qg_momentum(0.05, momentum=0.8)
    params = {"v": jnp.arange(4.0)}
    state, ref_state = tx.init(params), reference.init(params)
    for t in range(3):
        grads = {"v": jnp.sin(params["v"] + t)}
        updates, state = tx.update(grads, state, params)
        expected, ref_state = reference.update(grads, ref_state, params)
        np.testing.assert_allclose(updates["v"], expected["v"], rtol=1e-6)
        # A move the optimizer did not make (gossip, say) enters the buffer.
        params = optax.apply_updates(params, {"v": updates["v"] + 0.01})


def test_qg_momentum_bad_inputs_raise_clear_errors():
    for momentum in (-0.1, 1.0, True, "0.9"):
        with pytest.raises(ValueError, match="momentum"):
            qg_momentum(0.1, momentum=momentum)
    for lr in (-0.1, float("nan"), "0.1"):
        with pytest.raises(ValueError, match="learning_rate"):
            qg_momentum(lr)
    with pytest.raises(TypeError, match="nesterov"):
        qg_momentum(0.1, nesterov="yes")
    qgm = qg_momentum(0.1)
    with pytest.raises(ValueError, match="needs the current parameters"):
        qgm.update({"v": jnp.ones(4)}, qgm.init({"v": jnp.ones(4)}))
