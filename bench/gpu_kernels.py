"""Encode throughput on an accelerator, as a fraction of the device's copy bandwidth.

Issue 26's measurement, repeatable: on the default jax device, each candidate is
jitted, warmed up, and timed (median of `--repeats` calls, each synchronised):

* ``copy``: ``x + 1`` on a float32 array (4 B read + 4 B written per element),
  the device's bandwidth yardstick;
* single arrays, 8- and 4-bit min-max encode (the public API) at power-of-two and
  ragged sizes; bytes moved: 4 in + bits / 8 out per element;
* whole trees (GPT-2-small-shaped: byte vocabulary, d_model, 4 * d_model MLP, one
  bias per matrix) through `lpdec.compress.encode_tree`, 8- and 4-bit, in both
  tree layouts: ``tree_layout="packed"`` (one flat kernel over the leaves padded
  to whole chunks in one buffer; first, as it compiles fastest, and checked bit
  for bit against the default layout on the device) and the default one-launch
  kernel with a ref per leaf; then, for 8 bits, that kernel alone, one encode per
  leaf, and concatenating the leaves first (one flat encode, not the payloads);
* error feedback: `encode_feedback` (one fused pass on GPU) against the unfused
  sum, encode and decode; bytes: 8 in + bits / 8 + 4 out;
* MXFP4 / MXFP8 encode;
* torch's per-tensor quantizer (``aminmax`` + ``quantize_per_tensor``) on the same
  device, when torch sees it;
* the backends side by side on the same [rows, 2048] array (8-bit codes, one byte
  per element, before bit packing): the Triton kernels (`minmax.quantize_pallas`,
  the dispatch's GPU choice today), the Mosaic GPU kernels (`minmax_mosaic`) and XLA's
  fusion of the jnp reference, each checked bit for bit against the reference on
  the device. This is the measurement the per-jax-version backend choice rests on;
* ``--parts tune``: the flat GPU kernels (8-bit quantize, 4-bit quantize packed in
  the same pass, 8-bit error feedback) at each grid step size (chunks per step) and
  Triton warp count, in a device-side loop: what the dispatch's block size
  (`platforms.Target.block_elements`, 4096 on GPU, and `num_warps`) should be.

Writes its section of BENCHMARKS.md (``--write``) and the raw numbers as JSON
(``--json``). On CPU, ``--quick`` runs tiny sizes as a smoke test.

Usage::

    python bench/gpu_kernels.py --write --json docs/gpu_kernels.json
    python bench/gpu_kernels.py --quick
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import lpdec  # noqa: E402
from bench import _sections  # noqa: E402
from bench import harness  # noqa: E402
from lpdec import kernels_pallas as kernels  # noqa: E402
from lpdec.kernels_pallas import minmax  # noqa: E402
from lpdec.kernels_pallas import minmax_gpu  # noqa: E402
from lpdec.kernels_pallas import minmax_mosaic  # noqa: E402
from lpdec.kernels_pallas import platforms  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
SIZES = [1 << 20, 1 << 22, 1 << 24, 1 << 26, 1 << 28, 86_017_024, 10_000_037]
QUICK_SIZES = [1 << 12, 10_037]
TREES = {
    "d=256, 4 blocks": (256, 4),
    "d=768, 12 blocks": (768, 12),
    "d=1024, 24 blocks": (1024, 24),
}
QUICK_TREES = {"d=32, 2 blocks": (32, 2)}
BACKEND_SIZES = [1 << 22, 1 << 24, 1 << 26, 86_016_000]
QUICK_BACKEND_SIZES = [1 << 13]
ROW = 2048
TUNE_SIZES = [1 << 26]
QUICK_TUNE_SIZES = [10_037]
TUNE_BLOCK_ROWS = (1, 2, 4, 8)
TUNE_WARPS = (4, 8, 16)


def gpt_tree(d_model: int, blocks: int, vocab: int = 256) -> dict:
    """Random float32 leaves shaped like a GPT-2 decoder with a byte vocabulary."""
    key = jax.random.key(0)
    shapes = {"embed": (vocab, d_model), "pos": (1024, d_model), "ln_f": (d_model,)}
    for b in range(blocks):
        shapes |= {
            f"{b}/qkv": (d_model, 3 * d_model),
            f"{b}/qkv_b": (3 * d_model,),
            f"{b}/proj": (d_model, d_model),
            f"{b}/proj_b": (d_model,),
            f"{b}/up": (d_model, 4 * d_model),
            f"{b}/up_b": (4 * d_model,),
            f"{b}/down": (4 * d_model, d_model),
            f"{b}/down_b": (d_model,),
            f"{b}/ln1": (d_model,),
            f"{b}/ln2": (d_model,),
        }
    keys = jax.random.split(key, len(shapes))
    return {
        n: jax.random.normal(k, s, jnp.float32)
        for (n, s), k in zip(shapes.items(), keys, strict=True)
    }


INNER = 10  # calls queued per synchronisation (1 with --quick)


def timed(fn, *args, repeats: int) -> float:
    """Median seconds per call of `fn(*args)` (jitted, warmed up); each sample queues
    `INNER` calls (`bench.harness.median_seconds`)."""
    return harness.median_seconds(fn, *args, repeats=repeats, inner=INNER)


def timed_loop(fn, x, repeats: int) -> float:
    """Median seconds per call of `fn(x)` run `INNER` times in one jitted device loop.

    The host dispatches once per sample, so an array whose encode takes less than
    the host's time to launch a jitted call (~40 µs) shows the device's own time,
    as it costs inside a jitted training step. The input passes an optimization
    barrier each iteration, so the compiler cannot hoist the call out of the loop,
    and each iteration's output is the loop's carry (nothing extra is read or
    written).
    """
    like = jax.eval_shape(fn, x)

    def run(x):
        def body(_, carry):
            y = jax.lax.optimization_barrier(carry[0])
            return y, fn(y)

        init = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), like)
        return jax.lax.fori_loop(0, INNER, body, (x, init))[1]

    looped = jax.jit(run)
    jax.block_until_ready(looped(x))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(looped(x))
        times.append((time.perf_counter() - start) / INNER)
    return statistics.median(times)


def torch_encode(size: int, repeats: int) -> float | None:
    """torch's per-tensor 8-bit quantizer on its default accelerator (None without one)."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    x = torch.randn(size, device="cuda")

    def run():  # scale and zero point stay tensors: no host read in our code
        lo, hi = torch.aminmax(x)
        scale = ((hi - lo) / 255).clamp_min(1e-30)
        zero = torch.round(-lo / scale).to(torch.int64)
        return torch.quantize_per_tensor(x, scale, zero, torch.quint8)

    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(INNER):
            run()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / INNER)
    return statistics.median(times)


