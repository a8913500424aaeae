"""Is an exchange hidden behind compute when it is dispatched as its own program? (issue 12, pt 3)

    python -m bench.overlap --rate 100mbit --devices 2 --repeats 5   # BENCHMARKS.md section
    python -m bench.overlap --output /tmp/overlap.md                 # anywhere else
    python -m bench.overlap --cleanup        # removes namespaces left by a killed run

`lpdec.diloco(..., overlap=True)` applies each round's outer update one round
late, so the exchange could in principle run while the next H inner steps
compute. Inside one XLA program it cannot (the collective blocks the step it
sits in). This experiment asks whether it can when the exchange is a program
of its own: two processes, each in its own network namespace
(`bench/netns.py`, a veth pair shaped with htb at each end), each with
`--devices` CPU devices and gloo collectives, build a mesh
`("process", "device")` over all devices and two jitted programs that share
no data:

* `exchange(x)`: `psum` over "process" of `--elements` float32 per device
  (under `jax.shard_map`), what a pseudo-gradient all-reduce sends;
* `inner(params, batch, steps)`: `steps` SGD steps of a two-layer MLP on
  every device, no collectives. `steps` (H) is calibrated on each link so that
  H steps take about as long as the exchange there (process 0 decides, every
  process runs the same H).

Two layouts: `shared`, both programs on all devices of the mesh; `split`,
the exchange alone on each process's last device (carrying the payload of
all k devices, so the same bytes cross the link) and inner on the other
k - 1 (needs `--devices` >= 2).

After warm-up, each repetition times, from dispatch until every result is
ready (`block_until_ready`), with a barrier (a tiny psum) before each:
T_exchange alone, T_inner alone, and both together in three ways: both
dispatched from the main thread, exchange first (`async`); the exchange
called from a `threading.Thread` while the main thread runs inner
(`thread`); both from the main thread, inner first (`async, inner first`).
Overlap efficiency = (T_inner + T_exchange - T_both) / min(T_inner,
T_exchange): 1 when the shorter one is fully hidden, 0 when they run one
after the other. Reported: medians over `--repeats` of the slower process's
time in each repetition (a synchronous step waits for it; in the `thread`
mode the two processes may start the programs in different orders, and the
one that runs inner first receives its peer's bytes into its socket buffers
meanwhile, so its own time alone would flatter), whether every exchange
result (on both processes) equals the sum computed independently with numpy,
and how long the call `exchange(x)` took to return in the `async` mode (near
zero when dispatch is asynchronous).

Every run is bounded by `--timeout`; the namespaces (prefix
`lpdecov-<pid>` by default, so they never collide with `bench/link.py`'s
`lpdec-<pid>`) are removed on exit, on SIGINT/SIGTERM/SIGHUP and at
interpreter exit.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from bench import _sections
from bench import harness
from bench import netns

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTION = "bench/overlap.py"
PROCESSES = 2
FIRST_PORT = 24567
UNSHAPED = "unshaped"
#: The measured quantities, in table order: (key, what it is).
MODES = {
    "exchange": "exchange alone",
    "inner": "inner alone",
    "async": "both, main thread, exchange first",
    "thread": "both, exchange in a thread",
    "async_inner_first": "both, main thread, inner first",
}
BOTH = ("async", "thread", "async_inner_first")


def efficiency(t_inner: float, t_exchange: float, t_both: float) -> float:
    """(T_inner + T_exchange - T_both) / min(T_inner, T_exchange): 1 hidden, 0 serialized."""
    shorter = min(t_inner, t_exchange)
    if shorter <= 0:
        raise ValueError(f"efficiency: times must be positive, got {t_inner=}, {t_exchange=}")
    return (t_inner + t_exchange - t_both) / shorter


def expected_sum(process_count: int, device: int, elements: int):
    """The exchange's result on device `device` of any process, computed with numpy alone."""
    return sum(_payload(p, device, elements) for p in range(process_count))


def _payload(process: int, device: int, elements: int):
    """What device `device` of process `process` contributes: small integers, exact in float32."""
    import numpy as np

    return (np.arange(elements) % 13 + 16 * process + 3 * device).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# The worker: one process of the pair, inside its namespace.


