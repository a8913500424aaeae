"""The real-link benchmark's model: a 1.09M-parameter MLP on MNIST-1D, 8 nodes on a ring, fp32.

    python -m bench.link --rates 100mbit,1gbit --processes 2 --devices 4 --steps 400 --target 0.7

`bench/link.py` runs this config as P processes of `train.py` (one per network
namespace, joined by an htb-shaped veth link) and overrides `algorithm`,
`compressor`, `bits`, `gamma`, `theta` and `num_steps` per method. By hand, on
one machine with 8 CPU devices:

    python train.py --config=configs/link_mlp.py --workdir=/tmp/link_mlp

MNIST-1D (10,000 sequences: 8,000 train, 2,000 test), an MLP with two hidden
layers of 1024 (EvoNorm, 1,091,594 parameters: 4.37 MB in fp32), 8 nodes on a
ring, batch 32 per node, Nesterov SGD at a constant learning rate 0.1, D-PSGD
in fp32; logs every 20 steps and checkpoints only at the end, so the log rows
are frequent enough to time the run to a target accuracy.

Expected result (2026-11-23, 2 CPU cores shared, 1 process x 8 devices, 200
steps of D-PSGD): the node-averaged model passes 70% test accuracy around step
120 and ends near 75%; see the `bench/link.py` section of BENCHMARKS.md for
the methods on a shaped link.
"""

from configs import default


def get_config():
    config = default.get_config()
    config.dataset = "mnist1d"
    config.num_samples = 10000
    config.model = "mlp"
    config.model_kwargs.hidden_sizes = (1024, 1024)
    config.precision = "fp32"
    config.num_nodes = 8
    config.topology = "ring"
    config.algorithm = "dpsgd"
    config.optimizer = "nesterov"
    config.learning_rate = 0.1
    config.lr_schedule = "constant"
    config.num_steps = 200
    config.log_every = 20
    config.checkpoint_every = 0
    return config
