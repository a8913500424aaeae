"""PyTorch DDP on configs/link_mlp.py's model: the like-for-like baseline of bench/step_parity.py.

    python bench/ddp_mlp.py --rank R --world 2 --master 127.0.0.1:29500 --threads 1 \\
        --data /tmp/mnist1d.npz --batch 128 --steps 200 --out /tmp/ddp_mlp_R.json

Each process holds the whole model: link_mlp's MLP without its norm layers
(`config.norm="none"`: Dense with bias then ReLU per hidden layer, 40 -> 1024 ->
1024 -> 10, 1,101,834 parameters), initialized as flax does (LeCun normal
kernels, truncated at 2 standard deviations, zero biases). It trains with
Nesterov SGD (`--lr`, momentum 0.9, weight decay `--weight-decay` added to the
gradient, as optax.add_decayed_weights before optax.sgd) on `--batch` random rows
of the .npz's x_train / y_train a step, and all-reduces the gradients over gloo
in DDP's buckets. Writes `--out`: seconds per step (median), parameters, and with
`--log-every` the mean training loss over the ranks and each interval.
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
from ddp_lm import LossLog  # bench/, the script's directory, is on the path
from torch import nn


def mlp(inputs: int, hidden: tuple[int, ...], classes: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for width in hidden:
        layers += [nn.Linear(inputs, width), nn.ReLU()]
        inputs = width
    layers.append(nn.Linear(inputs, classes))
    model = nn.Sequential(*layers)
    for layer in model:
        if isinstance(layer, nn.Linear):
            # flax's lecun_normal: variance 1 / fan_in, a normal truncated at +-2 sd,
            # its sd corrected for the truncation (0.8796...).
            std = math.sqrt(1.0 / layer.in_features) / 0.87962566103423978
            nn.init.trunc_normal_(layer.weight, std=std, a=-2 * std, b=2 * std)
            nn.init.zeros_(layer.bias)
    return model


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--master", required=True, help="ADDR:PORT of rank 0")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--data", required=True, help=".npz with x_train, y_train")
    parser.add_argument("--hidden", type=int, nargs="+", default=[1024, 1024])
    parser.add_argument("--batch", type=int, default=128, help="rows a process and step")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--weight-decay", type=float, default=1e-4)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--log-every", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    address, port = args.master.rsplit(":", 1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = address, port
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dist.init_process_group("gloo", rank=args.rank, world_size=args.world)
    data = np.load(args.data)
    x = torch.from_numpy(data["x_train"].reshape(len(data["x_train"]), -1).astype(np.float32))
    y = torch.from_numpy(data["y_train"].astype(np.int64))
    model = nn.parallel.DistributedDataParallel(mlp(x.shape[1], tuple(args.hidden), 10))
    optimizer = torch.optim.SGD(
        model.parameters(), lr=args.lr, momentum=0.9, nesterov=True,
        weight_decay=args.weight_decay,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(args.rank)
    times, losses = [], LossLog(args.log_every, args.world)
    for step in range(args.steps):
        rows = torch.randint(0, x.shape[0], (args.batch,), generator=generator)
        started = time.perf_counter()
        loss = F.cross_entropy(model(x[rows]), y[rows])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - started)
        losses.add(step, loss.item())
    dist.destroy_process_group()
    with open(args.out, "w") as f:
        json.dump(
            {
                "s_per_step": statistics.median(times[1:]),
                "parameters": sum(p.numel() for p in model.module.parameters()),
                "torch": torch.__version__,
                "batch": args.batch,
                "losses": losses.points,
            },
            f,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
