"""A byte-level language model in seconds: the tests' and the README's first LM run.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python train.py \\
        --config=configs/lm_tiny.py --workdir=/tmp/lm_tiny

A 120,576-parameter decoder-only transformer (d_model 64, 2 layers, 4 heads,
context 64, tied embeddings) on 1 MB of this Python's standard library sources,
bytes as tokens. 2 machines x 4 workers (simulated in one process; as processes,
see README "Training across machines"): each machine's model is split over its 4
workers (`config.shard_model`, FSDP inside a machine), the machines train it
with DiLoCo (10 local Adam steps, then a 4-bit compressed mean of the
pseudo-gradients with error feedback and the outer Nesterov step). 100 steps.

Expected (2 CPU cores, 2026-11-26): about 26 s of wall time; the validation
loss of the machines' (synchronised) model falls from 8 bits per byte (a
uniform guess over bytes) to 4.45 at step 100 (train loss 2.93 nats = 4.2
bits); 25,000 tokens per second per machine.
"""

from configs import default


def get_config():
    config = default.get_config()
    config.dataset = "stdlib_text"
    config.sequence_length = 64
    config.text_bytes = 1_000_000
    config.validation_windows = 256
    config.model = "transformer"
    config.model_kwargs.context = 64
    config.model_kwargs.d_model = 64
    config.model_kwargs.num_layers = 2
    config.model_kwargs.num_heads = 4
    # Bytes; a token file's tokenizer sets its own (--config.model_kwargs.vocab_size=50257).
    config.model_kwargs.vocab_size = 256

    config.num_nodes = 8
    config.hierarchical = True
    config.machines = 2  # the processes when 2 run; simulated in one process
    config.shard_model = True
    config.algorithm = "diloco"
    config.local_steps = 10
    config.exchange = "compressed_mean"
    config.compressor = "minmax"
    config.bits = 4
    config.error_feedback = True

    config.optimizer = "adam"
    config.learning_rate = 1e-2
    config.weight_decay = 0.0
    config.lr_schedule = "cosine"
    config.warmup_steps = 10
    config.batch_size = 8  # windows per worker and step
    config.num_steps = 100
    config.log_every = 20
    config.checkpoint_every = 100
    config.eval_local_examples = 128
    return config
