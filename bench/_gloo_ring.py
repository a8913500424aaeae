"""A ring all-reduce of one payload's bytes with PyTorch's gloo: bench/elastic_scale.py's reference.

Run by bench/elastic_scale.py with a Python that has torch (`--torch-python`), one
process per machine:

    python bench/_gloo_ring.py RANK WORLD HOST:PORT NUMEL ROUNDS OUT.json

Writes {"times": [seconds of each all-reduce after a barrier]} to OUT.json (the first
is a warm-up). gloo's CPU all-reduce of a large buffer is its ring algorithm
(reduce-scatter then all-gather, 2 (n - 1) / n of the buffer each way per rank).
"""

import json
import sys
import time

import torch
import torch.distributed as dist


def main(argv: list[str]) -> None:
    rank, world, address, numel, rounds, out = argv
    rank, world, numel, rounds = int(rank), int(world), int(numel), int(rounds)
    dist.init_process_group("gloo", init_method=f"tcp://{address}", rank=rank, world_size=world)
    tensor = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    times = []
    for _ in range(rounds + 1):
        dist.barrier()
        started = time.monotonic()
        dist.all_reduce(tensor)
        times.append(time.monotonic() - started)
        tensor /= world
    dist.barrier()
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump({"times": times}, f)


if __name__ == "__main__":
    main(sys.argv[1:])
