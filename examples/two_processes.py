"""Two processes on one machine: 8 nodes on 2 x 4 CPU devices over jax.distributed.

The processes stand for two hosts: each owns 4 devices (4 nodes), and the nodes
gossip across the process boundary through gloo, XLA's CPU collectives. Every
process runs the same program on the same inputs; `lpdec.make_layout` spreads
the nodes over the global devices and `lpdec.init_nodes` builds each process's
share of the state. The problem is least squares split over the nodes
(non-IID); the run prints the distance of the averaged model to the minimiser,
and ends with the same digits as the one-process run on 8 devices:

    python examples/two_processes.py            # launches itself twice, waits for both
    python examples/two_processes.py --single   # the same run in one process
"""

import argparse
import os
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils

import lpdec


def launch(args):
    """Starts process 0 and 1 of this script, 4 CPU devices each, and waits for both."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    command = [sys.executable, __file__, f"--coordinator={address}", f"--steps={args.steps}"]
    procs = [subprocess.Popen([*command, f"--process_id={i}"], env=env) for i in range(2)]
    codes = [p.wait() for p in procs]
    if any(codes):
        sys.exit(f"a process failed: exit codes {codes}")


def train(args):
    n, m, d = 8, 64, 20
    rng = np.random.default_rng(0)  # the same data in every process
    a = rng.normal(size=(n, m, d)).astype(np.float32)
    w_node = rng.normal(size=(n, d)) + 3 * rng.normal(size=d)
    b = (np.einsum("nmd,nd->nm", a, w_node) + 0.1 * rng.normal(size=(n, m))).astype(np.float32)
    w_star = np.linalg.solve(np.einsum("nmd,nme->de", a, a), np.einsum("nmd,nm->d", a, b))

    layout = lpdec.make_layout(n)  # over the devices of all processes
    tx = optax.chain(
        optax.sgd(0.02),
        lpdec.choco(lpdec.ring(n), lpdec.minmax(bits=8), gamma=0.5, axis_name=layout.axis_name),
    )
    params, opt_state = lpdec.init_nodes(tx, np.zeros(d, np.float32), layout)

    def run_100_steps(w, opt_state, a, b):  # one node
        def step(carry, _):
            w, opt_state = carry
            grads = jax.grad(lambda w: jnp.mean((a @ w - b) ** 2))(w)
            updates, opt_state = tx.update(grads, opt_state, w)
            return (optax.apply_updates(w, updates), opt_state), None

        return jax.lax.scan(step, (w, opt_state), length=100)[0]

    run_100_steps = jax.jit(layout.map(run_100_steps, (True, True, True, True)))
    a, b = layout.put((a, b))
    if jax.process_index() == 0:
        print(f"process 0 of {jax.process_count()}: {jax.device_count()} devices, {n} nodes")
    for step in range(100, args.steps + 1, 100):
        params, opt_state = run_100_steps(params, opt_state, a, b)
        # The node axis spans both processes: gather every node's model on every process.
        w = multihost_utils.process_allgather(params, tiled=True)
        error = np.linalg.norm(w.astype(np.float64).mean(axis=0) - w_star)
        if jax.process_index() == 0:
            print(f"step {step}: |mean(w) - w*| = {error:.6e}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="a multiple of 100")
    parser.add_argument("--single", action="store_true", help="one process, 8 devices")
    parser.add_argument("--coordinator", help="HOST:PORT of process 0 (set by the launcher)")
    parser.add_argument("--process_id", type=int)
    args = parser.parse_args()
    if args.single:
        jax.config.update("jax_num_cpu_devices", 8)
        train(args)
    elif args.process_id is None:
        launch(args)
    else:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(args.coordinator, num_processes=2, process_id=args.process_id)
        train(args)


if __name__ == "__main__":
    main()
