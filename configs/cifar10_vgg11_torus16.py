"""Seed 002, Table 2: VGG-11 on CIFAR-10, 16-node (4x4) undirected torus, LP-CHOCO.

    python train.py --config=configs/cifar10_vgg11_torus16.py --workdir=/tmp/vgg_torus16 \\
        --config.data_dir=/path/to/cifar-10-batches-bin [--config.skew=0.9]

VGG-11 with a 512-wide hidden layer and 10 outputs (9.49 M parameters), 16
nodes on a 4x4 torus (four peers each), CHOCO-SGD's push-sum form (Quant-SGP;
on a doubly stochastic torus it equals CHOCO-SGD), 8-bit training, Nesterov
0.9, lr 0.1 halved every 30 epochs for 200 epochs, weight decay 1e-4, batch 32
per node. Expected (Table 2, LP-CHOCO, 0% compression): 89.73 / 89.80 / 86.73 /
85.67 % at skew 0 / 0.4 / 0.8 / 0.9.
"""

from configs import cifar10_resnet20_ring8


def get_config():
    config = cifar10_resnet20_ring8.get_config()
    config.model = "vgg11"
    config.num_nodes = 16
    config.topology = "torus"
    config.torus_rows = 4
    config.lr_boundaries = tuple(round(0.15 * k, 2) for k in range(1, 7))  # every 30 of 200
    config.lr_decay = 0.5
    return config
