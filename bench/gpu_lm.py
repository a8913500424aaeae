"""The language model on one GPU: tokens per second and model FLOPs utilisation, 8 nodes.

    python -m bench.gpu_lm                 # on a GPU machine: configs/lm_gpu.py, 3 methods
    python -m bench.gpu_lm --quick         # anywhere, in seconds: a tiny model (smoke run)

`configs/lm_gpu.py` (86M parameters, context 1,024, bf16 compute with cuDNN
attention) with 8 nodes vmapped on the one device, `--steps` steps of each
method: fp32 D-PSGD on a ring, CHOCO 8-bit, DiLoCo H=50 with a 4-bit
error-feedback mean. Per method: seconds per step (median over the logged chunks
after the first, which compiles), tokens per second (all 8 nodes), and model
FLOPs utilisation = 6 N tokens/s / the device's peak (`--peak-tflops`: 989 for
an H100's dense bf16; state another for another device); and, once, the time to
encode the model's whole parameter tree at 8 and 4 bits
(`lpdec.compress.tree.encode_tree`, jitted, median of 20). Writes a section of
BENCHMARKS.md with the device and versions.
"""

from __future__ import annotations

import argparse
import csv
import importlib.metadata
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import numpy as np  # noqa: E402

import lpdec  # noqa: E402
import train_lib  # noqa: E402
from bench import _sections  # noqa: E402
from bench import harness  # noqa: E402
from configs import lm_gpu  # noqa: E402

SECTION = "bench/gpu_lm.py"
METHODS = {
    "fp32 D-PSGD (ring)": dict(algorithm="dpsgd", local_steps=1, error_feedback=False),
    "CHOCO 8-bit": dict(
        algorithm="choco", compressor="minmax", bits=8, gamma=1.0, local_steps=1,
        error_feedback=False,
    ),
    "DiLoCo H=50, 4-bit EF": dict(algorithm="diloco", bits=4),
}  # fmt: skip


def config(args, overrides):
    c = lm_gpu.get_config()
    c.num_steps, c.log_every, c.checkpoint_every = args.steps, args.log_every, 0
    if args.quick:
        c.sequence_length, c.text_bytes, c.validation_windows = 32, 200_000, 16
        c.model_kwargs.update(context=32, d_model=32, num_layers=1, num_heads=2)
        c.model_kwargs.dtype, c.model_kwargs.attention_implementation = "float32", None
        c.batch_size, c.local_steps = 2, 5
    for key, value in overrides.items():
        setattr(c, key, value)
    if c.algorithm == "diloco":
        c.local_steps = c.local_steps if args.quick else 50
    return c


def encode_time(params, bits: int, repeats: int = 20) -> float:
    encode = jax.jit(lambda t: lpdec.compress.tree.encode_tree(lpdec.minmax(bits=bits), t))
    return harness.median_seconds(encode, params, repeats=repeats)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--output", default=os.path.join(ROOT, "BENCHMARKS.md"))
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.log_every = min(args.steps, 20), min(args.log_every, 10)
    rows = []
    for label, overrides in METHODS.items():
        c = config(args, overrides)
        workdir = tempfile.mkdtemp(prefix="lpdec_gpu_lm_")
        train_lib.train_and_evaluate(c, workdir)
        with open(os.path.join(workdir, "metrics.csv")) as f:
            metrics = [{k: float(v) for k, v in r.items()} for r in csv.DictReader(f)]
        timed = metrics[1:] or metrics
        s_per_step = statistics.median(r["step_time_s"] for r in timed)
        tokens = c.num_nodes * c.batch_size * c.sequence_length / s_per_step
        parameters = lpdec.models.transformer_param_count(**dict(c.model_kwargs))
        mfu = 6 * parameters * tokens / (args.peak_tflops * 1e12)
        rows.append((label, s_per_step, tokens, mfu, metrics[-1]["val_bits_per_byte_avg_model"]))
        print(rows[-1], flush=True)
    c = config(args, {})
    model = lpdec.models.get_model("transformer", **dict(c.model_kwargs))
    tokens = np.zeros((1, c.sequence_length), np.int32)
    params = jax.jit(model.init)(jax.random.key(0), tokens)["params"]
    encodes = {bits: encode_time(params, bits) for bits in (8, 4)}
    device = jax.devices()[0]
    lines = [
        f"## The language model on one {device.device_kind} (`bench/gpu_lm.py`)"
        + (" (QUICK SMOKE RUN: not representative)" if args.quick else ""),
        "",
        f"`python -m bench.gpu_lm {' '.join(sys.argv[1:] if argv is None else argv)}`",
        "",
        f"Python {sys.version.split()[0]}, jax {jax.__version__}, jaxlib "
        f"{importlib.metadata.version('jaxlib')}, {device.device_kind}; "
        f"{parameters:,} parameters, 8 nodes vmapped on the device, "
        f"{c.batch_size} windows of {c.sequence_length} bytes per node and step, "
        f"{args.steps} steps; MFU against {args.peak_tflops:g} TFLOP/s.",
        "",
        "| method | s/step | tokens/s (8 nodes) | MFU | val bits/byte at the end |",
        "|---|---|---|---|---|",
        *(f"| {r[0]} | {r[1]:.4f} | {r[2]:,.0f} | {r[3]:.1%} | {r[4]:.3f} |" for r in rows),
        "",
        f"Encoding the whole parameter tree ({len(jax.tree.leaves(params))} leaves): "
        + ", ".join(f"{bits}-bit {t * 1e3:.2f} ms" for bits, t in encodes.items())
        + ".",
    ]
    body = "\n".join(lines)
    _sections.replace_section(args.output, SECTION, body, header=_sections.BENCHMARKS_HEADER)
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
