"""ResNet-20 at seed 002's learning rate on random CIFAR-format bytes: which runs diverge.

Issue 26: 8 nodes of ResNet-20 with 8-bit training (Range EvoNorm) and LP-CHOCO
diverged at lr 0.1 on random bytes (train loss 1.2e21 at step 150) where 32-bit
training (EvoNorm) did not. The divergence is a single model's, so this trains
ONE node, no gossip, with `configs/cifar10_resnet20_ring8.py`'s local recipe
(Nesterov 0.9, weight decay 1e-4, batch 32, lr 0.1 without decay) on images of
uniform random bytes, normalized as `lpdec.data.cifar10` does, and random labels
(or, with --labels=brightness, the decile of each image's mean: a learnable
label), and prints the train loss at a few steps and its maximum.

Besides precision, norm and lpdec's `zero_init_residual` it can change the
classifier's init to the authors' 8-bit one (N(0, 0.01), --classifier=authors),
add a linear warmup, and two diagnostics that patch Range EvoNorm in this
process: --range_stop_gradient (no gradient through the range statistic) and
--range_sigmoid (EvoNorm's sigmoid in place of the hard sigmoid).

Usage::

    python -m bench.resnet_stability --precision=int8 --norm=range_evonorm \\
        --zero_init_residual=false              # one run (about 1 s a step on 2 cores)
    python -m bench.resnet_stability --table    # EXPERIMENTS.md's table (about 10 min)
    python -m bench.resnet_stability --init     # loss, gradient and activations at init
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lpdec.data.datasets import CIFAR10_MEAN
from lpdec.data.datasets import CIFAR10_STD
from lpdec.models import ResNet
from lpdec.nn import norms

REPORTED_STEPS = (1, 2, 5, 10, 20, 30, 40, 50, 60, 100, 200)


@dataclasses.dataclass(frozen=True)
class Run:
    precision: str = "int8"
    norm: str = "range_evonorm"
    zero_init_residual: bool | None = None  # None: lpdec's default for the norm
    lr: float = 0.1
    warmup: int = 0
    steps: int = 30
    labels: str = "random"  # or "brightness"
    classifier: str = "default"  # or "authors": N(0, 0.01) kernel, zero bias
    range_stop_gradient: bool = False
    range_sigmoid: bool = False
    depth: int = 20
    batch: int = 32
    seed: int = 0

    def label(self) -> str:
        parts = [self.precision, self.norm, f"zero_init_residual={self.zero_init_residual}"]
        parts.append(f"lr {self.lr:g}" + (f", warmup {self.warmup}" if self.warmup else ""))
        if self.labels != "random":
            parts.append(f"{self.labels} labels")
        if self.classifier != "default":
            parts.append(f"{self.classifier} classifier init")
        if self.range_stop_gradient:
            parts.append("no gradient through the range")
        if self.range_sigmoid:
            parts.append("sigmoid in Range EvoNorm")
        return ", ".join(parts)


def random_cifar_batches(run: Run) -> tuple[np.ndarray, np.ndarray]:
    """[steps, batch, 32, 32, 3] normalized random-byte images and [steps, batch] labels."""
    rng = np.random.default_rng(run.seed)
    pixels = rng.integers(0, 256, (run.steps, run.batch, 32, 32, 3), dtype=np.uint8)
    x = ((pixels / np.float32(255.0) - np.float32(CIFAR10_MEAN)) / np.float32(CIFAR10_STD)).astype(
        np.float32
    )
    if run.labels == "random":
        y = rng.integers(0, 10, (run.steps, run.batch))
    elif run.labels == "brightness":
        means = x.mean(axis=(2, 3, 4))
        y = np.digitize(means, np.quantile(means, np.linspace(0.1, 0.9, 9)))
    else:
        raise ValueError(f"labels must be 'random' or 'brightness'; got {run.labels!r}.")
    return x, y.astype(np.int32)


def train(run: Run) -> np.ndarray:
    """The train loss at every step of `run`."""
    mean_range, hard_sigmoid = norms.mean_range, jax.nn.hard_sigmoid
    if run.range_stop_gradient:
        norms.mean_range = lambda v, c: jax.lax.stop_gradient(mean_range(v, c))
    if run.range_sigmoid:
        jax.nn.hard_sigmoid = jax.nn.sigmoid
    try:
        return _train(run)
    finally:
        norms.mean_range, jax.nn.hard_sigmoid = mean_range, hard_sigmoid


def _train(run: Run) -> np.ndarray:
    xs, ys = random_cifar_batches(run)
    model = ResNet(
        depth=run.depth,
        precision=run.precision,
        norm=run.norm,
        zero_init_residual=run.zero_init_residual,
    )
    params = model.init(jax.random.key(run.seed), xs[0, :2])["params"]
    if run.classifier == "authors":
        kernel = params["classifier"]["kernel"]
        params = {
            **params,
            "classifier": {
                "kernel": 0.01 * jax.random.normal(jax.random.key(run.seed + 1), kernel.shape),
                "bias": jnp.zeros_like(params["classifier"]["bias"]),
            },
        }
    lr = run.lr
    if run.warmup:
        lr = optax.join_schedules(
            [optax.linear_schedule(0.0, run.lr, run.warmup), optax.constant_schedule(run.lr)],
            [run.warmup],
        )
    tx = optax.chain(optax.add_decayed_weights(1e-4), optax.sgd(lr, momentum=0.9, nesterov=True))

    def loss_fn(params, x, y, key):
        logits = model.apply({"params": params}, x, rngs={"quant": key})
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit
    def step(params, opt_state, x, y, key):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y, key)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state = tx.init(params)
    losses = []
    for i in range(run.steps):
        key = jax.random.key(1000 + i)
        params, opt_state, loss = step(params, opt_state, xs[i], ys[i], key)
        losses.append(float(loss))
    return np.asarray(losses)


def summary(losses: np.ndarray) -> str:
    at = " ".join(f"{k}: {losses[k - 1]:.3g}" for k in REPORTED_STEPS if k <= len(losses))
    finite = losses[np.isfinite(losses)]
    top = f"{finite.max():.3g}" if finite.size else "nan"
    nan = f", first non-finite at step {int(np.argmin(np.isfinite(losses))) + 1}"
    return f"{at} | max {top}{nan if finite.size < losses.size else ''}"


# EXPERIMENTS.md's table: (what it shows, run).
TABLE = (
    ("32-bit, EvoNorm (seed 002's fp32 model)", Run(precision="fp32", norm="evonorm")),
    ("8-bit, EvoNorm", Run(norm="evonorm")),
    ("32-bit, Range EvoNorm, every gamma 1", Run(precision="fp32", zero_init_residual=False)),
    ("8-bit, Range EvoNorm, every gamma 1 (before the fix)", Run(zero_init_residual=False)),
    ("32-bit, Range EvoNorm (lpdec now)", Run(precision="fp32")),
    ("8-bit, Range EvoNorm (lpdec now)", Run()),
    ("  before the fix, learnable labels", Run(zero_init_residual=False, labels="brightness")),
    ("  lpdec now, learnable labels", Run(labels="brightness")),
    ("  before the fix, lr 0.03", Run(zero_init_residual=False, lr=0.03)),
    ("  before the fix, lr 0.01", Run(zero_init_residual=False, lr=0.01)),
    ("  before the fix, 30 warmup steps", Run(zero_init_residual=False, warmup=30, steps=60)),
    (
        "  before the fix, authors' classifier init",
        Run(zero_init_residual=False, classifier="authors"),
    ),
    (
        "  32-bit, before the fix, no gradient through the range",
        Run(precision="fp32", zero_init_residual=False, range_stop_gradient=True),
    ),
    (
        "  32-bit, before the fix, sigmoid for hard sigmoid",
        Run(precision="fp32", zero_init_residual=False, range_sigmoid=True),
    ),
    ("  lpdec now, 200 steps", Run(steps=200)),
)


def init_statistics(
    precision: str, norm: str, zero_init_residual: bool | None, depth: int = 20
) -> str:
    """A table row: loss, gradient norm and RMS of each block's output on one batch at init."""
    run = Run(precision=precision, norm=norm, zero_init_residual=zero_init_residual, steps=1)
    xs, ys = random_cifar_batches(run)
    model = ResNet(
        depth=depth, precision=precision, norm=norm, zero_init_residual=zero_init_residual
    )
    params = model.init(jax.random.key(run.seed), xs[0, :2])["params"]

    def loss_fn(params, x, y):
        logits, state = model.apply(
            {"params": params},
            x,
            rngs={"quant": jax.random.key(1000)},
            capture_intermediates=lambda module, _: (module.name or "").startswith("stage"),
            mutable=["intermediates"],
        )
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return loss, state["intermediates"]

    grad_fn = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
    (loss, blocks), grads = grad_fn(params, xs[0], ys[0])
    rms = [float(jnp.sqrt(jnp.mean(blocks[name]["__call__"][0] ** 2))) for name in sorted(blocks)]
    return (
        f"| {precision} | {norm} | {zero_init_residual} | {float(loss):.3f} | "
        f"{float(optax.tree.norm(grads)):.3g} | {' '.join(f'{r:.2f}' for r in rms)} |"
    )


