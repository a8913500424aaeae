"""The language model's compute, op by op: XLA:CPU against PyTorch on one thread (issue 51).

    python -m bench.step_ops             # ~2 min on an idle core; writes BENCHMARKS.md
    python -m bench.step_ops --no-write  # print only

bench/step_parity.py finds lpdec's 2-process language-model step slower than DDP's
with nothing on the wire (its "no exchange" row): the compute. This splits that
compute. Both sides run configs/lm_study.py's transformer (120,576 parameters:
d_model 64, 2 layers, 4 heads, 64-byte windows, tied embeddings; bench/ddp_lm.py is
the PyTorch copy) on a layout-(a) process's batch (32 windows, 2,048 tokens): the
forward pass, the softmax cross-entropy, the backward pass and Adam, in one process
pinned to core 0 with one thread (XLA's eigen pool off and
`intra_op_parallelism_threads=1`; `torch.set_num_threads(1)`).

Each side's step is timed without a profiler (the median of `--steps`), then profiled
(jax.profiler's trace of XLA's thunks; torch.profiler's operators) and its op time
put in classes: the dense layers' and the logits' matmuls, attention (scores,
mask, softmax, the weighted sum), GELU, layer norms, the loss, Adam, and the rest
(copies, transposes, adds, fills). An XLA fusion counts in the class of the op it is
named after (`op_name` in its metadata), so a matmul fused with its epilogue counts
with the matmul. The profiled op times sum to about the step (a profiler adds its own
cost); the shares are what the table compares.

JAX's step here is one jitted call a step; train.py runs a chunk of steps as one
program (its step is faster, bench/step_parity.py's one-process row).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
ONE_THREAD = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
BATCH, CONTEXT, D_MODEL, LAYERS, HEADS, VOCAB = 32, 64, 64, 2, 4, 256
CLASSES = (
    "matmuls (dense layers, logits)",
    "attention",
    "GELU",
    "layer norms",
    "loss (softmax cross-entropy)",
    "Adam",
    "the rest (copies, transposes, adds, fills)",
)


def _median_ms(step, steps: int) -> float:
    for _ in range(10):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def jax_class(op_name: str, kind: str) -> str:
    """The class of an XLA op from its fusion kind and its metadata's `op_name`."""
    if "adam" in op_name or not ("jvp(" in op_name or "transpose(" in op_name):
        return CLASSES[5]  # outside the model's forward and backward: the optimizer
    if "/attention/" in op_name:
        return CLASSES[1]  # the model's scope around its attention
    if "/gelu/" in op_name:
        return CLASSES[2]
    if re.search(r"/norm(1|2|_final)/", op_name):
        return CLASSES[3]
    if re.search(r"/(qkv|attn_out|mlp_in|mlp_out)/", op_name) or "attend" in op_name:
        return CLASSES[0]
    if kind.startswith(("dot", "ynn_fusion")) and "dot_general" in op_name:
        return CLASSES[0]
    if "Transformer" not in op_name:
        return CLASSES[4]  # the loss, outside the model's scope
    return CLASSES[6]


def torch_class(name: str) -> str | None:
    """The class of a PyTorch operator outside Adam's step (None: a wrapper whose
    children count)."""
    if name.startswith(("autograd::", "Optimizer.", "torch.autograd")) or name.endswith(
        "Backward0"
    ):
        return None
    if name in ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul"):
        return CLASSES[0]
    if "attention" in name:
        return CLASSES[1]
    if "gelu" in name:
        return CLASSES[2]
    if "layer_norm" in name:
        return CLASSES[3]
    if "softmax" in name or "nll_loss" in name or "cross_entropy" in name:
        return CLASSES[4]
    return CLASSES[6]


