"""One elastic round's exchange at 3, 8 and 16 machines: the star, peer to peer, a ring.

    python -m bench.elastic_scale --torch-python /path/to/python-with-torch
    python -m bench.elastic_scale --machines 3 --settings loopback --rounds 1   # smoke run

Each machine is a process (on loopback, or each in a network namespace of its own
with its link shaped at 100 Mbit: bench/netns.py, the service in one more). Every
machine holds a vector of `--values` float32 (default 2^20: a 1M-parameter model's
pseudo-gradient) and, after a barrier, runs one round of the exchange; the round's
time is the slowest machine's, the median over `--rounds` rounds after a warm-up:

- **star**: today's elastic exchange (`ElasticGroup.exchange`): the 4-bit min-max
  payload of the whole vector goes through the coordinating service's key-value
  store; every machine decodes every payload and averages.
- **p2p**: the service decides the round's members (`ElasticGroup.decide`: the
  signed headers, with each member's address, and the decision) and the bytes go
  directly between them
  (`lpdec.elastic.peers.reduce_scatter_gather`): each member's 4-bit part of
  each chunk to the chunk's owner, who decodes, averages and encodes the mean
  chunk at 4 bits and sends it to every member.
- **p2p_bytes**: the same messages as p2p with no arithmetic (each member's parts
  encoded before the rounds; each owner sends back one part as its "mean"): the
  transport alone, without the codec's work on CPU cores the machines share here.
- **ring**: PyTorch gloo's all-reduce of a float32 buffer of the payload's size
  (the same bytes), the reference the goal names: within 2x of it at 16 machines.

Every machine's mean must be the same bytes (a digest per machine is checked), and
the p2p mean must be within the two 4-bit quantizations of the exact mean. The
service's link bytes per round come from its namespace's veth counters. Writes the
section "bench/elastic_scale.py" of BENCHMARKS.md and a JSON of every time.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import statistics
import sys
import tempfile
import time

import numpy as np

from bench import _sections
from bench import harness
from bench import netns

SECTION = "bench/elastic_scale.py"
ROOT = str(harness.ROOT)
TOKEN = b"bench/elastic_scale.py's run token"
BLOCK = 256  # values per min-max block: a lo and a hi in float32 each
SUBNET = 91


# -- the 4-bit min-max codec (numpy: what lpdec's compressed mean sends, per block) ---


def encode(x: np.ndarray) -> bytes:
    """4-bit codes of `x` (float32, a multiple of BLOCK long) and each block's lo, hi."""
    blocks = x.reshape(-1, BLOCK)
    lo, hi = blocks.min(axis=1), blocks.max(axis=1)
    scale = np.where(hi > lo, (hi - lo) / 15, 1).astype(np.float32)
    codes = np.rint((blocks - lo[:, None]) / scale[:, None]).astype(np.uint8).reshape(-1)
    packed = codes[0::2] | (codes[1::2] << 4)
    return np.stack([lo, hi], axis=1).astype(np.float32).tobytes() + packed.tobytes()


def decode(payload: bytes) -> np.ndarray:
    """The float32 vector `encode` made `payload` of."""
    blocks = len(payload) // (8 + BLOCK // 2)
    bounds = np.frombuffer(payload, np.float32, 2 * blocks).reshape(blocks, 2)
    packed = np.frombuffer(payload, np.uint8, offset=8 * blocks)
    codes = np.empty(2 * packed.size, np.float32)
    codes[0::2], codes[1::2] = packed & 15, packed >> 4
    lo, hi = bounds[:, 0], bounds[:, 1]
    scale = np.where(hi > lo, (hi - lo) / 15, 0).astype(np.float32)
    return (lo[:, None] + codes.reshape(blocks, BLOCK) * scale[:, None]).reshape(-1)


