"""The real-link benchmark's model: a 1.09M-parameter MLP on MNIST-1D, 8 nodes on a ring, fp32.

    python -m bench.link --rates 100mbit,1gbit --processes 2 --devices 4 --steps 400 --target 0.7

`bench/link.py` runs this config as P processes of `train.py` (one per network
namespace, joined by an htb-shaped veth link) and overrides `algorithm`,
`compressor`, `bits`, `gamma`, `theta`, `rounding`, `slack`, `num_steps` and
`log_every` per method and run. By hand, on one machine with 8 CPU devices:

    python train.py --config=configs/link_mlp.py --workdir=/tmp/link_mlp

MNIST-1D (10,000 sequences: 8,000 train, 2,000 test), an MLP with two hidden
layers of 1024 (1,105,930 parameters: 1,099,786 dense + 6,144 EvoNorm, 4.42 MB
in fp32), 8 nodes on a ring, batch 32 per node, Nesterov SGD at a constant
learning rate 0.1, D-PSGD in fp32; logs every 20 steps and checkpoints only at
the end, so the log rows are frequent enough to time the run to a target
accuracy.

Expected result (measured 2026-11-23 on 2 shared CPU cores, 1 process x 8
devices, about 60 s): after 200 steps the node-averaged model's test accuracy
is 71.8% with D-PSGD (69.4% at step 180), 70.8% with CHOCO 4-bit (gamma 0.8),
70.7% with CHOCO 2-bit (gamma 0.4) and 68.8% with Moniqua 2-bit (theta 0.1,
stochastic rounding, slack 0.5). See the `bench/link.py` section of
BENCHMARKS.md for the methods on a shaped link.
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