def _worker(args) -> int:
    import jax
    import numpy as np

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=args.coordinator,
        num_processes=PROCESSES,
        process_id=args.process_id,
    )
    k = jax.local_device_count()
    devices = np.array(jax.devices()).reshape(PROCESSES, k)
    if any(d.process_index != p for p in range(PROCESSES) for d in devices[p]):
        raise RuntimeError("jax.devices() is not grouped by process; cannot build the mesh")
    everyone = _Programs(jax, devices, devices, 1, args)
    correct = []
    layouts = {"shared": _Programs(jax, devices, devices, args.elements, args)}
    if k > 1:
        # The exchange alone on each process's last device, with all k devices' payload;
        # inner on the other k - 1.
        layouts["split"] = _Programs(jax, devices[:, -1:], devices[:, :-1], k * args.elements, args)
    result = {"process": jax.process_index(), "devices": k, "layouts": {}}
    for name, programs in layouts.items():
        result["layouts"][name] = _measure(programs, everyone.barrier, correct, args)
    everyone.barrier()
    result["exchanges_checked"] = len(correct)
    result["correct"] = bool(correct) and all(correct)
    with open(args.result, "w") as f:
        json.dump(result, f)
    return 0


class _Programs:
    """`exchange` on the mesh `exchange_devices`, `inner` on `inner_devices`, and their inputs.

    Both device arrays are (PROCESSES, local devices); the meshes' axes are ("process",
    "device"), and every argument is sharded over both.
    """

    def __init__(self, jax, exchange_devices, inner_devices, elements: int, args):
        import jax.numpy as jnp
        import numpy as np

        self.jax, self.np = jax, np
        spec = jax.P("process", "device")
        exchange_mesh = jax.sharding.Mesh(exchange_devices, ("process", "device"))
        inner_mesh = jax.sharding.Mesh(inner_devices, ("process", "device"))
        self._exchange_mesh, self._inner_mesh = exchange_mesh, inner_mesh
        self._exchange = jax.jit(
            jax.shard_map(
                lambda v: jax.lax.psum(v, "process"),
                mesh=exchange_mesh,
                in_specs=spec,
                out_specs=spec,
            )
        )
        # Also a barrier that broadcasts process 0's integer: the sum over every device.
        self._everyone = jax.jit(
            jax.shard_map(
                lambda v: jax.lax.psum(v, ("process", "device")),
                mesh=exchange_mesh,
                in_specs=spec,
                out_specs=spec,
            )
        )

        def local_sgd(w1, w2, xb, yb, steps):
            block = lambda a: a[0, 0]  # noqa: E731  (the device's block of a shard_map input)
            xb, yb = block(xb), block(yb)

            def loss(w):
                hidden = jnp.tanh(xb @ w[0])
                return jnp.mean((hidden @ w[1] - yb) ** 2)

            def step(_, w):
                grads = jax.grad(loss)(w)
                return jax.tree.map(lambda a, g: a - 0.01 * g, w, grads)

            w = jax.lax.fori_loop(0, steps, step, (block(w1), block(w2)))
            return tuple(a[None, None] for a in w)

        self._inner = jax.jit(
            jax.shard_map(
                local_sgd,
                mesh=inner_mesh,
                in_specs=(spec, spec, spec, spec, jax.P()),
                out_specs=(spec, spec),
            )
        )
        rng = np.random.default_rng(0)
        width, batch = args.width, args.batch

        def normal(scale, rows):
            return self._global(
                inner_mesh,
                (rows, width),
                lambda p, d: rng.normal(0, scale, (rows, width)).astype(np.float32),
            )

        self._mlp = (normal(0.05, width), normal(0.05, width), normal(1, batch), normal(1, batch))
        self._x = self._global(exchange_mesh, (elements,), lambda p, d: _payload(p, d, elements))
        self._expected = {
            d: expected_sum(PROCESSES, d, elements) for d in range(exchange_devices.shape[1])
        }

    def _global(self, mesh, shape, local):
        """A (PROCESSES, devices, *shape) array on `mesh`; `local(p, d)` is device (p, d)'s."""
        return self.jax.make_array_from_callback(
            (PROCESSES, mesh.devices.shape[1], *shape),
            self.jax.NamedSharding(mesh, self.jax.P("process", "device")),
            lambda index: local(index[0].start or 0, index[1].start or 0)[None, None],
        )

    def exchange(self):
        return self._exchange(self._x)

    def inner(self, steps):
        return self._inner(*self._mlp, steps)

    def steps(self, h: int):
        """`h` as the replicated int32 that `inner` takes (no recompilation per value)."""
        return self.jax.device_put(
            self.np.int32(h), self.jax.NamedSharding(self._inner_mesh, self.jax.P())
        )

    def check(self, out) -> list[bool]:
        """Whether each local block of an exchange result is the sum numpy computes."""
        np = self.np
        return [
            bool(np.array_equal(np.asarray(s.data)[0, 0], self._expected[s.index[1].start or 0]))
            for s in out.addressable_shards
        ]

    def barrier(self, value: int = 0) -> int:
        np = self.np
        local = lambda p, d: np.array(value if (p, d) == (0, 0) else 0, np.int32)  # noqa: E731
        out = self._everyone(self._global(self._exchange_mesh, (), local))
        return int(np.asarray(out.addressable_shards[0].data).reshape(()))


