"""Does XLA:CPU run training steps slower inside a loop? What train.py's chunks do about it.

    python -m bench.cpu_loops                           # writes its section of BENCHMARKS.md
    python -m bench.cpu_loops --quick --output /tmp/cpu_loops.md

XLA:CPU runs convolutions inside a loop (`lax.scan`, `while`) several times slower
than the same convolutions in a program without one (jax-ml/jax#12868), while
matmuls run as fast or faster in the loop. Two parts, each measured side by side in
one run (the two ways alternate, round after round; medians over the rounds):

1. The primitive, on one CPU device: `--steps` SGD steps of a model, as one jitted step
   called `--steps` times, against the same steps in one jitted `lax.scan`. Models: a
   2-D CNN (4 convolutions 3x3, 16 channels, 16x16 inputs), a 1-D CNN (3 convolutions
   of width 5, 32 channels, 256-long inputs) and an MLP of matmuls only (2 hidden
   layers of 512).
2. train.py's chunks (`train_lib.loop.Chunks`) on 8 CPU devices: a config's chunks of
   `--chunk` steps (its `log_every`) run one program per step (what Chunks picks on CPU for a model
   with a convolution) against one program per chunk (its choice elsewhere), the two
   alternating on the same trainer; and which one Chunks picks by itself. Configs:
   configs/quickstart.py (MNIST-1D's 1-D CNN, 8-bit CHOCO gossip) and configs/lm_tiny.py
   (a byte-level transformer, the language-model study's model).

Seconds per step are wall-clock times until every result is ready. The ratio is the
loop's time over the per-step program's: above 1, the loop is slower. The primitive's
two ways must end at the same model (to float32 rounding; the table says whether they
did); train.py's two ways are checked against each other by tests/test_chunks.py.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import _sections  # noqa: E402

SECTION = "bench/cpu_loops.py"


def _dense(key, shape):
    return jax.random.normal(key, shape, jnp.float32) / np.sqrt(np.prod(shape[:-1]))


def cnn2d(key, batch: int):
    """(params, x, y, apply) of a 4-layer 2-D CNN on 16x16x8 inputs."""
    keys = jax.random.split(key, 6)
    params = [_dense(keys[i], (3, 3, 8 if i == 0 else 16, 16)) for i in range(4)]
    params.append(_dense(keys[4], (16, 10)))
    x = jax.random.normal(keys[5], (batch, 16, 16, 8))

    def apply(p, x):
        for w in p[:-1]:
            x = jax.nn.relu(
                jax.lax.conv_general_dilated(
                    x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
                )
            )
        return x.mean(axis=(1, 2)) @ p[-1]

    return params, x, jnp.arange(batch) % 10, apply


def cnn1d(key, batch: int):
    """(params, x, y, apply) of a 3-layer 1-D CNN on 256-long, 4-channel inputs."""
    keys = jax.random.split(key, 5)
    params = [_dense(keys[i], (5, 4 if i == 0 else 32, 32)) for i in range(3)]
    params.append(_dense(keys[3], (32, 10)))
    x = jax.random.normal(keys[4], (batch, 256, 4))

    def apply(p, x):
        for w in p[:-1]:
            x = jax.nn.relu(
                jax.lax.conv_general_dilated(
                    x, w, (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC")
                )
            )
        return x.mean(axis=1) @ p[-1]

    return params, x, jnp.arange(batch) % 10, apply


def mlp(key, batch: int):
    """(params, x, y, apply) of an MLP (2048 -> 512 -> 512 -> 10), matmuls only."""
    keys = jax.random.split(key, 4)
    params = [_dense(keys[0], (2048, 512)), _dense(keys[1], (512, 512)), _dense(keys[2], (512, 10))]
    x = jax.random.normal(keys[3], (batch, 2048))

    def apply(p, x):
        for w in p[:-1]:
            x = jax.nn.relu(x @ w)
        return x @ p[-1]

    return params, x, jnp.arange(batch) % 10, apply


MODELS = {"2-D CNN": cnn2d, "1-D CNN": cnn1d, "MLP": mlp}


def primitive(build, steps: int, rounds: int, batch: int) -> dict:
    """Seconds per SGD step of `build`'s model: one program per step against one scan."""
    params, x, y, apply = build(jax.random.key(0), batch)

    def loss(p):
        logits = apply(p, x)
        return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(len(y)), y])

    def sgd(p, _=None):
        g = jax.grad(loss)(p)
        return jax.tree.map(lambda a, b: a - 0.01 * b, p, g), None

    step = jax.jit(lambda p: sgd(p)[0])
    scan = jax.jit(lambda p: jax.lax.scan(sgd, p, length=steps)[0])

    def per_step(p):
        for _ in range(steps):
            p = step(p)
        return p

    times = _alternate({"per step": per_step, "scan": scan}, params, steps, rounds)
    # The two ways compute the same steps: their models agree to float32 rounding.
    ends = [jax.tree.leaves(way(params)) for way in (per_step, scan)]
    times["agree"] = all(
        np.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(*ends, strict=True)
    )
    return times