def encode_difference(comp, a, b):
    """`encode_tree` of the tree a - b (as CHOCO encodes x - x_hat)."""
    return lpdec.compress.encode_tree(comp, jax.tree.map(jnp.subtract, a, b))


def encode_difference_per_leaf(comp, a, b):
    """One `encode` per leaf of a - b."""
    return [comp.encode(x) for x in jax.tree.leaves(jax.tree.map(jnp.subtract, a, b))]


def measure(quick: bool, repeats: int, parts=("arrays", "trees")) -> dict:
    rows = {"arrays": [], "trees": []}
    key = jax.random.key(1)
    for size in (QUICK_SIZES if quick else SIZES) if "arrays" in parts else []:
        x = jax.random.normal(key, (size,), jnp.float32)
        e = 0.01 * jax.random.normal(jax.random.key(2), (size,), jnp.float32)
        row = {"elements": size, "copy_s": timed(jax.jit(lambda x: x + 1), x, repeats=repeats)}
        # The same in a device-side loop (one dispatch per INNER calls): the copy and
        # the min-max encodes, for sizes where the host's dispatch bounds the above.
        row["copy_loop_s"] = timed_loop(lambda x: x + 1, x, repeats=repeats)
        for bits in (8, 4):
            row[f"minmax{bits}_loop_s"] = timed_loop(lpdec.minmax(bits).encode, x, repeats)
        for bits in (8, 4):
            comp = lpdec.minmax(bits)
            row[f"minmax{bits}_s"] = timed(jax.jit(comp.encode), x, repeats=repeats)
            if bits < 8:  # quantize, then pack in a second kernel (the fused pass's baseline)
                chunk = comp._layout(size)[1]
                row[f"minmax{bits}_twopass_s"] = timed(
                    jax.jit(
                        lambda x, b=bits, c=chunk: kernels.pack_bits(
                            kernels.minmax_quantize(x, bits=b, stochastic=False, chunk=c)[0],
                            bits=b,
                        )
                    ),
                    x,
                    repeats=repeats,
                )
            row[f"minmax{bits}_xla_s"] = timed(
                jax.jit(lpdec.minmax(bits, implementation="xla").encode), x, repeats=repeats
            )
            row[f"feedback{bits}_s"] = timed(
                jax.jit(lambda x, e, c=comp: c.encode_feedback(x, e)), x, e, repeats=repeats
            )

            def unfused(x, e, c=comp):
                v = x + e
                p = c.encode(v)
                return p, v - c.decode(p)

            row[f"feedback{bits}_unfused_s"] = timed(jax.jit(unfused), x, e, repeats=repeats)
        for fmt in ("fp4", "fp8"):
            row[f"mx{fmt}_s"] = timed(jax.jit(lpdec.mx(fmt).encode), x, repeats=repeats)
        row["torch_s"] = torch_encode(size, repeats)
        rows["arrays"].append(row)
        print(json.dumps(row), flush=True)
    # Two passes over the trees: first what compiles in seconds (the packed layout, one
    # encode per leaf, concatenate-then-encode), then the default one-launch kernel,
    # whose compile took over 100 s for 123 leaves on an H100: a time limit that stops
    # the second pass keeps every tree's first.
    trees = {}
    for name, (d, blocks) in (QUICK_TREES if quick else TREES).items() if "trees" in parts else []:
        tree = gpt_tree(d, blocks)
        leaves = jax.tree.leaves(tree)
        flat = jnp.concatenate([x.reshape(-1) for x in leaves])
        row = {
            "tree": name,
            "parameters": sum(x.size for x in leaves),
            "leaves": len(leaves),
            "copy_s": timed(jax.jit(lambda x: x + 1), flat, repeats=repeats),
        }
        del flat
        packed = {}  # bits -> the jitted packed encode, checked against the default below
        for bits in (8, 4):
            comp = lpdec.minmax(bits, tree_layout="packed")
            packed[bits] = jax.jit(lambda t, c=comp: lpdec.compress.encode_tree(c, t))
            row[f"packed{bits}_s"] = timed(packed[bits], tree, repeats=repeats)
        # A computed tree (CHOCO's x - x_hat): the packed buffer's copy fuses into the
        # subtraction that makes the tree, so 8 B in + 1 B out is the one-pass cost.
        other = jax.tree.map(lambda x: 0.5 * x, tree)

        candidates = (
            ("packed8_diff_s", encode_difference, lpdec.minmax(8, tree_layout="packed")),
            ("per_leaf8_diff_s", encode_difference_per_leaf, lpdec.minmax(8)),
        )
        for field, encode, comp in candidates:
            row[field] = timed(
                jax.jit(encode, static_argnums=0), comp, tree, other, repeats=repeats
            )
        del other
        comp = lpdec.minmax(8)
        row["per_leaf8_s"] = timed(
            jax.jit(lambda ls, c=comp: [c.encode(x) for x in ls]), leaves, repeats=repeats
        )
        row["concat8_s"] = timed(
            jax.jit(lambda ls, c=comp: c.encode(jnp.concatenate([x.reshape(-1) for x in ls]))),
            leaves,
            repeats=repeats,
        )
        rows["trees"].append(row)
        trees[name] = tree, packed
        print(json.dumps(row), flush=True)
    for row in rows["trees"]:
        tree, packed = trees.pop(row["tree"])
        for bits in (8, 4):
            default = lpdec.minmax(bits)
            encode = jax.jit(lambda t, c=default: lpdec.compress.encode_tree(c, t))
            row[f"minmax{bits}_s"] = timed(encode, tree, repeats=repeats)
            row[f"packed{bits}_exact"] = _bit_equal(packed[bits](tree), encode(tree))
        # The one-launch quantize alone (no bit packing): where the 8-bit time goes.
        leaves = jax.tree.leaves(tree)
        chunks = [lpdec.minmax(8)._layout(x.size)[1] for x in leaves]
        seeds = jnp.zeros((len(leaves), 2), jnp.uint32)
        row["leaves_kernel8_s"] = timed(
            jax.jit(
                lambda ls, s=seeds, c=chunks: kernels.minmax_quantize_leaves(
                    ls, s, bits=8, stochastic=False, chunks=c
                )
            ),
            leaves,
            repeats=repeats,
        )
        print(json.dumps(row), flush=True)
    return rows


