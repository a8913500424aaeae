"""The language model of the link benchmark: as large as its runs allow on 2 CPU cores.

    # 2 machines (processes) x 4 devices; on machine i of 2 (host0 = machine 0's address):
    python train.py --config=configs/lm_small.py --workdir=/tmp/lm_small \\
        --coordinator_address=host0:12345 --num_processes=2 --process_id=i
    # the same layout simulated in one process:
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python train.py \\
        --config=configs/lm_small.py --workdir=/tmp/lm_small
    # the link benchmark (bench/link.py --workload lm) runs it with each method's fields

A 1.29M-parameter byte-level transformer (d_model 160, 4 layers, 4 heads,
context 64, tied embeddings) on 8 MB of this Python's standard library
sources, 2 machines x 4 workers, each machine's model split over its workers
(FSDP), 8 windows of 64 bytes per worker and step (2,048 tokens per machine),
Adam 2e-3 with a cosine schedule, 200 steps, logged every 40. The training
algorithm is DiLoCo (H=20, 4-bit pseudo-gradients with error feedback, outer
Nesterov 0.7 / 0.9); bench/link.py overrides it per method.

Expected: see BENCHMARKS.md, "bench/link.py lm" sections, for the measured
validation bits per byte and times at each link rate.
"""

from configs import lm_tiny


def get_config():
    config = lm_tiny.get_config()
    config.sequence_length = 64
    config.text_bytes = 8_000_000
    config.validation_windows = 256
    config.model_kwargs.context = 64
    config.model_kwargs.d_model = 160
    config.model_kwargs.num_layers = 4
    config.model_kwargs.num_heads = 4
    config.local_steps = 20
    config.outer_lr = 0.7
    config.outer_momentum = 0.9
    config.learning_rate = 2e-3
    config.warmup_steps = 20
    config.batch_size = 8
    config.num_steps = 200
    config.log_every = 40
    config.checkpoint_every = 0
    config.eval_local_examples = 64
    return config