def _bool_or_none(text: str) -> bool | None:
    return {"default": None, "true": True, "false": False}[text.lower()]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--table", action="store_true", help="run EXPERIMENTS.md's table")
    parser.add_argument("--init", action="store_true", help="statistics at init, no training")
    for field in dataclasses.fields(Run):
        name = f"--{field.name}"
        if field.name == "zero_init_residual":
            parser.add_argument(name, type=_bool_or_none, default=None, help="default|true|false")
        elif isinstance(field.default, bool):
            parser.add_argument(name, action="store_true")
        else:
            parser.add_argument(name, type=type(field.default), default=field.default)
    args = vars(parser.parse_args(argv))
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, ln 10 = {math.log(10):.3f}")
    if args.pop("init"):
        print(
            "| precision | norm | zero_init_residual | loss | gradient norm | RMS of blocks 1-9 |"
        )
        print("|---|---|---|---|---|---|")
        for precision in ("fp32", "int8"):
            for norm, zero in (
                ("evonorm", False),
                ("range_evonorm", False),
                ("range_evonorm", None),
            ):
                print(init_statistics(precision, norm, zero), flush=True)
        return
    rows = TABLE if args.pop("table") else (("", Run(**args)),)
    print("| run | train loss at step | time |\n|---|---|---|")
    for name, run in rows:
        start = time.time()
        losses = train(run)
        print(
            f"| {name or run.label()} | {summary(losses)} | {time.time() - start:.0f} s |",
            flush=True,
        )


if __name__ == "__main__":
    main()