def _measure(programs: _Programs, barrier, correct: list, args) -> dict:
    """Times every mode of `MODES` on one layout; appends every exchange check to `correct`."""
    block = programs.jax.block_until_ready

    def timed(fn):
        barrier()
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    def exchange_alone():
        correct.extend(programs.check(programs.exchange().block_until_ready()))

    one = programs.steps(1)
    for _ in range(2):  # warm-up: compile and run each program twice
        exchange_alone()
        block(programs.inner(one))
        barrier()
    t_exchange = statistics.median(timed(exchange_alone) for _ in range(3))
    # H such that H steps take about as long as the exchange: a probe, one refinement;
    # process 0's choice, broadcast.
    h = args.probe_steps
    for _ in range(2):
        steps = programs.steps(h)
        runs = [timed(lambda s=steps: block(programs.inner(s))) for _ in range(2)]
        h = max(1, round(h * t_exchange / statistics.median(runs)))
        h = barrier(h if programs.jax.process_index() == 0 else 0)
    steps = programs.steps(h)

    dispatch, first_ready = [], {mode: [] for mode in BOTH}

    def both_async():
        start = time.perf_counter()
        ex = programs.exchange()
        dispatch.append(time.perf_counter() - start)
        w = programs.inner(steps)
        ex.block_until_ready()
        first_ready["async"].append(time.perf_counter() - start)
        block(w)
        correct.extend(programs.check(ex))

    def both_thread():
        start = time.perf_counter()
        results = {}

        def send():
            results["ex"] = programs.exchange().block_until_ready()
            first_ready["thread"].append(time.perf_counter() - start)

        sender = threading.Thread(target=send)
        sender.start()
        block(programs.inner(steps))
        sender.join()
        correct.extend(programs.check(results["ex"]))

    def both_inner_first():
        start = time.perf_counter()
        w = programs.inner(steps)
        ex = programs.exchange()
        block(w)
        first_ready["async_inner_first"].append(time.perf_counter() - start)
        correct.extend(programs.check(ex.block_until_ready()))

    measure = {
        "exchange": exchange_alone,
        "inner": lambda: block(programs.inner(steps)),
        "async": both_async,
        "thread": both_thread,
        "async_inner_first": both_inner_first,
    }
    times = {mode: [] for mode in measure}
    for _ in range(args.repeats):  # interleaved, so that drift hits every mode alike
        for mode, fn in measure.items():
            times[mode].append(timed(fn))
    return {"h": h, "times": times, "dispatch_s": dispatch, "first_ready_s": first_ready}


# ---------------------------------------------------------------------------------------------
# The driver: namespaces, one pair of workers per link, the table.


