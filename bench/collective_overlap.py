"""Can XLA:CPU hide a cross-process all-reduce behind compute? jax against torch (issue 51).

    python -m bench.collective_overlap             # ~2 min on 2 idle cores; BENCHMARKS.md
    python -m bench.collective_overlap --no-write  # print only

The minimal program behind BENCHMARKS.md's "The step across processes, like for
like": lpdec's 2-process all-reduce step on the language model is 1.09x PyTorch DDP's
while the same step without the exchange is 1.00x, because DDP runs its gradient
buckets' all-reduces while the backward pass still computes and XLA:CPU cannot.

Two processes on loopback, each pinned to a core of its own (`taskset`), gloo on both
sides, one step timed three ways, each the median over `--repeats` steps after warm-up:

- comp: a chain of 8 `tanh(x @ w)` on an N x N float32 matrix (the backward pass's
  stand-in), no collective;
- comm: the all-reduce (a sum over the 2 processes) of `--elements` float32 (482 KB:
  the language model's gradient; more: a larger model's);
- both: the two in one step with no data between them. jax: one jitted program under
  `jax.shard_map`, the `psum` independent of the chain, so the runtime is free to run
  them at once; torch: `all_reduce(..., async_op=True)`, the chain, then `wait()`, as
  DDP does with a bucket.

Hidden = (comp + comm - both) / comm: 1 when the all-reduce costs nothing beside the
compute, 0 when the two run one after the other. jax runs with one thread (XLA's eigen
pool off, `intra_op_parallelism_threads=1`, as bench/step_parity.py runs lpdec) and
with two threads on the same core (the eigen pool on, the concurrency-optimized
scheduler): the thunk executor could then run the collective beside the chain.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
JAX_SETTINGS = {
    "one thread": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1",
    "two threads, concurrency scheduler": (
        "--xla_cpu_multi_thread_eigen=true --xla_cpu_enable_concurrency_optimized_scheduler=true"
        " intra_op_parallelism_threads=2"
    ),
}
MODES = ("comp", "comm", "both")
CHAIN = 8


def _jax_worker(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{args.port}", 2, args.rank)
    mesh = Mesh(np.array(jax.devices()), ("p",))

    def step(w, x, y):
        z = x
        if args.mode != "comm":
            for _ in range(CHAIN):
                z = jnp.tanh(z @ w)
        if args.mode != "comp":
            y = jax.lax.psum(y, "p")
        return z, y

    spec = (P(), P("p"), P("p"))
    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=spec, out_specs=(P("p"), P("p"))))
    rng = np.random.default_rng(args.rank)
    n = args.n
    w = jax.make_array_from_process_local_data(
        NamedSharding(mesh, P()),
        np.random.default_rng(0).standard_normal((n, n), np.float32) / np.sqrt(n),
    )  # fmt: skip
    local = NamedSharding(mesh, P("p"))
    x = jax.make_array_from_process_local_data(local, rng.standard_normal((n, n), np.float32))
    y = jax.make_array_from_process_local_data(
        local, np.full(args.elements, args.rank + 1.0, np.float32)
    )
    out = jax.block_until_ready(f(w, x, y))
    if args.mode != "comp":  # 1 + 2 on every element: the sum crossed the processes
        assert float(np.asarray(out[1].addressable_data(0)).min()) == 3.0
    times = []
    for _ in range(args.warmup + args.repeats):
        started = time.perf_counter()
        jax.block_until_ready(f(w, x, y))
        times.append(time.perf_counter() - started)
    jax.distributed.shutdown()
    return {"seconds": statistics.median(times[args.warmup :])}


def _torch_worker(args) -> dict:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank, world_size=2
    )
    n = args.n
    w = torch.randn(n, n, generator=torch.Generator().manual_seed(0)) / n**0.5
    x = torch.randn(n, n, generator=torch.Generator().manual_seed(args.rank))
    y = torch.full((args.elements,), args.rank + 1.0)

    def step():
        work = dist.all_reduce(y, async_op=True) if args.mode != "comp" else None
        z = x
        if args.mode != "comm":
            for _ in range(CHAIN):
                z = torch.tanh(z @ w)
        if work is not None:
            work.wait()

    step()
    if args.mode != "comp":
        assert float(y.min()) == 3.0
    times = []
    for _ in range(args.warmup + args.repeats):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    dist.destroy_process_group()
    return {"seconds": statistics.median(times[args.warmup :])}


def _pair(side: str, setting: str, mode: str, args) -> float:
    """The median step of process 0 of a pair of workers (each on its own core)."""
    from bench import harness

    port = harness.free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    if side == "jax":
        env["XLA_FLAGS"] = JAX_SETTINGS[setting]
    cores = os.cpu_count() or 1
    procs, outs = [], []
    for rank in range(2):
        out = pathlib.Path(args.workdir) / f"{side}_{rank}.json"
        out.unlink(missing_ok=True)
        outs.append(out)
        command = [
            "taskset", "-c", str(rank % cores), sys.executable, "-m", "bench.collective_overlap",
            "--worker", side, "--rank", str(rank), "--port", str(port), "--mode", mode,
            "--n", str(args.n), "--elements", str(args.elements),
            "--repeats", str(args.repeats), "--warmup", str(args.warmup), "--out", str(out),
        ]  # fmt: skip
        procs.append(
            subprocess.Popen(
                command,
                env=env,
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )  # fmt: skip
        )
    if not harness.wait_all(procs, timeout=300) or any(p.returncode for p in procs):
        errors = b"".join(p.stderr.read() for p in procs if p.stderr).decode(errors="replace")
        raise SystemExit(f"{side} {setting} {mode}: a worker failed\n{errors[-2000:]}")
    return max(json.loads(o.read_text())["seconds"] for o in outs)


def hidden(comp: float, comm: float, both: float) -> float:
    """The share of the all-reduce's time that running beside the compute hid."""
    if comm <= 0:
        raise ValueError(f"the all-reduce took {comm} s: nothing to hide")
    return (comp + comm - both) / comm