def backend_candidates(on_gpu: bool) -> dict:
    """name -> (quantize(x2d, seeds, stochastic), dequantize(codes, lo, unit)), jitted.

    Off a GPU (``--quick``) both kernels run in their interpret modes, which checks
    this harness, not the kernels' speed.
    """
    interp = not on_gpu
    out = {
        "xla": (
            lambda x, s, st: minmax.quantize_reference(x, s, bits=8, stochastic=st),
            minmax.dequantize_reference,
        ),
        "triton": (
            lambda x, s, st: minmax.quantize_pallas(
                x, s, bits=8, stochastic=st, platform="gpu", interpret=interp
            ),
            lambda c, lo, u: minmax.dequantize_pallas(c, lo, u, platform="gpu", interpret=interp),
        ),
    }
    if minmax_mosaic.available() and (on_gpu or minmax_mosaic.interpret_available()):
        out["mosaic"] = (
            lambda x, s, st: minmax_mosaic.quantize(x, s, bits=8, stochastic=st, interpret=interp),
            lambda c, lo, u: minmax_mosaic.dequantize(c, lo, u, interpret=interp),
        )
    return out


def _bit_equal(a, b) -> bool:
    """Same shapes, dtypes and bytes, leaf by leaf (NaNs compare by their bits)."""
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return all(
        x.dtype == y.dtype
        and x.shape == y.shape
        and np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
        for x, y in pairs
    )


