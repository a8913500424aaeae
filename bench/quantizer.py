"""Throughput of lpdec's 8-bit min-max quantizer on CPU, side by side with baselines.

Measures, in one process and one interleaved loop per array size:

* ``lpdec``: the public API, ``jax.jit(lpdec.minmax(bits=8).encode)`` and
  ``jax.jit(comp.decode)``, default chunk size (per-chunk min/max scales);
* ``naive JAX``: a jitted global-min/max quantizer (one scale for the array),
  the obvious way to write it in jnp;
* ``torch``: ``torch.aminmax`` + ``torch.quantize_per_tensor`` (and
  ``.dequantize()``), when torch is importable; it is never a dependency;
* ``numpy copy``: ``np.copyto`` into a preallocated buffer, a memory-bandwidth
  yardstick (no page faults from a fresh allocation).

Each round runs every candidate once, in a fresh random order, so slow drift of
a shared machine hits all of them alike and no candidate always follows the
same neighbour; the tables report medians over rounds. The lpdec/torch ratio is
the median of per-round ratios (torch time / lpdec time, so > 1 means lpdec is
faster), which pairs measurements taken moments apart.

A second measurement times lpdec's and torch's encode in separate processes,
so neither runtime's threads or caches can disturb the other: each round
starts one lpdec-only and one torch-only child (in alternating order), each
times a number of encodes after its own warm-up and reports the median; the
ratio is again the median of per-round ratios.

Usage::

    python bench/quantizer.py            # full run, rewrites its section of BENCHMARKS.md
    python bench/quantizer.py --quick    # smoke test: small sizes, prints only
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import pathlib
import platform
import subprocess
import sys
import time
import warnings

# torch's OpenMP workers spin-wait after every parallel region, on the cores that
# XLA's threads need for the candidate that runs next. Measured here, with XLA's
# row reduction interleaved with torch.aminmax on 64M floats: 13 GB/s by default,
# 17 GB/s with passive waiting, and torch's own speed unchanged. Passive waiting
# removes that cross-talk between the two runtimes sharing this process. It must
# be set before torch loads its OpenMP runtime; an explicit setting wins.
CALLER_OMP_WAIT_POLICY = os.environ.get("OMP_WAIT_POLICY")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import lpdec  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import _sections  # noqa: E402

try:
    import torch
except ImportError:
    torch = None

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
SECTION = "bench/quantizer.py"
HEADING = "## Min-max quantizer throughput (CPU)"
# Bytes per element that each operation must move: quantize reads a float32 and
# writes a uint8 code; dequantize reads the code and writes the float32; the
# copy reads and writes a float32.
QUANTIZE_BYTES = 4 + 1
DEQUANTIZE_BYTES = 1 + 4
COPY_BYTES = 4 + 4

FULL_SIZES = (1 << 20, 1 << 24, 1 << 26)
QUICK_SIZES = (1 << 16, 1 << 20)
# Separate processes: (sizes, rounds, encodes timed per child).
FULL_PROCESSES = ((1 << 24, 1 << 26), 7, 30)
QUICK_PROCESSES = ((1 << 20,), 2, 10)


def rounds_for(num_elements: int, quick: bool) -> int:
    """Rounds per size: enough for stable medians, the whole run under ~3 minutes."""
    if quick:
        return 5
    if num_elements <= 1 << 20:
        return 300
    if num_elements <= 1 << 24:
        return 150
    return 60


# ----------------------------------------------------------------------------
# Candidates. Each factory returns {name: thunk}; a thunk runs the operation once
# and returns only when its result is ready.
# ----------------------------------------------------------------------------


@jax.jit
def naive_encode(x):
    """Global min-max 8-bit quantizer: one (lo, unit) for the whole array."""
    lo = jnp.min(x)
    hi = jnp.max(x)
    unit = (hi - lo) / 255.0
    codes = jnp.clip(jnp.round((x - lo) / unit), 0, 255).astype(jnp.uint8)
    return codes, lo, unit


@jax.jit
def naive_decode(codes, lo, unit):
    return lo + codes.astype(jnp.float32) * unit


def jax_candidates(x: jax.Array) -> dict:
    comp = lpdec.minmax(bits=8)
    encode = jax.jit(comp.encode)
    decode = jax.jit(comp.decode)
    payload = jax.block_until_ready(encode(x))
    naive_payload = jax.block_until_ready(naive_encode(x))
    return {
        ("quantize", "naive JAX"): lambda: jax.block_until_ready(naive_encode(x)),
        ("quantize", "lpdec"): lambda: jax.block_until_ready(encode(x)),
        ("dequantize", "naive JAX"): lambda: jax.block_until_ready(naive_decode(*naive_payload)),
        ("dequantize", "lpdec"): lambda: jax.block_until_ready(decode(payload)),
    }


def torch_quantize(x_t):
    """torch's per-tensor 8-bit quantizer: aminmax for the range, then quantize_per_tensor."""
    lo, hi = torch.aminmax(x_t)
    lo, hi = float(lo), float(hi)
    scale = max((hi - lo) / 255.0, 1e-30)
    zero_point = min(max(round(-lo / scale), 0), 255)
    return torch.quantize_per_tensor(x_t, scale, zero_point, torch.quint8)


