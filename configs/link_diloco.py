"""The fastest setting measured on a slow link: DiLoCo, 10 local steps, 4-bit pseudo-gradients.

    python -m bench.link --rates 100mbit --processes 2 --devices 4 --methods allreduce,diloco4 \\
        --target final                # the measurement below, on namespaces joined by 100 Mbit
    python train.py --config=configs/link_diloco.py --workdir=/tmp/link_diloco   # by hand

`configs/link_mlp.py` (MNIST-1D, a 1.1M-parameter MLP, 8 nodes, Nesterov SGD
at 0.1) trained with `lpdec.diloco`: every node takes 10 local steps, then
the nodes average their pseudo-gradients (parameters at the last
synchronisation minus now) with the two-round compressed mean at 4 bits with
error feedback, and take one outer Nesterov step (lr 0.7, momentum 0.9,
DiLoCo's values). Nothing crosses the wire on the 9 steps in between.

Measured result: MEASURED_RESULT
"""

from configs import link_mlp


def get_config():
    config = link_mlp.get_config()
    config.algorithm = "diloco"
    config.local_steps = 10
    config.outer_lr = 0.7
    config.outer_momentum = 0.9
    config.exchange = "compressed_mean"
    config.compressor = "minmax"
    config.bits = 4
    config.error_feedback = True
    config.num_steps = 400
    return config