# -- one machine (a process) ---------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    from lpdec.elastic import ElasticGroup
    from lpdec.elastic import peers as p2p

    n, me = args.machines, args.machine
    group = ElasticGroup(
        args.service, me, n, TOKEN, "bench", heartbeat_timeout=60, poll_s=0.005,
        private_network=True,
    )  # fmt: skip
    group.connect()
    group.mark_active()  # an exchange waits for the active machines (a barrier follows)
    x = np.random.default_rng(me).normal(size=args.values).astype(np.float32)
    peers = p2p.Peers(me, TOKEN, host=args.host) if args.mode != "star" else None
    # p2p_bytes: the same messages with no arithmetic (parts encoded before the rounds,
    # each owner sends back its first part as the "mean"): the transport alone.
    fixed = [encode(x[a:b]) for a, b in p2p.split(x.size, n, align=BLOCK)]

    def barrier(name: str) -> None:
        group.store.put(f"{name}/{me}", b"1")
        while len(group.store.dir(name)) < n:
            time.sleep(0.002)

    def reduce(chunk: int, parts: list[bytes]) -> bytes:
        return encode(np.mean([decode(p) for p in parts], axis=0, dtype=np.float32))

    times, decided, sent = [], [], 0
    for round_ in range(args.rounds + 1):
        barrier(f"b{round_}")
        started = time.monotonic()
        if args.mode == "star":
            payload = encode(x)
            ex = group.exchange(round_, payload, 1, "anchor", deadline=600.0)
            mean = np.mean([decode(c.payload) for c in ex.contributions], axis=0)
            sent = len(payload)
        else:
            ex, addresses = group.decide(round_, 1, "anchor", 600.0, peer=peers.address)
            decided.append(time.monotonic() - started)
            members = list(ex.members)
            cuts = p2p.split(x.size, len(members), align=BLOCK)
            raw = args.mode == "p2p_bytes"
            parts = fixed if raw else [encode(x[a:b]) for a, b in cuts]
            chunks = p2p.reduce_scatter_gather(
                peers, round_, members, addresses, parts,
                (lambda j, ps: ps[0]) if raw else reduce, timeout=600.0,
            )  # fmt: skip
            mean = np.concatenate([decode(c) for c in chunks]) if not raw else fixed_mean(chunks)
            sent = sum(len(p) for j, p in enumerate(parts) if members[j] != me)
            sent += len(chunks[members.index(me)]) * (len(members) - 1)
        times.append(time.monotonic() - started)
        assert ex.members == tuple(range(n)), ex.members
    barrier("end")
    exact = np.zeros(args.values)  # summed one machine at a time: 16 x 8M float64 is 1 GB
    for m in range(n):
        exact += np.random.default_rng(m).normal(size=args.values) / n
    with open(args.out, "w") as f:
        json.dump(
            {
                "times": times,
                "decided": decided,
                "digest": hashlib.sha256(mean.astype(np.float32).tobytes()).hexdigest(),
                "error": float(np.abs(mean - exact).max() / np.abs(exact).max())
                if args.mode != "p2p_bytes"
                else float("nan"),
                "sent_per_round": sent,
                "payload": len(encode(x)),
            },
            f,
        )
    if peers is not None:
        peers.close()
    group.close()
    # The service client's membership thread may still be inside jaxlib (its barrier
    # waits for the machines still leaving); a daemon thread returning from C++ after
    # the interpreter finalizes aborts the process, so end here, the results written.
    sys.stdout.flush()
    os._exit(0)


def fixed_mean(chunks: list[bytes]) -> np.ndarray:
    """p2p_bytes's "mean": the chunks' bytes as they came (what every machine must agree on)."""
    return np.frombuffer(b"".join(chunks), np.uint8)


# -- the harness -----------------------------------------------------------------


class RunFailed(RuntimeError):
    pass


def _python_env() -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    env.pop("PYTHONSTARTUP", None)
    return env


