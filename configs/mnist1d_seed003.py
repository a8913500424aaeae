"""Seed 003's (Moniqua's) training recipe on MNIST-1D, as the experiments run it.

    python train.py --config=configs/mnist1d_seed003.py --workdir=/tmp/seed003 \
        --config.algorithm=moniqua --config.bits=1 --config.rounding=stochastic \
        --config.theta=2.0 --config.slack=5e-3

Seed 003 (section 6) trains with momentum 0.9, weight decay 5e-4, initial step
size 0.1 and batch 128 per worker on an 8-worker ring, with stochastic rounding
for every compressed method. Its batch is for CIFAR-10's 50,000 images;
MNIST-1D has 8,000 training sequences, so the batch scales to 32 per node (128 x
8,000 / 50,000 = 20, rounded up to the other studies' batch). Seed 003 states
no schedule: seed 002's step decay (x0.1 at 50% and 75%) is used over 2,000
steps. The momentum is heavy-ball (`optimizer="sgd"` with `momentum`).
"""

from configs import mnist1d_seed002


def get_config():
    config = mnist1d_seed002.get_config()
    config.optimizer = "sgd"
    config.weight_decay = 5e-4
    config.topology = "ring"
    return config
