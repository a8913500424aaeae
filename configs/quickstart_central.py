"""The quickstart's centralized reference: one node trains on all the data, same budget.

    python train.py --config=configs/quickstart_central.py --workdir=/tmp/lpdec_central

Same model (8-bit 1-D CNN), data (MNIST-1D, 10,000), optimizer and number of
steps (930) as configs/quickstart.py, with one node and a batch of 8 x 32 = 256,
so it sees the same samples per step as the 8 nodes together. No communication.
About 35 s on 2 CPU cores. Expected: 94.9% / 94.5% test accuracy (seeds 0 / 1).
"""

from configs import quickstart


def get_config():
    config = quickstart.get_config()
    config.num_nodes = 1
    config.batch_size = 256
    config.algorithm = "none"
    config.topology = "complete"
    return config