def torch_candidates(x: jax.Array) -> dict:
    if torch is None:
        return {}
    # quantize_per_tensor is deprecated in recent torch; it is still the baseline the
    # issue names, so its warning is silenced rather than printed every call.
    warnings.filterwarnings("ignore", message=r".*quantize_per_tensor.*")
    x_t = torch.from_dlpack(x)  # zero-copy: torch reads the very buffer JAX reads

    def quantize():
        return torch_quantize(x_t)

    quantized = quantize()
    return {
        ("quantize", "torch"): quantize,
        ("dequantize", "torch"): quantized.dequantize,
    }


def copy_candidate(x: jax.Array) -> dict:
    x_np = np.asarray(x)  # zero-copy view of the JAX buffer on CPU
    out = np.empty_like(x_np)
    return {("copy", "numpy copy"): lambda: np.copyto(out, x_np)}


def check_lpdec_roundtrip(x: jax.Array) -> float:
    """Max |x - decode(encode(x))| / unit over the array; nearest rounding keeps it <= 1/2."""
    comp = lpdec.minmax(bits=8)
    x_np = np.asarray(x)
    payload = jax.jit(comp.encode)(x)
    x_hat = jax.jit(comp.decode)(payload)
    rows = comp.num_chunks(x.size)
    chunk = x.size // rows
    err = np.abs(np.asarray(x_hat) - x_np).reshape(rows, chunk).max(axis=1)
    unit = np.asarray(payload.unit)
    return float(np.max(err / np.where(unit > 0, unit, 1.0)))


# ----------------------------------------------------------------------------
# Measurement.
# ----------------------------------------------------------------------------


def measure(candidates: dict, rounds: int, seed: int) -> dict:
    """Seconds per call of each candidate, `rounds` samples each, interleaved in random order."""
    for thunk in candidates.values():  # warm-up: compile, fault in buffers, fill caches
        for _ in range(3):
            thunk()
    times = {name: [] for name in candidates}
    names = list(candidates)
    order_rng = np.random.default_rng(seed)
    gc.collect()
    gc.disable()
    try:
        for _ in range(rounds):
            for i in order_rng.permutation(len(names)):
                name = names[i]
                t0 = time.perf_counter()
                candidates[name]()
                times[name].append(time.perf_counter() - t0)
    finally:
        gc.enable()
    return {name: np.asarray(t) for name, t in times.items()}


def gbps(num_elements: int, bytes_per_element: int, seconds: float) -> float:
    return num_elements * bytes_per_element / seconds / 1e9


def size_label(num_elements: int) -> str:
    return f"{num_elements >> 20}M" if num_elements >= 1 << 20 else f"{num_elements >> 10}K"