def _alternate(ways: dict, state, steps: int, rounds: int) -> dict:
    """Median seconds per step of each way over `rounds` rounds, alternating (each
    compiled and run once before)."""
    for way in ways.values():
        jax.block_until_ready(way(state))
    times: dict[str, list[float]] = {name: [] for name in ways}
    for r in range(rounds):
        order = list(ways) if r % 2 == 0 else list(reversed(ways))
        for name in order:
            started = time.perf_counter()
            jax.block_until_ready(ways[name](state))
            times[name].append((time.perf_counter() - started) / steps)
    return {name: statistics.median(t) for name, t in times.items()}


def chunks(config_module: str, rounds: int, length: int) -> dict:
    """Seconds per step of train.py's chunks of a config: one program per step against
    one per chunk, alternating on one trainer; and what Chunks picks by itself."""
    import importlib

    from train_lib import loop
    from train_lib import setup

    config = importlib.import_module(f"configs.{config_module}").get_config()
    config.log_every = length
    config.checkpoint_every = 0  # the trainer saves nothing here
    exp = setup.build(config)
    with tempfile.TemporaryDirectory() as workdir:
        trainer = loop.SyncTrainer(exp, workdir)
        own = trainer.chunks
        forced = {
            True: loop.Chunks(exp, trainer.programs),
            False: loop.Chunks(exp, trainer.programs),
        }
        for flag, chunk in forced.items():
            chunk.step_by_step = flag
        state = [trainer.params, trainer.opt_state, trainer.model_state]
        step = 0
        times: dict[bool, list[float]] = {True: [], False: []}
        for r in range(rounds + 1):  # the first round compiles
            for flag in (True, False) if r % 2 == 0 else (False, True):
                *state, _, _, seconds = forced[flag].run(
                    *state, trainer.batcher, config.log_every, step, trainer.key
                )
                step += config.log_every
                if r > 0:
                    times[flag].append(seconds)
        own.run(*state, trainer.batcher, 1, step, trainer.key)
        picked = "per step" if own.step_by_step else "scan"
    return {
        "per step": statistics.median(times[True]),
        "scan": statistics.median(times[False]),
        "picked": picked,
        "length": config.log_every,
    }


def report(first: dict, second: dict, args, elapsed: float) -> str:
    """The section's markdown."""
    command = " ".join(["python -m bench.cpu_loops", *sys.argv[1:]])
    lines = [
        f"## Training steps inside a loop on XLA:CPU (`{SECTION}`)",
        "",
        f"`{command}`",
        "",
        f"Measured {datetime.date.today()} on {platform.machine()}, "
        f"{os.cpu_count()} CPU cores; {_sections.versions()}; {elapsed / 60:.1f} min.",
        "",
        "Seconds per training step, the two ways alternating round after round in one "
        f"run (medians over {args.rounds} rounds); loop / per step: above 1, the loop is "
        "slower (jax-ml/jax#12868: XLA:CPU runs convolutions inside a loop slower).",
        "",
        f"### One CPU device: {args.steps} SGD steps, one program per step against one `lax.scan`",
        "",
        "| model | one program per step | one scan | scan / per step | same model after |",
        "|---|---|---|---|---|",
    ]
    for name, t in first.items():
        lines.append(
            f"| {name} (batch {args.batch}) | {t['per step'] * 1e3:.2f} ms | "
            f"{t['scan'] * 1e3:.2f} ms | {t['scan'] / t['per step']:.2f}x | "
            f"{'yes' if t['agree'] else 'NO'} |"
        )
    lines += [
        "",
        "### train.py's chunks on 8 CPU devices (`train_lib.loop.Chunks`)",
        "",
        "| config | steps a chunk | one program per step | one program per chunk "
        "| chunk / per step | Chunks picks |",
        "|---|---|---|---|---|---|",
    ]
    for name, t in second.items():
        lines.append(
            f"| configs/{name}.py | {t['length']} | {t['per step'] * 1e3:.1f} ms | "
            f"{t['scan'] * 1e3:.1f} ms | {t['scan'] / t['per step']:.2f}x | {t['picked']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="steps of the primitive's scan")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--configs", default="quickstart,lm_tiny")
    parser.add_argument("--chunk", type=int, default=20, help="steps of train.py's chunks")
    parser.add_argument("--quick", action="store_true", help="3 rounds, 4-step chunks")
    parser.add_argument("--output", default=None, help="default: BENCHMARKS.md's section")
    args = parser.parse_args(argv)
    for flag in ("steps", "batch", "rounds", "chunk"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1; got {getattr(args, flag)}.")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for name in args.configs.split(","):
        if not os.path.isfile(os.path.join(root, "configs", f"{name}.py")):
            parser.error(f"--configs: no configs/{name}.py (names such as quickstart,lm_tiny).")
    if args.quick:
        args.rounds, args.steps, args.chunk = 3, 4, 4
    started = time.time()
    first = {
        name: primitive(build, args.steps, args.rounds, args.batch)
        for name, build in MODELS.items()
    }
    for name, t in first.items():
        print(f"{name}: {t}", flush=True)
    second = {}
    for name in args.configs.split(","):
        second[name] = chunks(name, args.rounds, args.chunk)
        print(f"{name}: {second[name]}", flush=True)
    text = report(first, second, args, time.time() - started)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    else:
        path = os.path.join(
            os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "BENCHMARKS.md"
        )
        _sections.replace_section(path, SECTION, text, header=_sections.BENCHMARKS_HEADER)


if __name__ == "__main__":
    main()
