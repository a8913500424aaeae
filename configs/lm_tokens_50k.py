"""lm_tiny's run on your own pre-tokenized corpus with a GPT-2-sized vocabulary (50,257).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python train.py \\
        --config=configs/lm_tokens_50k.py --workdir=/tmp/my_lm --config.data_dir=DIR

DIR holds nanoGPT's train.bin and val.bin (uint16 token ids below 50,257; for
another tokenizer set `--config.model_kwargs.vocab_size` and, above 65,536 ids,
`--config.token_dtype=uint32`). lm_tiny's layout and method (2 machines x 4
workers, each machine's model split over its workers, DiLoCo with a 4-bit EF
exchange), sized for the vocabulary. With 50,257 tokens every token's logits and
their softmax are 50,257 wide (196 times lm_tiny's 256 bytes), which on a CPU is
the step's cost per token whatever d_model: lm_tiny itself at vocab 50,257 takes
1.81 s a step on 2 CPU cores against its 0.05 s on bytes (100 steps: 5.7
minutes). This config takes half the tokens a step (4 windows per worker) and
half the width (d_model 32, tied: the embedding is 1.61M of its 1.64M parameters,
so half the bytes an exchange), evaluates fewer windows, trains 50 steps and
reads the whole file (`text_bytes` = 0).

Expected (2 CPU cores): half lm_tiny's step at that vocabulary (measured side by
side, on shared cores: 6.2-7.0 s against 12.4-14.6 s), so about 0.9 s a step when
the cores are idle (docs/training.md, "Your own data"). On random ids the loss
stays at ln(50,257) = 10.8 nats (15.6 bits per token); on a real corpus it falls
from there.
"""

from configs import lm_tiny


def get_config():
    config = lm_tiny.get_config()
    config.dataset = "token_file"
    config.data_dir = ""  # your corpus: --config.data_dir=DIR (train.bin, val.bin)
    config.token_dtype = "uint16"
    config.text_bytes = 0
    config.model_kwargs.vocab_size = 50257
    config.model_kwargs.d_model = 32
    config.model_kwargs.num_heads = 4
    config.batch_size = 4  # windows per worker and step
    config.validation_windows = 64
    config.eval_local_examples = 32
    config.num_steps = 50
    config.warmup_steps = 5
    config.log_every = 10
    config.checkpoint_every = 50
    return config
