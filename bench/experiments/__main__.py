"""`python -m bench.experiments STUDY... [--quick] [--render]` (see bench/experiments/)."""

import os

# Before any jax computation: the studies simulate 8 nodes on 8 CPU devices.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from bench.experiments.cli import main  # noqa: E402

main()