def run(sizes, quick: bool) -> list[dict]:
    rows = []
    for size in sizes:
        # One input buffer for every candidate, so none reads memory the others do not.
        x = jax.device_put(np.random.default_rng(0).standard_normal(size, dtype=np.float32))
        bound = check_lpdec_roundtrip(x)
        if not bound <= 0.5 + 1e-3:
            raise AssertionError(f"lpdec round-trip error {bound:.4f} units exceeds 1/2")
        candidates = {**copy_candidate(x), **torch_candidates(x), **jax_candidates(x)}
        rounds = rounds_for(size, quick)
        t0 = time.perf_counter()
        times = measure(candidates, rounds, seed=size)
        print(f"{size_label(size)} elements: {rounds} rounds in {time.perf_counter() - t0:.1f} s")
        copy = float(np.median(times[("copy", "numpy copy")]))
        for op, nbytes in (("quantize", QUANTIZE_BYTES), ("dequantize", DEQUANTIZE_BYTES)):
            row = {"op": op, "size": size, "copy": copy}
            for who in ("torch", "naive JAX", "lpdec"):
                if (op, who) in times:
                    row[who] = float(np.median(times[(op, who)]))
            if (op, "torch") in times:
                paired = times[(op, "torch")] / times[(op, "lpdec")]
                row["ratio"] = float(np.median(paired))
                row["ratio_q"] = tuple(float(q) for q in np.quantile(paired, [0.25, 0.75]))
            row["bytes"] = nbytes
            rows.append(row)
    return rows


# ----------------------------------------------------------------------------
# Separate processes.
# ----------------------------------------------------------------------------


def child(who: str, num_elements: int, calls: int) -> None:
    """Times `calls` encodes by one library alone in this process; prints the median (JSON)."""
    x_np = np.random.default_rng(0).standard_normal(num_elements, dtype=np.float32)
    if who == "lpdec":
        x = jax.device_put(x_np)
        encode = jax.jit(lpdec.minmax(bits=8).encode)

        def thunk():
            jax.block_until_ready(encode(x))

    else:
        warnings.filterwarnings("ignore", message=r".*quantize_per_tensor.*")
        x_t = torch.from_numpy(x_np)

        def thunk():
            torch_quantize(x_t)

    for _ in range(3):  # warm-up: compilation, first-touch page faults
        thunk()
    times = []
    gc.collect()
    gc.disable()
    for _ in range(calls):
        t0 = time.perf_counter()
        thunk()
        times.append(time.perf_counter() - t0)
    print(json.dumps({"median": float(np.median(times))}))


def run_processes(sizes, rounds: int, calls: int) -> list[dict]:
    """Median encode time of lpdec-only and torch-only child processes, alternating."""
    if torch is None:
        return []
    env = dict(os.environ)
    if CALLER_OMP_WAIT_POLICY is None:
        # Alone in its process torch has no one to disturb: it runs with its defaults.
        env.pop("OMP_WAIT_POLICY")
    rows = []
    for size in sizes:
        times = {"lpdec": [], "torch": []}
        for r in range(rounds):
            for who in ("lpdec", "torch") if r % 2 == 0 else ("torch", "lpdec"):
                command = [sys.executable, __file__, "--child", who]
                command += ["--size", str(size), "--calls", str(calls)]
                out = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
                times[who].append(json.loads(out.stdout.splitlines()[-1])["median"])
        paired = np.asarray(times["torch"]) / np.asarray(times["lpdec"])
        row = {
            "size": size,
            "lpdec": float(np.median(times["lpdec"])),
            "torch": float(np.median(times["torch"])),
            "ratio": float(np.median(paired)),
            "ratio_range": (float(paired.min()), float(paired.max())),
        }
        print(
            f"{size_label(size)} elements, separate processes: "
            f"lpdec/torch ratios {' '.join(f'{p:.2f}' for p in paired)}"
        )
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------
# Report.
# ----------------------------------------------------------------------------


