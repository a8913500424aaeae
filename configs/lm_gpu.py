"""The language model for one GPU: ~86M parameters (GPT-2 small's shape, bytes as tokens).

    python train.py --config=configs/lm_gpu.py --workdir=/tmp/lm_gpu

d_model 768, 12 layers, 12 heads, context 1024, tied embeddings (86,039,040
parameters; `model_kwargs.num_layers=18` gives 128.6M), bfloat16 compute with
cuDNN's fused attention, on the whole standard library of the running Python
(~31 MB). 8 nodes vmapped on the one GPU, each with its whole model, trained
with DiLoCo (H=50, 4-bit pseudo-gradients with error feedback); override
`algorithm` for D-PSGD or CHOCO. 8 windows of 1,024 bytes per node and step.

Expected: not yet measured on a GPU (no GPU session so far); on CPU it is far
too slow to run. The GPU figures, when measured, go to BENCHMARKS.md.
"""

from configs import lm_tiny


def get_config():
    config = lm_tiny.get_config()
    config.sequence_length = 1024
    config.text_bytes = 0
    config.validation_windows = 256
    config.model_kwargs.context = 1024
    config.model_kwargs.d_model = 768
    config.model_kwargs.num_layers = 12
    config.model_kwargs.num_heads = 12
    config.model_kwargs.dtype = "bfloat16"  # a name: the config stays JSON (summary, checkpoints)
    config.model_kwargs.attention_implementation = "cudnn"
    config.hierarchical = False
    config.machines = 0
    config.shard_model = False
    config.local_steps = 50
    config.learning_rate = 6e-4
    config.warmup_steps = 100
    config.batch_size = 8
    config.num_steps = 2000
    config.log_every = 100
    config.checkpoint_every = 1000
    config.eval_local_examples = 32
    return config
