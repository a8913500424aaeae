"""Seed 002, Table 2: ResNet-20 on CIFAR-10, 16-node directed ring, LP-CHOCO (Quant-SGP).

    python train.py --config=configs/cifar10_resnet20_ring16.py --workdir=/tmp/r20_ring16 \\
        --config.data_dir=/path/to/cifar-10-batches-bin [--config.skew=0.9]

As cifar10_resnet20_ring8.py with 16 nodes (the spectral gap of a 16-node
directed ring equals a 32-node undirected ring's). On fewer than 16 devices the
extra nodes are simulated with vmap (16 must be a multiple of the device
count). The paper's compressed variant here is 90% (--config.compressor=top_k
--config.ratio=0.1). Expected (Table 2, LP-CHOCO, 0% compression): 90.26 /
89.59 / 86.47 / 79.53 % at skew 0 / 0.4 / 0.8 / 0.9.
"""

from configs import cifar10_resnet20_ring8


def get_config():
    config = cifar10_resnet20_ring8.get_config()
    config.num_nodes = 16
    return config