def cpu_model() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def git_revision() -> str:
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            # BENCHMARKS.md is what this script rewrites: it does not count.
            ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!BENCHMARKS.md"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        return rev + (" + uncommitted changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def environment() -> list[tuple[str, str]]:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    env = [
        ("CPU", f"{cpu_model()}, {os.cpu_count()} logical cores ({cores} usable)"),
        ("load average at start", " ".join(f"{v:.2f}" for v in os.getloadavg())),
        ("Python", platform.python_version()),
        ("jax / jaxlib", f"{jax.__version__} / {jax.lib.__version__}"),
        ("jax devices", str(jax.devices())),
        ("numpy", np.__version__),
        (
            "torch",
            f"{torch.__version__}, {torch.get_num_threads()} intra-op threads"
            if torch is not None
            else "not installed (torch columns are n/a)",
        ),
        ("OMP_WAIT_POLICY", os.environ.get("OMP_WAIT_POLICY", "")),
        ("XLA_FLAGS", os.environ.get("XLA_FLAGS", "(unset)")),
        ("lpdec", f"git {git_revision()}, default chunk_size={lpdec.minmax(bits=8).chunk_size}"),
    ]
    return env


def format_cell(seconds: float | None, num_elements: int, nbytes: int) -> str:
    if seconds is None:
        return "n/a"
    return f"{seconds * 1e3:.2f} ms ({gbps(num_elements, nbytes, seconds):.1f} GB/s)"


