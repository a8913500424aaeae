"""Seed 002, Table 2: ResNet-54 on CIFAR-10, 8-node directed ring, LP-CHOCO (Quant-SGP).

    python train.py --config=configs/cifar10_resnet54_ring8.py --workdir=/tmp/r54_ring8 \\
        --config.data_dir=/path/to/cifar-10-batches-bin [--config.skew=0.9]

As cifar10_resnet20_ring8.py with ResNet-54 (0.76 M parameters). Expected
(Table 2, LP-CHOCO, 0% compression): 91.44 / 91.19 / 89.30 / 87.40 % at skew
0 / 0.4 / 0.8 / 0.9.
"""

from configs import cifar10_resnet20_ring8


def get_config():
    config = cifar10_resnet20_ring8.get_config()
    config.model = "resnet54"
    return config
