"""PyTorch DDP on the link benchmark's language model: what a user would pick instead.

    # one process per machine (bench/link.py runs them in its network namespaces):
    python bench/ddp_lm.py --rank R --world 2 --master 10.77.0.1:29500 --threads 4 \\
        --steps 30 --out /tmp/ddp_rank_R.json

Each process is one machine holding the whole model (DDP replicates; it does not
shard), runs `--threads` intra-op threads (the JAX processes' CPU devices) and a
batch of threads x 8 windows of 64 bytes (a machine's batch in configs/lm_tiny.py,
lm_small.py and lm_study.py), and all-reduces the gradients over gloo in DDP's
buckets, overlapped with the backward pass. The model is lpdec's transformer
written in PyTorch: `--d-model` wide (default 160: lm_small's; 64: lm_tiny's and
lm_study's), `--layers` pre-norm blocks of `--heads` heads
(`scaled_dot_product_attention`, causal), GELU (tanh) MLPs of 4 x d, learned
positions, tied embeddings, lpdec's initialization, Adam at `--lr`; as
`lpdec.models.transformer_param_count` counts them: 1,288,640 parameters at
lm_small's shape, 120,576 at lm_tiny's.
The tokens are random bytes unless `--data` names train.py's windows
(bench/step_parity.py's loss curves): the step's time does not depend on them,
and bench/link.py uses only the time (DDP computes synchronous data-parallel
SGD, the fp32 all-reduce's algorithm, so its loss per step is the all-reduce's).

Writes `--out`: seconds per step (median after `--warmup` steps), the
parameter count, and with `--log-every` the mean training loss over the ranks
and each interval (`--schedule`: train.py's warm-up and cosine). Needs torch
(never a dependency of lpdec).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int, heads: int, mlp_ratio: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.attn_out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp_in, self.mlp_out = nn.Linear(d, mlp_ratio * d), nn.Linear(mlp_ratio * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_out(attended.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp_out(F.gelu(self.mlp_in(self.norm2(x)), approximate="tanh"))


class Transformer(nn.Module):
    def __init__(self, vocab=256, context=64, d=160, layers=4, heads=4, mlp_ratio=4):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d, heads, mlp_ratio) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        # lpdec's initialization (GPT-2's): N(0, 0.02) for the embeddings and the dense
        # kernels, N(0, 0.02 / sqrt(2 layers)) for the two that add to the residual,
        # zero biases.
        for name, parameter in self.named_parameters():
            if name.endswith("bias") or "norm" in name:
                continue
            residual = name.endswith(("attn_out.weight", "mlp_out.weight"))
            nn.init.normal_(parameter, std=0.02 / math.sqrt(2 * layers) if residual else 0.02)
        for name, parameter in self.named_parameters():
            if name.endswith("bias") and "norm" not in name:
                nn.init.zeros_(parameter)

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tokens(tokens) + self.positions(positions)
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.tokens.weight.T  # tied output embedding


class LossLog:
    """The mean training loss over the ranks and each interval of `every` steps (0: none).

    `add` all-reduces once an interval, after the step's timer stopped; `points` holds
    [step, mean loss] (bench/ddp_mlp.py uses it too).
    """

    def __init__(self, every: int, world: int):
        self.every, self.world = every, world
        self.points: list[list[float]] = []
        self.interval: list[float] = []

    def add(self, step: int, loss: float) -> None:
        self.interval.append(loss)
        if self.every and (step + 1) % self.every == 0:
            mean = torch.tensor(sum(self.interval) / len(self.interval))
            dist.all_reduce(mean)
            self.points.append([step + 1, mean.item() / self.world])
            self.interval = []


def _scheduler(optimizer, warm: int, total: int):
    """train.py's learning rate for `optimizer` (its lr the peak): update t = 0, 1, ... at
    optax's linear warm-up joined with cosine_decay_schedule(peak, total - warm)."""

    def factor(t: int) -> float:
        if t < warm:
            return t / warm
        done = min(t - warm, total - warm) / max(1, total - warm)
        return 0.5 * (1 + math.cos(math.pi * done))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--master", required=True, help="ADDR:PORT of rank 0")
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--batch-per-thread", type=int, default=8)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=160)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--data",
        help="an .npy of uint8 windows [N, context + 1] to train on (train.py's x_train: "
        "bench/step_parity.py writes it); default: random bytes (the time only)",
    )
    parser.add_argument(
        "--schedule", type=int, nargs=2, metavar=("WARMUP", "TOTAL"),
        help="train.py's learning rate: linear from 0 over WARMUP steps, then cosine to 0 "
        "at TOTAL (default: constant --lr)",
    )  # fmt: skip
    parser.add_argument(
        "--log-every", type=int, default=0,
        help="record the mean training loss over the ranks and each such interval",
    )  # fmt: skip
    args = parser.parse_args(argv)
    address, port = args.master.rsplit(":", 1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = address, port
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dist.init_process_group("gloo", rank=args.rank, world_size=args.world)
    model = nn.parallel.DistributedDataParallel(
        Transformer(context=args.context, d=args.d_model, layers=args.layers, heads=args.heads)
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = _scheduler(optimizer, *args.schedule) if args.schedule else None
    generator = torch.Generator().manual_seed(args.rank)
    batch = args.threads * args.batch_per_thread
    data = None if args.data is None else torch.from_numpy(np.load(args.data).astype(np.int64))
    times, losses = [], LossLog(args.log_every, args.world)
    for step in range(args.warmup + args.steps):
        if data is None:
            window = torch.randint(0, 256, (batch, args.context + 1), generator=generator)
        else:
            window = data[torch.randint(0, data.shape[0], (batch,), generator=generator)]
        started = time.perf_counter()
        logits = model(window[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), window[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        times.append(time.perf_counter() - started)
        losses.add(step, loss.item())
    dist.destroy_process_group()
    parameters = sum(p.numel() for p in model.module.parameters())
    with open(args.out, "w") as f:
        json.dump(
            {
                "s_per_step": statistics.median(times[args.warmup :]),
                "parameters": parameters,
                "torch": torch.__version__,
                "batch": batch,
                "losses": losses.points,
            },
            f,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
