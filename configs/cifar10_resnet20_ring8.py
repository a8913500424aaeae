"""Seed 002, Table 2: ResNet-20 on CIFAR-10, 8-node directed ring, LP-CHOCO (Quant-SGP).

    python train.py --config=configs/cifar10_resnet20_ring8.py --workdir=/tmp/r20_ring8 \\
        --config.data_dir=/path/to/cifar-10-batches-bin [--config.skew=0.9]

Needs the CIFAR-10 binary files (https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz,
downloaded by the user; nothing is fetched at run time). The paper's settings:
8 nodes on a directed ring (one peer per node), Quant-SGP (CHOCO-SGD with
push-sum), 8-bit training with Range EvoNorm, Nesterov momentum 0.9, lr 0.1
decayed x0.1 at epochs 100 and 150 of 200, weight decay 1e-4, batch 32 per
node, standard augmentation. Variants from the command line:

  --config.skew=0.4 | 0.8 | 0.9          degree of skew (0 = IID)
  --config.precision=fp32                 32-bit training (EvoNorm)
  --config.algorithm=sparse_push          the Deep-Squeeze variant (LP-DS)
  --config.compressor=top_k --config.ratio=0.01 --config.gamma=0.5
                                          99% compression (layer-wise top-1%);
                                          gamma is not given in the paper: tune it
  --config.optimizer=qg_momentum          quasi-global momentum (Table 3)

Expected (seed 002, Table 2, LP-CHOCO, 0% compression): 90.30 / 90.29 / 87.06 /
83.65 % test accuracy at skew 0 / 0.4 / 0.8 / 0.9. Runtime: hours on a GPU;
about 6 ms per step per node for the forward+backward pass on a modern GPU,
impractical on 2 CPU cores (not run here).
"""

from configs import default


def get_config():
    config = default.get_config()
    config.dataset = "cifar10"
    config.data_dir = ""  # required: --config.data_dir=...
    config.augment = True
    config.model = "resnet20"
    config.precision = "int8"
    config.num_nodes = 8
    config.topology = "directed_ring"
    config.algorithm = "quant_sgp"
    config.compressor = "identity"
    config.gamma = 1.0
    config.optimizer = "nesterov"
    config.learning_rate = 0.1
    config.momentum = 0.9
    config.weight_decay = 1e-4
    config.lr_schedule = "piecewise"
    config.lr_boundaries = (0.5, 0.75)  # epochs 100 and 150 of 200
    config.lr_decay = 0.1
    config.batch_size = 32
    config.num_epochs = 200.0
    config.log_every = 200
    config.checkpoint_every = 2000
    config.eval_local_examples = 1000
    return config