def run_case(args, setting: str, n: int, mode: str, network, workdir: str) -> dict:
    """One (setting, machines, mode): starts the service (star, p2p) and n machines."""
    case = f"{setting}-{n}-{mode}"
    port = harness.free_port()
    if network is None:
        service = f"127.0.0.1:{port}"
        hosts = ["127.0.0.1"] * n
        prefix = lambda host: []  # noqa: E731
    else:
        service = f"{network.address(0)}:{port}"
        hosts = [network.address(i + 1) for i in range(n)]
        prefix = network.exec_prefix
    procs = []
    env = _python_env()
    if mode != "ring":
        command = [sys.executable, "-m", "lpdec.elastic", "serve", "--bind", service,
                   "--machines", str(n), "--heartbeat_timeout", "60",
                   "--private_network"]  # fmt: skip
        # The service's gate lets in only the machines that prove the run's token.
        service_env = dict(env, LPDEC_ELASTIC_TOKEN=TOKEN.decode())
        procs.append(
            harness.start(prefix(0) + command, f"{workdir}/{case}-service.log", service_env)
        )
        netns.CHILDREN.append(procs[-1])
    before = network.counters(0) if network is not None else (0, 0)
    outs = [f"{workdir}/{case}-{m}.json" for m in range(n)]
    for m in range(n):
        if mode == "ring":
            address = f"{hosts[0]}:{port}"
            command = [args.torch_python, f"{ROOT}/bench/_gloo_ring.py", str(m), str(n),
                       address, str(args.values // 8 + args.values // BLOCK * 2),
                       str(args.rounds), outs[m]]  # fmt: skip
            env_m = dict(env, GLOO_SOCKET_IFNAME="lo" if network is None else "eth0")
        else:
            command = [sys.executable, "-m", "bench.elastic_scale", "worker", "--mode", mode,
                       "--machine", str(m), "--machines", str(n), "--service", service,
                       "--host", hosts[m], "--values", str(args.values),
                       "--rounds", str(args.rounds), "--out", outs[m]]  # fmt: skip
            env_m = env
        host = 0 if network is None else m + 1
        procs.append(harness.start(prefix(host) + command, f"{workdir}/{case}-{m}.log", env_m))
        netns.CHILDREN.append(procs[-1])
    workers = procs[1:] if mode != "ring" else procs
    harness.wait_all(workers, args.timeout)  # (kills whatever still runs)
    after = network.counters(0) if network is not None else (0, 0)
    for proc in procs:
        harness.kill_group(proc)
    if any(p.returncode != 0 for p in workers) or not all(os.path.exists(o) for o in outs):
        raise RunFailed(f"{case}: a machine failed or timed out (logs: {workdir}/{case}-*.log)")
    results = [json.load(open(o)) for o in outs]
    rounds = list(zip(*(r["times"][1:] for r in results), strict=True))
    out = {
        "seconds": statistics.median(max(r) for r in rounds),
        "service_bytes_per_round": (after[0] - before[0] + after[1] - before[1])
        / (args.rounds + 1),
    }
    if mode.startswith("p2p"):
        decided = list(zip(*(r["decided"][1:] for r in results), strict=True))
        out["decision_seconds"] = statistics.median(max(r) for r in decided)
    if mode != "ring":
        digests = {r["digest"] for r in results}
        out |= {
            "agree": len(digests) == 1,
            "error": max(r["error"] for r in results),
            "sent_per_round": max(r["sent_per_round"] for r in results),
            "payload": results[0]["payload"],
        }
    print(case, json.dumps(out), flush=True)
    return out


def section(results: dict, args, command: str) -> str:
    payload = args.values // 2 + args.values // BLOCK * 8
    lines = [
        f"## {args.section}: one elastic round's exchange, star vs peer to peer vs a ring",
        "",
        f"`{command}`",
        "",
        f"{_sections.versions()}; {os.cpu_count()} CPU cores; commit {harness.commit()}.",
        "",
        f"Each machine a process; {args.values:,} float32 values a machine (a "
        f"{args.values / 1e6:.2f}M-parameter pseudo-gradient), its 4-bit min-max payload "
        f"{payload:,} bytes. Time: the slowest machine's, from a barrier to holding the "
        f"round's mean, median of {args.rounds} rounds after a warm-up. star: through the "
        'coordinating service\'s key-value store (`elastic_transport="service"`, the default); '
        "p2p: the service decides the members, the bytes go between them "
        '(`elastic_transport="peers"`, `lpdec.elastic.peers`: 4-bit reduce-scatter, 4-bit '
        "mean chunks all-gathered); "
        "ring: PyTorch gloo's all-reduce of a float32 buffer of the payload's bytes. "
        "Service link: bytes in + out of the service's namespace per round.",
        "",
        "| link | machines | star s | p2p s (of which the decision) | ring all-reduce s "
        "| p2p / ring | star / p2p | service link MB/round star / p2p | every mean identical "
        "| p2p transport alone s (/ ring) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for setting, by_n in results.items():
        for n, r in by_n.items():
            star, p2p, ring = (r.get(m, {}).get("seconds") for m in ("star", "p2p", "ring"))

            def f(v, digits=3):
                return "" if v is None else f"{v:.{digits}f}"

            ratio = lambda a, b: "" if a is None or b is None else f"{a / b:.2f}x"  # noqa: E731
            link = ""
            if setting != "loopback" and "star" in r and "p2p" in r:
                link = (
                    f"{r['star']['service_bytes_per_round'] / 1e6:.1f} / "
                    f"{r['p2p']['service_bytes_per_round'] / 1e6:.2f}"
                )
            decision = f" ({r['p2p']['decision_seconds']:.3f})" if "p2p" in r else ""
            agree = all(r[m]["agree"] for m in ("star", "p2p", "p2p_bytes") if m in r)
            alone = r.get("p2p_bytes", {}).get("seconds")
            alone_text = "" if alone is None else f"{alone:.3f} ({ratio(alone, ring)})"
            lines.append(
                f"| {setting} | {n} | {f(star)} | {f(p2p)}{decision} | {f(ring)} "
                f"| {ratio(p2p, ring)} "
                f"| {ratio(star, p2p)} | {link} | {'yes' if agree else '**no**'} | {alone_text} |"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "worker":
        parser = argparse.ArgumentParser(prog="python -m bench.elastic_scale worker")
        for name, kind in (("--mode", str), ("--machine", int), ("--machines", int),
                           ("--service", str), ("--host", str), ("--values", int),
                           ("--rounds", int), ("--out", str)):  # fmt: skip
            parser.add_argument(name, type=kind, required=True)
        worker(parser.parse_args(argv[1:]))
        return 0
    parser = argparse.ArgumentParser(prog="python -m bench.elastic_scale", description=__doc__)
    parser.add_argument("--machines", default="3,8,16")
    parser.add_argument("--settings", default="loopback,100mbit")
    parser.add_argument("--modes", default="star,p2p,ring")
    parser.add_argument("--values", type=int, default=1 << 20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a case may take")
    parser.add_argument("--torch-python", default=None, help="a Python with torch (ring)")
    parser.add_argument("--output", default=os.path.join(ROOT, "BENCHMARKS.md"))
    parser.add_argument("--results", default=None, help="JSON of the measurements")
    parser.add_argument("--section", default=SECTION, help="the BENCHMARKS.md section's name")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args(argv)
    machines = [int(m) for m in args.machines.split(",")]
    settings = args.settings.split(",")
    modes = args.modes.split(",")
    if args.values % BLOCK:
        parser.error(f"--values must be a multiple of {BLOCK}")
    if "ring" in modes and not args.torch_python:
        parser.error("the ring mode needs --torch-python (a Python that imports torch)")
    bad = [s for s in settings if s != "loopback" and not s.endswith(("mbit", "gbit"))]
    if bad:
        parser.error(f"--settings: {bad} (expected loopback or a rate such as 100mbit)")
    if any(s != "loopback" for s in settings) and (why := netns.unavailable()):
        parser.error(f"namespaces unavailable: {why}")
    workdir = args.workdir or tempfile.mkdtemp(prefix="elastic_scale_")
    os.makedirs(workdir, exist_ok=True)
    netns.install_cleanup()
    results: dict = {}
    try:
        for setting in settings:
            for n in machines:
                network = None
                if setting != "loopback":
                    network = netns.Network(n + 1, f"lpes{n}", SUBNET)
                    netns.NETWORKS.append(network)
                    network.create()
                    network.shape(setting)
                try:
                    for mode in modes:
                        results.setdefault(setting, {}).setdefault(n, {})[mode] = run_case(
                            args, setting, n, mode, network, workdir
                        )
                finally:
                    if network is not None:
                        network.destroy()
                        netns.NETWORKS.remove(network)
    except netns.Interrupted as signame:
        print(f"interrupted by {signame}: removing namespaces", file=sys.stderr, flush=True)
        netns.teardown()
        return 130
    except RunFailed as error:
        print(f"error: {error}", file=sys.stderr)
        netns.teardown()
        return 1
    results_path = args.results or os.path.join(workdir, "elastic_scale_results.json")
    with open(results_path, "w") as f:
        json.dump({"args": vars(args), "results": results}, f, indent=2)
    command = "python -m bench.elastic_scale " + " ".join(shlex.quote(a) for a in argv)
    body = section(results, args, command)
    _sections.replace_section(args.output, args.section, body, header=_sections.BENCHMARKS_HEADER)
    print(body)
    print(f"results: {results_path}; section: {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