def measure_jax(steps: int, profiled: int, attention: str | None = None) -> dict:
    import jax  # noqa: PLC0415 (each side imports its framework in its own process)
    import jax.numpy as jnp  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    import optax  # noqa: PLC0415

    from lpdec.models import get_model  # noqa: PLC0415

    model = get_model(
        "transformer", num_classes=VOCAB, context=CONTEXT, d_model=D_MODEL,
        num_layers=LAYERS, num_heads=HEADS, vocab_size=VOCAB, attention_implementation=attention,
    )  # fmt: skip
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, VOCAB, (BATCH, CONTEXT + 1)), jnp.int32)
    params = model.init(jax.random.key(0), tokens[:, :-1])
    adam = optax.adam(8e-3)

    def loss(p, x):
        logits = model.apply(p, x[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, x[:, 1:]).mean()

    @jax.jit
    def step(p, s, x):
        value, grads = jax.value_and_grad(loss)(p, x)
        with jax.named_scope("adam"):
            updates, s = adam.update(grads, s, p)
            return optax.apply_updates(p, updates), s, value

    state = [params, adam.init(params)]

    def run():
        state[0], state[1], value = step(state[0], state[1], tokens)
        value.block_until_ready()

    ms = _median_ms(run, steps)
    hlo = step.lower(state[0], state[1], tokens).compile().as_text()
    names = {}
    for line in hlo.splitlines():
        found = re.match(r"\s*%?([\w.\-]+) = \S+ .*?op_name=\"([^\"]+)\"", line)
        if found:
            names[found.group(1)] = found.group(2)
    by_class: collections.Counter = collections.Counter()
    with tempfile.TemporaryDirectory() as trace:
        with jax.profiler.trace(trace, create_perfetto_trace=True):
            for _ in range(profiled):
                run()
        path = sorted(glob.glob(f"{trace}/**/*.trace.json.gz", recursive=True))[-1]
        events = json.load(gzip.open(path))
    events = events["traceEvents"] if isinstance(events, dict) else events
    for event in events:
        name = event.get("name", "")
        if event.get("ph") != "X" or name not in names:
            continue
        kind = re.sub(r"\.\d+$", "", name)
        by_class[jax_class(names[name], kind)] += event["dur"] / 1e3 / profiled
    return {"step_ms": ms, "classes": dict(by_class), "version": f"jax {jax.__version__}"}


def measure_torch(steps: int, profiled: int) -> dict:
    import numpy as np  # noqa: PLC0415
    import torch  # noqa: PLC0415
    from torch.nn import functional  # noqa: PLC0415

    sys.path.insert(0, str(ROOT / "bench"))
    from ddp_lm import Transformer  # noqa: PLC0415

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Transformer(vocab=VOCAB, context=CONTEXT, d=D_MODEL, layers=LAYERS, heads=HEADS)
    optimizer = torch.optim.Adam(model.parameters(), 8e-3)
    rng = np.random.default_rng(0)
    tokens = torch.from_numpy(rng.integers(0, VOCAB, (BATCH, CONTEXT + 1))).long()

    def run():
        optimizer.zero_grad()
        logits = model(tokens[:, :-1])
        functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).backward()
        optimizer.step()

    ms = _median_ms(run, steps)
    by_class: collections.Counter = collections.Counter()
    with torch.profiler.profile() as profile:
        for _ in range(profiled):
            run()
    for event in profile.events():
        parent, in_adam = event, False
        while parent is not None and not in_adam:
            in_adam = parent.name.startswith("Optimizer.step")
            parent = parent.cpu_parent
        cls = CLASSES[5] if in_adam else torch_class(event.name)
        if cls is not None:
            by_class[cls] += event.self_cpu_time_total / 1e3 / profiled
    return {"step_ms": ms, "classes": dict(by_class), "version": f"torch {torch.__version__}"}


def _side(which: str, steps: int, profiled: int, attention: str | None = None) -> dict:
    """Runs one side in its own process on core 0 with one thread; its JSON result."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), XLA_FLAGS=ONE_THREAD, OMP_NUM_THREADS="1")
    pin = ["taskset", "-c", "0"] if hasattr(os, "sched_setaffinity") else []
    out = subprocess.run(
        [*pin, sys.executable, "-m", "bench.step_ops", "--side", which,
         "--steps", str(steps), "--profiled", str(profiled),
         *(["--attention", attention] if attention else [])],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    if out.returncode != 0:
        raise SystemExit(f"the {which} side failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def render(xla: dict, lpdec_side: dict, torch_side: dict, steps: int) -> str:
    """The table: lpdec with XLA's attention, with its own (the CPU default), PyTorch."""
    from bench._sections import versions  # noqa: PLC0415

    sides = (xla, lpdec_side, torch_side)
    lines = [
        "## The language model's compute, op by op (`bench/step_ops.py`)",
        "",
        "configs/lm_study.py's transformer on a layout-(a) process's batch (32 windows, "
        "2,048 tokens): forward, softmax cross-entropy, backward and Adam, one process "
        "pinned to one core with one thread; lpdec with `jax.nn.dot_product_attention`'s "
        "XLA attention (`attention_implementation='xla'`, the default before issue 51) and "
        "with its own (`'lpdec'`, `causal_attention`: the CPU default). The step: the "
        f"median of {steps} steps without a profiler; the classes: each profiler's op time "
        "per step (XLA's thunks by the op each fusion is named after; PyTorch's operators, "
        f"self time). `python -m bench.step_ops`; {versions()}, {torch_side['version']}.",
        "",
        "| | lpdec, XLA's attention, ms | lpdec, its attention, ms | PyTorch, ms | "
        "lpdec / PyTorch |",
        "|---|---|---|---|---|",
    ]

    def row(label: str, values: list[float]) -> str:
        ratio = f"{values[1] / values[2]:.2f}x" if values[2] else "-"
        return f"| {label} | " + " | ".join(f"{v:.2f}" for v in values) + f" | {ratio} |"

    lines.append(row("the step, no profiler", [side["step_ms"] for side in sides]))
    for cls in CLASSES:
        lines.append(row(cls, [side["classes"].get(cls, 0.0) for side in sides]))
    lines.append(row("all profiled ops", [sum(side["classes"].values()) for side in sides]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--profiled", type=int, default=50)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--side", choices=("jax", "torch"), help=argparse.SUPPRESS)
    parser.add_argument("--attention", help=argparse.SUPPRESS)  # the jax side's
    args = parser.parse_args(argv)
    if args.side == "jax":
        print(json.dumps(measure_jax(args.steps, args.profiled, args.attention)))
        return
    if args.side == "torch":
        print(json.dumps(measure_torch(args.steps, args.profiled)))
        return
    xla = _side("jax", args.steps, args.profiled, "xla")
    lpdec_side = _side("jax", args.steps, args.profiled, "lpdec")
    torch_side = _side("torch", args.steps, args.profiled)
    body = render(xla, lpdec_side, torch_side, args.steps)
    print(body)
    if not args.no_write:
        from bench._sections import BENCHMARKS_HEADER  # noqa: PLC0415
        from bench._sections import replace_section  # noqa: PLC0415

        replace_section(ROOT / "BENCHMARKS.md", "bench/step_ops.py", body,
                        header=BENCHMARKS_HEADER)  # fmt: skip


if __name__ == "__main__":
    main()
