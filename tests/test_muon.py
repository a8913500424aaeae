"""config.optimizer="muon": Muon on the hidden 2-D kernels, Adam on the rest.

Checked against a float64 numpy transcription of Muon's update (Jordan et al. 2024:
momentum, the Nesterov look-ahead, five quintic Newton-Schulz steps, the
sqrt(max(1, rows / cols)) scale) and optax's Adam for the other leaves.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from configs import default
from train_lib import optimizers
from train_lib.errors import ConfigError

A, B, C = 3.4445, -4.7750, 2.0315  # the paper's quintic coefficients


def _orthogonalize64(x: np.ndarray) -> np.ndarray:
    tall = x.shape[0] > x.shape[1]
    y = x.T if tall else x
    y = y / np.linalg.norm(x)
    for _ in range(5):
        gram = y @ y.T
        y = A * y + (B * gram + C * gram @ gram) @ y
    return y.T if tall else y


def _muon64(grads: list[np.ndarray], lr: float, beta: float) -> np.ndarray:
    """The summed update of Muon over the steps `grads` (one 2-D leaf), float64."""
    m = np.zeros_like(grads[0])
    total = np.zeros_like(grads[0])
    rows, cols = grads[0].shape
    for g in grads:
        m = beta * m + (1 - beta) * g
        total += -lr * max(1.0, rows / cols) ** 0.5 * _orthogonalize64((1 - beta) * g + beta * m)
    return total


def _config(**fields) -> ml_collections.ConfigDict:
    config = default.get_config()
    config.optimizer = "muon"
    config.learning_rate = 0.02
    config.muon_adam_lr = 4e-3
    config.weight_decay = 0.0
    for k, v in fields.items():
        setattr(config, k, v)
    return config


@pytest.mark.parametrize("shape", [(24, 8), (8, 24), (16, 16)])
def test_newton_schulz_matches_the_float64_iteration_and_flattens_the_spectrum(shape):
    x = np.random.default_rng(0).normal(size=shape)
    got = np.asarray(optimizers.orthogonalize(jnp.asarray(x, jnp.float32)), np.float64)
    np.testing.assert_allclose(got, _orthogonalize64(x), rtol=2e-4, atol=2e-5)
    # What the iteration is for: singular values near 1 (Muon's range, about 0.7-1.2).
    singular = np.linalg.svd(got, compute_uv=False)
    assert singular.min() > 0.5 and singular.max() < 1.3, singular


def test_muon_steps_the_hidden_kernels_and_adam_the_rest():
    rng = np.random.default_rng(1)
    params = {
        "token_embed": {"embedding": rng.normal(size=(12, 6))},
        "block0": {
            "mlp": {"kernel": rng.normal(size=(6, 10)), "bias": rng.normal(size=(10,))},
            "attn": {"kernel": rng.normal(size=(10, 6))},
        },
        "head": {"kernel": rng.normal(size=(6, 12))},
    }
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
    grads = [jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), params)
             for _ in range(3)]  # fmt: skip
    c = _config()
    tx = optimizers.make_local_optimizer(c, optax.constant_schedule(c.learning_rate))
    state = tx.init(params)
    total = jax.tree.map(jnp.zeros_like, params)
    for g in grads:
        update, state = tx.update(g, state, params)
        total = jax.tree.map(jnp.add, total, update)
    adam = optax.adam(c.muon_adam_lr)
    adam_state = adam.init(params)
    adam_total = jax.tree.map(jnp.zeros_like, params)
    for g in grads:
        update, adam_state = adam.update(g, adam_state, params)
        adam_total = jax.tree.map(jnp.add, adam_total, update)
    for block, name in (("mlp", "kernel"), ("attn", "kernel")):
        want = _muon64(
            [np.asarray(g["block0"][block][name], np.float64) for g in grads],
            c.learning_rate,
            c.muon_beta,
        )
        np.testing.assert_allclose(total["block0"][block][name], want, rtol=1e-3, atol=1e-6)
    for path in (("token_embed", "embedding"), ("block0", "mlp", "bias"), ("head", "kernel")):
        got, want = total, adam_total
        for key in path:
            got, want = got[key], want[key]
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-8)


def test_muon_with_a_split_model_or_bad_values_is_one_line_before_training():
    from train_lib import setup

    config = _config(
        num_nodes=8, hierarchical=True, machines=2, shard_model=True, dataset="stdlib_text",
        model="transformer", num_steps=1,
    )  # fmt: skip
    with pytest.raises(ConfigError, match="orthogonalizes each weight matrix whole"):
        setup.check_values(config)
    for field, value, match in (
        ("muon_adam_lr", 0.0, "muon_adam_lr=0.0 must be > 0"),
        ("muon_beta", 1.0, "muon_beta=1.0 must be in"),
    ):
        with pytest.raises(ConfigError, match=match):
            setup.check_values(_config(**{field: value}))