def measure_backends(quick: bool, repeats: int) -> list[dict]:
    """Each backend's quantize (nearest, stochastic) and dequantize: time, bit-exactness."""
    on_gpu = jax.devices()[0].platform == "gpu"
    candidates = backend_candidates(on_gpu)
    seeds = jnp.array([[0x9E3779B9, 0x7F4A7C15]], jnp.uint32)
    rows_out = []
    for size in QUICK_BACKEND_SIZES if quick else BACKEND_SIZES:
        x = jax.random.normal(jax.random.key(3), (size // ROW, ROW), jnp.float32)
        row = {"elements": x.size, "copy_s": timed(jax.jit(lambda x: x + 1), x, repeats=repeats)}
        want = {
            st: jax.jit(candidates["xla"][0], static_argnums=2)(x, seeds, st)
            for st in (False, True)
        }
        want_x = jax.jit(candidates["xla"][1])(*want[True])
        for name, (quantize, dequantize) in candidates.items():
            q = jax.jit(quantize, static_argnums=2)
            d = jax.jit(dequantize)
            try:
                for st, label in ((False, "nearest"), (True, "stochastic")):
                    row[f"{name}_{label}_s"] = timed(q, x, seeds, st, repeats=repeats)
                    row[f"{name}_{label}_exact"] = _bit_equal(q(x, seeds, st), want[st])
                row[f"{name}_dequantize_s"] = timed(d, *want[True], repeats=repeats)
                row[f"{name}_dequantize_exact"] = _bit_equal(d(*want[True]), want_x)
            except Exception as e:  # noqa: BLE001 - a backend that fails is a result
                row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows_out.append(row)
        print(json.dumps(row), flush=True)
    return rows_out


def tune_candidates(interpret: bool) -> dict:
    """name -> (bytes moved per element, chunk, fn(inputs, block_rows, warps)).

    Each candidate calls a flat GPU kernel as the dispatch does for the default
    chunk of its width, with the block size and warp count given.
    """

    def target(warps):
        return platforms.Target("gpu", interpret=interpret, num_warps=warps)

    def quantize(bits, chunk, pack):
        def run(inputs, br, warps):
            return minmax_gpu.gpu_quantize(
                inputs[0],
                jnp.zeros((1, 2), jnp.uint32),
                chunk=chunk,
                bits=bits,
                stochastic=False,
                target=target(warps),
                block_rows=br,
                pack=pack,
            )

        return run

    def feedback(inputs, br, warps):
        update, residual = inputs
        return minmax_gpu.gpu_quantize_feedback(
            update,
            residual,
            1.0,
            jnp.zeros((1, 2), jnp.uint32),
            chunk=2048,
            bits=8,
            stochastic=False,
            target=target(warps),
            block_rows=br,
        )

    return {
        "8-bit": (5, 2048, quantize(8, 2048, False)),
        "4-bit packed": (4.5, 4096, quantize(4, 4096, True)),
        "8-bit EF": (13, 2048, feedback),
    }


def measure_tune(quick: bool, repeats: int) -> list[dict]:
    """Each flat kernel's looped time per (chunks per grid step, warps), against the copy."""
    interpret = jax.devices()[0].platform != "gpu"
    rows_out = []
    for size in QUICK_TUNE_SIZES if quick else TUNE_SIZES:
        x = jax.random.normal(jax.random.key(4), (size,), jnp.float32)
        e = 0.01 * jax.random.normal(jax.random.key(5), (size,), jnp.float32)
        row = {"elements": size, "copy_s": timed_loop(lambda x: x + 1, x, repeats=repeats)}
        for name, (_, chunk, run) in tune_candidates(interpret).items():
            for br in TUNE_BLOCK_ROWS[:2] if quick else TUNE_BLOCK_ROWS:
                for warps in TUNE_WARPS[:1] if quick else TUNE_WARPS:
                    field = f"{name}|{br * chunk}|{warps}"
                    try:
                        row[field] = timed_loop(
                            lambda i, br=br, w=warps, run=run: run(i, br, w), (x, e), repeats
                        )
                    except Exception as err:  # noqa: BLE001 - a configuration that fails is a result
                        row[field + "|error"] = f"{type(err).__name__}: {str(err)[:200]}"
        rows_out.append(row)
        print(json.dumps(row), flush=True)
    return rows_out


def tune_section(rows: list[dict]) -> list[str]:
    lines = [
        "",
        "Flat kernels by grid step size (elements per step) and Triton warps, in a "
        "device-side loop; each cell against the looped copy (the dispatch today: 4096 "
        "elements, 8 warps; 8-bit and EF chunk 2048, 4-bit chunk 4096).",
        "",
        "| elements | kernel | elements per step | "
        + " | ".join(f"{w} warps" for w in TUNE_WARPS)
        + " |",
        "|---|---|---|" + "---|" * len(TUNE_WARPS),
    ]
    for r in rows:
        for name, (bpe, _, _) in tune_candidates(True).items():
            steps = sorted({int(k.split("|")[1]) for k in r if k.startswith(name + "|")})
            for step in steps:
                cells = []
                for w in TUNE_WARPS:
                    field = f"{name}|{step}|{w}"
                    if field + "|error" in r:
                        cells.append("failed")
                    else:
                        cells.append(fraction(r, field, bpe))
                lines.append(f"| {r['elements']:,} | {name} | {step} | " + " | ".join(cells) + " |")
    return lines


def backend_section(rows: list[dict]) -> list[str]:
    names = sorted({k.split("_")[0] for r in rows for k in r if k.endswith("_nearest_s")})
    lines = [
        "",
        "Backends side by side on [rows, 2048] float32 (8-bit codes unpacked, one byte per "
        "element: 5 B moved per element to quantize and dequantize). Each cell: percentage "
        "of copy bandwidth; `(!)` where the output differs from the jnp reference's bits.",
        "",
        "| elements | "
        + " | ".join(f"{n} nearest | {n} stochastic | {n} dequantize" for n in names)
        + " |",
        "|---|" + "---|" * (3 * len(names)),
    ]
    for r in rows:
        cells = []
        for n in names:
            for op in ("nearest", "stochastic", "dequantize"):
                if f"{n}_{op}_s" not in r:
                    cells.append("failed" if f"{n}_error" in r else "—")
                    continue
                mark = "" if r.get(f"{n}_{op}_exact") else " (!)"
                cells.append(fraction(r, f"{n}_{op}_s", 5) + mark)
        lines.append(f"| {r['elements']:,} | " + " | ".join(cells) + " |")
    errors = [(r["elements"], k, v) for r in rows for k, v in r.items() if k.endswith("_error")]
    lines += [f"- {n:,} elements, {k[: -len('_error')]}: {v}" for n, k, v in errors]
    return lines


def fraction(row: dict, field: str, bytes_per_element: float) -> str:
    """The candidate's bandwidth as a percentage of the copy's (8 B per element)."""
    seconds = row.get(field)
    if seconds is None:
        return "—"
    elements = row.get("elements", row.get("parameters"))
    copy = 8 * elements / row["copy_s"]
    return f"{100 * bytes_per_element * elements / seconds / copy:.0f}%"


# The tree table's timed columns: (field, bytes moved per element: 4 in + bits / 8 out).
TREE_COLUMNS = (
    ("minmax8_s", 5),
    ("minmax4_s", 4.5),
    ("packed8_s", 5),
    ("packed4_s", 4.5),
    ("leaves_kernel8_s", 5),
    ("per_leaf8_s", 5),
    ("concat8_s", 5),
    ("packed8_diff_s", 9),
    ("per_leaf8_diff_s", 9),
)


def section(results: dict, device: str) -> str:
    lines = [
        f"Device: {device}; {results.get('versions') or _sections.versions()}.",
        "Command: `python bench/gpu_kernels.py --write --json docs/gpu_kernels.json` (or "
        "`--merge` of the JSON files that `bench/gpu_session.sh` writes, one per part). "
        "Each cell: the candidate's bytes moved per second as a percentage of `x + 1`'s "
        "(4 B read + 4 B written per element) on the same array; encode moves 4 B in and "
        "bits / 8 out per element, error feedback 8 B in and 4 + bits / 8 out.",
        "",
        "| elements | copy GB/s | 8-bit | 4-bit | 4-bit two-pass | 8-bit xla | 8-bit EF fused "
        "| 8-bit EF unfused | MXFP4 | MXFP8 | torch per-tensor 8-bit |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results.get("arrays", []):
        copy = 8 * r["elements"] / r["copy_s"] / 1e9
        lines.append(
            f"| {r['elements']:,} | {copy:.0f} | {fraction(r, 'minmax8_s', 5)} | "
            f"{fraction(r, 'minmax4_s', 4.5)} | {fraction(r, 'minmax4_twopass_s', 4.5)} | "
            f"{fraction(r, 'minmax8_xla_s', 5)} | "
            f"{fraction(r, 'feedback8_s', 13)} | {fraction(r, 'feedback8_unfused_s', 13)} | "
            f"{fraction(r, 'mxfp4_s', 4.5)} | {fraction(r, 'mxfp8_s', 5)} | "
            f"{fraction(r, 'torch_s', 5)} |"
        )
    if any("copy_loop_s" in r for r in results.get("arrays", [])):
        lines += [
            "",
            "In a device-side loop (`timed_loop`: 10 calls per jitted dispatch, as inside a "
            "training step); each cell against the looped copy:",
            "",
            "| elements | looped copy GB/s | 8-bit | 4-bit |",
            "|---|---|---|---|",
        ]
        for r in results["arrays"]:
            if "copy_loop_s" not in r:
                continue
            looped = {**r, "copy_s": r["copy_loop_s"]}
            lines.append(
                f"| {r['elements']:,} | {8 * r['elements'] / r['copy_loop_s'] / 1e9:.0f} | "
                f"{fraction(looped, 'minmax8_loop_s', 5)} | "
                f"{fraction(looped, 'minmax4_loop_s', 4.5)} |"
            )
    lines += [
        "",
        "| tree | parameters | leaves | 8-bit encode_tree | 4-bit encode_tree "
        "| 8-bit packed tree | 4-bit packed tree "
        "| 8-bit quantize_leaves (no packing) | 8-bit, one encode per leaf "
        "| 8-bit, concatenate then encode | 8-bit packed, encode of a - b "
        "| 8-bit, one encode per leaf of a - b |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results.get("trees", []):
        cells = []
        for field, bytes_per_element in TREE_COLUMNS:
            if field not in r:
                cells.append("—")
                continue
            mark = "" if r.get(field[: -len("_s")] + "_exact", True) else " (!)"
            cells.append(f"{1e3 * r[field]:.2f} ms ({fraction(r, field, bytes_per_element)}){mark}")
        lines.append(
            f"| {r['tree']} | {r['parameters']:,} | {r['leaves']} | " + " | ".join(cells) + " |"
        )
    if results.get("trees"):
        lines += [
            "",
            'Packed tree: `lpdec.minmax(bits, tree_layout="packed")`, the leaves padded to '
            "whole chunks in one buffer and encoded by one flat kernel; `(!)` where its "
            "payloads differ from the default layout's bits on the device. The last two "
            "columns encode a computed tree (a - b, as CHOCO encodes x - x_hat): 8 B read "
            "and 1 B written per parameter, where the packed buffer's copy fuses into the "
            "subtraction.",
        ]
    if results.get("backends"):
        lines += backend_section(results["backends"])
    if results.get("tune"):
        lines += tune_section(results["tune"])
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a CPU smoke test)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--write", action="store_true", help="rewrite BENCHMARKS.md's section")
    parser.add_argument("--json", default=None, help="write the raw numbers here")
    parser.add_argument(
        "--parts",
        default="backends,arrays,trees",
        help="comma-separated: backends,arrays,trees,tune",
    )
    parser.add_argument(
        "--merge",
        nargs="+",
        metavar="JSON",
        help="measure nothing: the section from these runs' --json files (each part from "
        "the last file that has it), e.g. the ones bench/gpu_session.sh writes",
    )
    args = parser.parse_args(argv)
    if args.merge:
        results = merge_results([json.loads(pathlib.Path(f).read_text()) for f in args.merge])
        finish(results, args)
        return
    device = str(jax.devices()[0].device_kind)
    global INNER
    INNER = 1 if args.quick else INNER
    repeats = 3 if args.quick else args.repeats
    parts = set(args.parts.split(","))
    results = {"device": device, "versions": _sections.versions()}
    if "backends" in parts:
        results["backends"] = measure_backends(args.quick, repeats)
        if args.json:  # kept even if a later part fails
            pathlib.Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    if "tune" in parts:
        results["tune"] = measure_tune(args.quick, repeats)
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    results |= measure(args.quick, repeats, parts)
    finish(results, args)


def merge_results(runs: list[dict]) -> dict:
    """One result from several runs' JSON: each part (and the device and versions)
    from the last run that has it."""
    merged = {}
    for run in runs:
        merged |= {k: v for k, v in run.items() if v}
    return merged


def finish(results: dict, args) -> None:
    """Prints the section; writes the JSON (`--json`) and BENCHMARKS.md's section (`--write`)."""
    text = section(results, results.get("device", "unknown"))
    print(text)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    if args.write:
        _sections.replace_section(
            ROOT / "BENCHMARKS.md",
            "bench/gpu_kernels.py",
            "## bench/gpu_kernels.py: encode against copy bandwidth\n\n" + text,
            header=_sections.BENCHMARKS_HEADER,
        )


if __name__ == "__main__":
    main()