def format_table(rows: list[dict]) -> str:
    lines = [
        "| op | elements | numpy copy | torch | naive JAX | lpdec | lpdec vs torch |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        n, nb = row["size"], row["bytes"]
        ratio = "n/a"
        if "ratio" in row:
            q25, q75 = row["ratio_q"]
            ratio = f"**{row['ratio']:.2f}x** ({q25:.2f}-{q75:.2f})"
        lines.append(
            "| "
            + " | ".join(
                [
                    row["op"],
                    size_label(n),
                    format_cell(row["copy"], n, COPY_BYTES),
                    format_cell(row.get("torch"), n, nb),
                    format_cell(row.get("naive JAX"), n, nb),
                    format_cell(row.get("lpdec"), n, nb),
                    ratio,
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def format_process_table(rows: list[dict]) -> str:
    if not rows:
        return "torch is not installed: no separate-process measurement."
    lines = [
        "| elements | torch | lpdec | lpdec vs torch |",
        "|---:|---:|---:|---:|",
    ]
    for row in rows:
        n = row["size"]
        low, high = row["ratio_range"]
        lines.append(
            f"| {size_label(n)} | {format_cell(row['torch'], n, QUANTIZE_BYTES)} "
            f"| {format_cell(row['lpdec'], n, QUANTIZE_BYTES)} "
            f"| **{row['ratio']:.2f}x** ({low:.2f}-{high:.2f}) |"
        )
    return "\n".join(lines)


def format_targets(rows: list[dict], process_rows: list[dict]) -> str:
    """The issue's target: lpdec's encode >= 1.2x torch's at 16M and 64M, both ways of timing."""
    lines = ["| target: lpdec encode >= 1.2x torch | measured | met |", "|---|---:|---|"]
    for how, table in (("one process", rows), ("separate processes", process_rows)):
        for row in table:
            if (
                row.get("op", "quantize") == "quantize"
                and "ratio" in row
                and row["size"] >= 1 << 24
            ):
                met = "yes" if row["ratio"] >= 1.2 else "no"
                lines.append(f"| {size_label(row['size'])}, {how} | {row['ratio']:.2f}x | {met} |")
    return "\n".join(lines) + "\n\n" + WHY_NOT_FASTER


WHY_NOT_FASTER = """\
Why the encode is not faster (issue 13). XLA CPU encodes in two passes over x,
the per-chunk min/max then the codes, and runs each on both cores. Doing both
while a cache-sized block is in cache (a `fori_loop` or `lax.map` over blocks
of chunks, codes written in place; eight variants tried) measured slower with
both cores free: 9-12 ms vs 6.9 ms at 16M and 55-57 ms vs 52 ms at 64M,
because XLA runs a loop body on one thread: it splits the block's reduction
over the two threads but never the in-place codes update, which is
compute-bound (about 75 us per 2**18 elements on one thread). A single pass
on both cores would need a native kernel (an XLA FFI custom call); that is
left for later."""


def format_section(
    rows: list[dict],
    process_rows: list[dict],
    process_setup: tuple,
    env: list[tuple[str, str]],
    command: str,
    quick: bool,
) -> str:
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    env_lines = "\n".join(f"- {k}: {v}" for k, v in env)
    warning = ""
    if quick:
        warning = "\n**Quick smoke run: sizes and rounds too small to be representative.**\n"
    return f"""{HEADING}
{warning}
8-bit min-max quantization of a float32 array (`encode`) and back (`decode`),
median wall time per call and effective bandwidth. Bytes counted per element:
quantize 4 read + 1 written, dequantize 1 read + 4 written, numpy copy 4 + 4.
lpdec vs torch is torch's time over lpdec's (above 1 means lpdec is faster):
the median of per-round ratios, with the interquartile range.

- **lpdec**: `jax.jit(lpdec.minmax(bits=8).encode)` / `jax.jit(comp.decode)`, the
  public API with the default chunk size: a (lo, unit) pair per chunk.
- **naive JAX**: jitted `lo, hi = x.min(), x.max()`, then
  `clip(round((x - lo) / unit), 0, 255).astype(uint8)`; one scale per array.
- **torch**: `torch.aminmax` + `torch.quantize_per_tensor(..., torch.quint8)`, and
  `.dequantize()`; one scale per array.
- **numpy copy**: `np.copyto` into a preallocated float32 array (memory yardstick).

Candidates are interleaved in a fresh random order each round after a warm-up
(compilation, first-touch page faults); every call allocates its output except
the numpy copy. `OMP_WAIT_POLICY=PASSIVE` keeps torch's OpenMP threads from
spin-waiting on the cores XLA uses next (see the script).

{format_table(rows)}

Separate processes: each round runs an lpdec-only and a torch-only child process
(which goes first alternates), and each child times {process_setup[2]} encodes of the
same input after a warm-up and reports the median; the table gives the medians
over {process_setup[1]} rounds and the median of per-round ratios (range: min-max). The
torch child keeps OpenMP's default wait policy, which it has to itself here.

{format_process_table(process_rows)}

{format_targets(rows, process_rows)}

Command: `{command}` ({stamp}).

{env_lines}
"""


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: sizes 64K and 1M, 5 rounds; prints the table and writes "
        "nothing unless --output is given",
    )
    parser.add_argument(
        "--output",
        type=pathlib.Path,
        default=None,
        help="markdown file whose section to rewrite (default: BENCHMARKS.md at the repo root)",
    )
    parser.add_argument("--child", choices=("lpdec", "torch"), help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--calls", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.size, args.calls)
        return
    output = args.output
    if output is None and not args.quick:
        output = REPO_ROOT / "BENCHMARKS.md"

    env = environment()
    for key, value in env:
        print(f"{key}: {value}")
    t0 = time.perf_counter()
    rows = run(QUICK_SIZES if args.quick else FULL_SIZES, args.quick)
    process_setup = QUICK_PROCESSES if args.quick else FULL_PROCESSES
    process_rows = run_processes(*process_setup)
    env.insert(2, ("load average at end", " ".join(f"{v:.2f}" for v in os.getloadavg())))
    print(format_table(rows))
    print(format_process_table(process_rows))
    print(format_targets(rows, process_rows))
    print(f"total {time.perf_counter() - t0:.0f} s")
    if output is not None:
        command = "python bench/quantizer.py" + (" --quick" if args.quick else "")
        if args.output is not None:
            command += f" --output {args.output}"
        _sections.replace_section(
            output,
            SECTION,
            format_section(rows, process_rows, process_setup, env, command, args.quick),
            header=_sections.BENCHMARKS_HEADER,
        )
        print(f"wrote {output}")


if __name__ == "__main__":
    sys.exit(main())