class RunFailed(RuntimeError):
    """A worker exited with an error or ran past its time limit."""


def subnets_in_use() -> set[int]:
    """Third octets of the 10.77.x.y addresses of every existing namespace."""
    used = set()
    for name in netns.namespaces(""):
        out = subprocess.run(
            ["ip", "-n", name, "-o", "-4", "addr", "show"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        used.update(int(x) for x in re.findall(r"10\.77\.(\d+)\.\d+", out))
    return used


def free_subnet(start: int) -> int:
    """The first third octet from `start` on (mod 256) that no namespace uses yet."""
    used = subnets_in_use()
    for offset in range(256):
        candidate = (start + offset) % 256
        if candidate not in used:
            return candidate
    raise RuntimeError("every 10.77.x.0/24 subnet is taken by some namespace")


def run_pair(network, args, port: int, workdir: str, label: str) -> list[dict]:
    """Both workers on `network`; their result dicts, process 0's first."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    env["PYTHONPATH"] = ROOT
    procs, paths = [], []
    for host in range(PROCESSES):
        paths.append(os.path.join(workdir, f"{label}-process{host}.json"))
        command = network.exec_prefix(host) + [
            sys.executable, "-m", "bench.overlap", "--worker",
            f"--coordinator={network.address(0)}:{port}", f"--process-id={host}",
            f"--result={paths[-1]}", f"--elements={args.elements}", f"--width={args.width}",
            f"--batch={args.batch}", f"--repeats={args.repeats}",
            f"--probe-steps={args.probe_steps}",
        ]  # fmt: skip
        log = os.path.join(workdir, f"{label}-process{host}.log")
        procs.append(harness.start(command, log, env))
        netns.CHILDREN.append(procs[-1])
    try:
        ended = harness.wait_all(procs, args.timeout)
    finally:
        for proc in procs:
            netns.CHILDREN.remove(proc)
    if not ended:
        raise RunFailed(f"{label}: ran past --timeout={args.timeout} s")
    for host, proc in enumerate(procs):
        if proc.returncode:
            with open(os.path.join(workdir, f"{label}-process{host}.log")) as f:
                tail = [line.strip() for line in f.read().splitlines() if line.strip()]
            raise RunFailed(f"{label}: process {host} exited with {proc.returncode}: {tail[-1:]}")
    results = []
    for path in paths:
        with open(path) as f:
            results.append(json.load(f))
    return results


def slowest(workers: list[dict], layout: str, key: str) -> dict[str, list[float]]:
    """Per mode and repetition, the largest of the processes' times (a synchronous step waits
    for the slower process; the processes' repetitions are aligned by the barrier)."""
    per_process = [w["layouts"][layout][key] for w in workers]
    return {
        mode: [max(ts) for ts in zip(*(p[mode] for p in per_process), strict=True)]
        for mode in per_process[0]
    }


def summarize(workers: list[dict]) -> dict:
    """Medians and efficiencies per layout, and correctness over both processes."""
    layouts = {}
    for name, at in workers[0]["layouts"].items():
        medians = {m: statistics.median(ts) for m, ts in slowest(workers, name, "times").items()}
        first = slowest(workers, name, "first_ready_s")
        layouts[name] = {
            "h": at["h"],
            "medians": medians,
            "first_ready_s": {m: statistics.median(ts) for m, ts in first.items()},
            "efficiency": {
                m: efficiency(medians["inner"], medians["exchange"], medians[m]) for m in BOTH
            },
            "dispatch_s": max(statistics.median(w["layouts"][name]["dispatch_s"]) for w in workers),
        }
    return {
        "layouts": layouts,
        "correct": all(w["correct"] for w in workers),
        "exchanges_checked": sum(w["exchanges_checked"] for w in workers),
    }


def table(summaries: dict) -> str:
    lines = [
        "| link | layout | H | T_exchange | T_inner | mode | T_both | first dispatched ready "
        "| overlap efficiency | sums correct |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rate, summary in summaries.items():
        correct = f"{'yes' if summary['correct'] else 'NO'} ({summary['exchanges_checked']})"
        for layout, s in summary["layouts"].items():
            m = s["medians"]
            for mode in BOTH:
                lines.append(
                    f"| {rate} | {layout} | {s['h']} | {m['exchange']:.3f} s | {m['inner']:.3f} s "
                    f"| {MODES[mode]} | {m[mode]:.3f} s | {s['first_ready_s'][mode]:.3f} s "
                    f"| {s['efficiency'][mode]:.2f} | {correct} |"
                )
    return "\n".join(lines)


def verdict(value: float) -> str:
    if value >= 0.7:
        return "hidden"
    if value >= 0.3:
        return "partly hidden"
    return "serialized"


def finding(summaries: dict) -> str:
    """One paragraph read off the numbers: where the exchange was hidden, and where not."""
    parts = []
    for rate, summary in summaries.items():
        for layout, s in summary["layouts"].items():
            effs = ", ".join(
                f"{MODES[m]} {s['efficiency'][m]:.2f} ({verdict(s['efficiency'][m])})" for m in BOTH
            )
            parts.append(f"{rate}, {layout}: {effs}")
    dispatch = max(s["dispatch_s"] for x in summaries.values() for s in x["layouts"].values())
    return (
        "Overlap efficiency: "
        + "; ".join(parts)
        + f". Dispatch is asynchronous (the `exchange(x)` call returned within "
        f"{dispatch * 1e3:.1f} ms), so whatever serializes the two programs happens in the "
        "runtime, not in Python. " + WHY
    )


#: Why, from XLA's PJRT CPU client (xla/pjrt/cpu/cpu_client.cc, `ExecuteHelper`/`Execute`).
WHY = (
    "The PJRT CPU client orders executions: a program that spans several local devices is "
    "gang-scheduled behind the previous such program (one at a time, in dispatch order), and "
    "a single-device program waits for the last program enqueued on that device. "
    "Two programs on the same devices therefore run one after the other whatever thread "
    "dispatches them; only programs on disjoint local devices can run concurrently, which is "
    "what the `split` layout (the exchange alone on a device of its own) tests. On the "
    "unshaped veth the exchange takes tens of milliseconds and waits on no link: gloo and the "
    "kernel copy the bytes on the same CPU cores that run the inner steps, so what running "
    "concurrently hides there depends on idle cores, and those numbers are noisy."
)


def section(summaries: dict, args, command: str) -> str:
    machine = f"{platform.machine()}, {os.cpu_count()} CPU cores shared by every process"
    return "\n".join(
        [
            "## Does a separately dispatched exchange overlap with compute? (`bench/overlap.py`)",
            "",
            f"`{command}`",
            "",
            f"Measured {datetime.date.today().isoformat()} on {machine}; {_sections.versions()}.",
            "",
            f"{PROCESSES} processes x {args.devices} CPU devices (gloo), each process in its own "
            "network namespace on a veth link shaped with htb at each end. `exchange`: psum "
            f"over the processes of {args.elements:,} float32 per device, "
            f"{args.elements * 4 * args.devices / 1e6:.1f} MB per process; `inner`: H SGD steps "
            f"of a {args.width}-wide two-layer MLP (batch {args.batch}) on every device, no "
            "collectives, H calibrated per link and layout so that it takes about as long as "
            "the exchange. Layouts: `shared`, both programs on all devices; `split`, the "
            "exchange on each process's last device (carrying all devices' payload, so the "
            "same bytes), inner on the others. Times from dispatch until every result is "
            "ready on both processes (the slower one's time), medians of "
            f"{args.repeats} interleaved repetitions; first "
            "dispatched ready: when the result of the program dispatched first was ready. "
            "Overlap efficiency = (T_inner + T_exchange - T_both) / min(T_inner, T_exchange): "
            "1 = the shorter one fully hidden, 0 = one after the other. Sums correct: every "
            "exchange result on both processes equals the sum computed with numpy (device "
            "results checked).",
            "",
            table(summaries),
            "",
            finding(summaries),
        ]
    )


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--rate", default="100mbit", help="tc rates besides the unshaped link, comma-separated"
    )
    parser.add_argument("--devices", type=int, default=2, help="CPU devices per process")
    parser.add_argument("--repeats", type=int, default=5, help="timed repetitions per mode")
    parser.add_argument("--elements", type=int, default=1_100_000, help="float32 per device")
    parser.add_argument("--width", type=int, default=256, help="the MLP's width")
    parser.add_argument("--batch", type=int, default=128, help="the MLP's batch per device")
    parser.add_argument("--probe-steps", type=int, default=10, help="inner steps to calibrate H")
    parser.add_argument("--timeout", type=float, default=180, help="seconds per pair of workers")
    parser.add_argument("--output", default=os.path.join(ROOT, "BENCHMARKS.md"))
    parser.add_argument("--results", help="JSON of every number (default: in a temporary dir)")
    parser.add_argument(
        "--prefix", help="namespace name prefix (default lpdecov-<pid>; for --cleanup, lpdecov-)"
    )
    parser.add_argument(
        "--subnet", type=int, help="third octet of 10.77.x.0/24 (default: one no namespace uses)"
    )
    parser.add_argument(
        "--cleanup", action="store_true", help="only remove namespaces starting with --prefix"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--coordinator", help=argparse.SUPPRESS)
    parser.add_argument("--process-id", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.rates = [r for r in args.rate.split(",") if r and r != UNSHAPED]
    for name in ("devices", "repeats", "elements", "width", "batch", "probe_steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)}: expected >= 1")
    if args.timeout <= 0:
        parser.error(f"--timeout={args.timeout}: expected a positive number of seconds")
    if args.subnet is not None and not 0 <= args.subnet <= 255:
        parser.error(f"--subnet={args.subnet}: expected 0..255")
    args.output = os.path.abspath(args.output)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return _worker(args)
    if args.cleanup:
        removed = netns.cleanup(args.prefix or "lpdecov-")
        print(f"removed {len(removed)} namespaces: {' '.join(removed)}")
        return 0
    reason = netns.unavailable()
    if reason:
        print(f"error: cannot make network namespaces: {reason}", file=sys.stderr)
        return 2
    command = "python -m bench.overlap " + " ".join(sys.argv[1:] if argv is None else argv)
    prefix = args.prefix or f"lpdecov-{os.getpid()}"
    workdir = tempfile.mkdtemp(prefix="lpdec_overlap_")
    netns.install_cleanup()
    summaries, raw = {}, {}
    try:
        # Far from bench/link.py's pid % 256 and clear of every subnet already in use.
        subnet = args.subnet if args.subnet is not None else free_subnet(os.getpid() % 256 + 128)
        network = netns.Network(PROCESSES, prefix, subnet)
        netns.NETWORKS.append(network)
        network.create()
        print(f"namespaces {' '.join(network.names)} on 10.77.{subnet}.0/24", flush=True)
        for i, rate in enumerate([None] + args.rates):
            network.shape(rate)
            key = rate or UNSHAPED
            raw[key] = run_pair(network, args, FIRST_PORT + i, workdir, key)
            summaries[key] = summarize(raw[key])
            print(key, json.dumps(summaries[key]), flush=True)
    except netns.Interrupted as signame:
        print(f"interrupted by {signame}: removing namespaces", file=sys.stderr, flush=True)
        netns.teardown()
        return 130
    except RunFailed as error:
        print(f"error: {error} (logs in {workdir})", file=sys.stderr)
        return 1
    finally:
        netns.teardown()
    results_path = args.results or os.path.join(workdir, "overlap_results.json")
    with open(results_path, "w") as f:
        json.dump({"args": vars(args), "summaries": summaries, "workers": raw}, f, indent=2)
    body = section(summaries, args, command)
    _sections.replace_section(args.output, SECTION, body, header=_sections.BENCHMARKS_HEADER)
    print(body)
    print(f"results: {results_path}; section: {args.output}")
    wrong = [rate for rate, summary in summaries.items() if not summary["correct"]]
    if wrong:
        print(f"error: exchange results differ from the expected sums on {wrong}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