def measure(args) -> list[dict]:
    sides = [("jax", setting) for setting in JAX_SETTINGS]
    try:
        import torch  # noqa: F401

        if args.torch:
            sides.append(("torch", "one thread, async all_reduce"))
    except ImportError:
        print("torch is not installed: jax's rows only", file=sys.stderr)
    rows = []
    for side, setting in sides:
        seconds = {mode: _pair(side, setting, mode, args) for mode in MODES}
        share = hidden(seconds["comp"], seconds["comm"], seconds["both"])
        rows.append({"side": side, "setting": setting, **seconds, "hidden": share})
        print(rows[-1], flush=True)
    return rows


def render(rows: list[dict], args) -> str:
    from bench._sections import versions

    lines = [
        "## Can XLA:CPU hide a cross-process all-reduce behind compute? "
        "(`bench/collective_overlap.py`)",
        "",
        f"`python -m bench.collective_overlap --elements {args.elements} --n {args.n}`; "
        f"{versions()}, {os.cpu_count()} cores. 2 processes on loopback, each pinned to a "
        f"core, gloo on both sides. comp: {CHAIN} x `tanh(x @ w)` on {args.n} x {args.n} "
        f"float32; comm: the sum over the processes of {args.elements:,} float32 "
        f"({4 * args.elements / 1e3:,.0f} KB); both: the two in one step with no data "
        "between them (jax: one program, the `psum` independent of the chain; torch: "
        "`all_reduce(async_op=True)`, the chain, `wait()`, as DDP with a bucket). Median "
        f"ms a step over {args.repeats} steps, the slower process's. Hidden = (comp + comm "
        "- both) / comm: 1, the all-reduce free beside the compute; 0, one after the other.",
        "",
        "| side | threads | comp | comm | both | hidden |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['side']} | {r['setting']} | {1e3 * r['comp']:.2f} | {1e3 * r['comm']:.2f} "
            f"| {1e3 * r['both']:.2f} | {r['hidden']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--elements", type=int, default=120_576, help="float32 all-reduced")
    parser.add_argument("--n", type=int, default=400, help="the chain's matrices are n x n")
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--workdir", default="/tmp/lpdec_bench_collective_overlap")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--no-torch", dest="torch", action="store_false", help="jax's rows only")
    parser.add_argument("--worker", choices=("jax", "torch"), help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        result = (_jax_worker if args.worker == "jax" else _torch_worker)(args)
        pathlib.Path(args.out).write_text(json.dumps(result))
        return
    os.makedirs(args.workdir, exist_ok=True)
    body = render(measure(args), args)
    print(body)
    if not args.no_write:
        from bench._sections import BENCHMARKS_HEADER
        from bench._sections import replace_section

        replace_section(
            ROOT / "BENCHMARKS.md", "bench/collective_overlap.py", body, header=BENCHMARKS_HEADER
        )


if __name__ == "__main__":
    main()
