"""More nodes than devices: 16 nodes on 8 devices, 2 simulated per device.

Every node i holds its own least-squares problem (A_i, b_i), with a different
solution per node (non-IID). Together they minimise the mean of the nodes'
losses, whose minimiser w* has a closed form; the nodes gossip 8-bit DCD-PSGD
messages over an exponential graph and the script prints how far the averaged
model ends from w* (about 0.04 after 300 steps, from 12.3 at the start; the
average of the nodes' own minimisers, without gossip, is 0.68 away):

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/many_nodes.py
    python examples/many_nodes.py --nodes_per_device=16    # 16 nodes on one CPU

With more nodes than devices, `lpdec.make_layout` vmaps the extra nodes inside
`shard_map`; the algorithms then take the pair of axis names
`layout.axis_name == ("nodes", "local")` and treat it as one node axis.
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax

import lpdec


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes_per_device", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300, help="a multiple of 100")
    args = parser.parse_args()

    n, m, d = args.nodes_per_device * jax.device_count(), 64, 20
    rng = np.random.default_rng(0)
    a = rng.normal(size=(n, m, d)).astype(np.float32)
    w_node = rng.normal(size=(n, d)) + 3 * rng.normal(size=d)  # each node its own solution
    b = (np.einsum("nmd,nd->nm", a, w_node) + 0.1 * rng.normal(size=(n, m))).astype(np.float32)
    # The minimiser of (1/n) sum_i ||A_i w - b_i||^2 / m: the normal equations of all nodes.
    w_star = np.linalg.solve(np.einsum("nmd,nme->de", a, a), np.einsum("nmd,nm->d", a, b))

    layout = lpdec.make_layout(n)
    print(f"{n} nodes on {jax.device_count()} devices: axis_name={layout.axis_name}")
    print(f"start: |w - w*| = {np.linalg.norm(w_star):.4f}")
    tx = optax.chain(
        optax.sgd(0.02),
        lpdec.dcd(lpdec.exponential(n), lpdec.minmax(bits=8), axis_name=layout.axis_name),
    )
    params, opt_state = lpdec.init_nodes(tx, np.zeros(d, np.float32), layout)

    def loss_fn(w, a, b):
        return jnp.mean((a @ w - b) ** 2)

    def train(w, opt_state, a, b):  # one node, 100 steps
        def step(carry, _):
            w, opt_state = carry
            updates, opt_state = tx.update(jax.grad(loss_fn)(w, a, b), opt_state, w)
            return (optax.apply_updates(w, updates), opt_state), None

        return jax.lax.scan(step, (w, opt_state), length=100)[0]

    train = jax.jit(layout.map(train, (True, True, True, True)), donate_argnums=(0, 1))
    a, b = layout.put((a, b))
    for step in range(100, args.steps + 1, 100):
        params, opt_state = train(params, opt_state, a, b)
        error = np.linalg.norm(np.asarray(lpdec.metrics.average_model(params)) - w_star)
        consensus = float(lpdec.metrics.consensus_distance(params))
        print(f"step {step}: |mean(w) - w*| = {error:.4f}, consensus distance {consensus:.2e}")


if __name__ == "__main__":
    main()
