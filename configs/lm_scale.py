"""The language-model study's DiLoCo on 4 machines, tuned there (EXPERIMENTS.md: scale).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python train.py \\
        --config=configs/lm_scale.py --workdir=/tmp/lm_scale
    # 8 machines x 1 (the same 8 workers and tokens per step):
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python train.py \\
        --config=configs/lm_scale.py --workdir=/tmp/lm_scale8 \\
        --config.machines=8 --config.shard_model=False

configs/lm_study.py's model, data and tokens (lm_tiny's 120,576-parameter
transformer, 8.2 million tokens trained, warm-up and cosine), as 4 machines x 2
workers joined by DiLoCo with the 4-bit min-max exchange with error feedback, at the
4-machine winner of `python -m bench.experiments scale --keep-published`: the outer
step swept again on 4 machines (outer learning rate x outer momentum at H=10: 0.7 /
0.8), Muon as each machine's inner optimizer (its learning rate swept: 0.01 at the
study's batch, 0.0025 when re-swept at this one; Adam 8e-3 on the embeddings, norms
and biases), and the batch swept at equal tokens: one
64-byte window a worker and step, 16,000 steps (lm_study's 8 windows and 2,000 steps
/ 8), where the all-reduce with Muon does best too. Muon orthogonalizes whole
matrices, so each worker holds its machine's whole model (no FSDP). The fields are
the published winner's; tests/test_configs.py checks them against
docs/experiments.json.

Expected: about 5 minutes on 2 CPU cores.
"""

from configs import lm_study

#: The 4-machine winner's outer step, H and inner optimizer (EXPERIMENTS.md, "Beyond
#: two machines").
LOCAL_STEPS = 10
OUTER_LR = 0.7
OUTER_MOMENTUM = 0.8
OPTIMIZER = "muon"
LEARNING_RATE = 0.0025  # re-swept at this batch (x0.125): 0.0025 over 0.01
#: Muon's own momentum (optax's 0.95; 0.9 won at lm_study's batch, not at this one).
MUON_BETA = 0.95
#: The batch per worker against lm_study's 8 windows, at the same tokens (the steps
#: and their warm-up scaled by its inverse): one window of 64 bytes a worker, 16,000
#: steps. The all-reduce's best batch too (the baseline swept as the method is).
BATCH_FACTOR = 0.125


def get_config():
    config = lm_study.get_config()
    config.batch_size = int(config.batch_size * BATCH_FACTOR)
    lm_study.recipe(config, int(config.num_steps / BATCH_FACTOR))
    config.machines = 4
    config.local_steps = LOCAL_STEPS
    config.outer_lr = OUTER_LR
    config.outer_momentum = OUTER_MOMENTUM
    # The momentum warm-up over the study's first 200 steps, whatever H.
    config.outer_warmup_rounds = 200 // LOCAL_STEPS
    config.optimizer = OPTIMIZER
    config.learning_rate = LEARNING_RATE
    config.muon_beta = MUON_BETA
    config.shard_model = OPTIMIZER != "muon"  # Muon needs each matrix whole
    return config
