"""The language-model study's recipe, at DiLoCo's tuned setting (EXPERIMENTS.md, "lm").

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python train.py \\
        --config=configs/lm_study.py --workdir=/tmp/lm_study
    # the all-reduce it is measured against (its own tuned learning rate is the same):
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python train.py \\
        --config=configs/lm_study.py --workdir=/tmp/lm_study_ar \\
        --config.algorithm=allreduce --config.local_steps=1 \\
        --config.error_feedback=False --config.outer_warmup_rounds=0
    # the link benchmark's language model (bench/link.py --workload lm)

configs/lm_tiny.py's transformer (120,576 parameters) on 8 MB of this Python's
standard library sources, 2 machines x 4 workers, each machine's model split
over its workers (FSDP), 8 windows of 64 bytes per worker and step, 2,000 steps
(8.2M tokens, 68 per parameter), Adam with 100 warm-up steps and a cosine
schedule, validation on 1,024 held-out windows every 100 steps.

The training fields are the study's winners (`python -m bench.experiments lm`,
3 seeds each): Adam 8e-3 (the all-reduce's sweep and DiLoCo's inner sweep both
pick it); DiLoCo H=10 with a 4-bit min-max exchange with error feedback, outer
Nesterov 0.7 / 0.6 (the outer sweep's winner), its momentum rising from 0 over
the first 20 rounds. Measured: 2.2459 bits per byte over 3 seeds, +0.95% over the
tuned all-reduce's 2.2247, sending 1/53 of its bytes between the machines.
tests/test_configs.py checks these fields against docs/experiments.json.

Expected: about 4 minutes on 2 CPU cores (evaluation included).
"""

from configs import lm_tiny

#: The all-reduce's tuned learning rate (the sweep's winner, 3 seeds: 2.2247).
ALLREDUCE_LEARNING_RATE = 8e-3


def recipe(config, num_steps: int = 2000):
    """Sets the study's data, budget and schedule fields on `config` (lm_tiny's model)."""
    config.text_bytes = 8_000_000
    config.validation_windows = 1024
    config.num_steps = num_steps
    config.log_every = num_steps // 20
    config.warmup_steps = num_steps // 20
    config.checkpoint_every = 0
    config.eval_local_examples = 0
    return config


def get_config():
    # lm_tiny's DiLoCo: H=10, the 4-bit min-max compressed mean with error feedback.
    config = recipe(lm_tiny.get_config())
    config.learning_rate = 8e-3
    config.outer_lr = 0.7
    config.outer_momentum = 0.6
    config.outer_warmup_rounds = 20
    return config
