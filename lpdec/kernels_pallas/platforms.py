"""Where a kernel runs: the `implementation=` choice, the per-platform dispatch, block rules.

Every kernel in this package has a pure-jnp reference that is the single source
of truth and the CPU implementation (the shared element-wise math is in
`numerics`).

Which implementation runs is decided per *lowering platform*, not per
`jax.default_backend()`: `dispatch` stages every choice out with
`jax.lax.platform_dependent`, so a program traced on a CPU-only machine and
lowered for ("cuda",) or ("tpu",) holds the compiled kernels (docs/DESIGN.md,
"Kernels per platform"). `Target` holds what each platform's compiler accepts
and how a kernel is built for it; `_blocks` lays the kernels' operands out.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lpdec.kernels_pallas import _blocks
from lpdec.kernels_pallas._blocks import Block

# Each backend's Pallas module may move or disappear between jax releases (jax 0.11
# deprecates Triton); without it that platform takes the jnp path.
pallas_triton: types.ModuleType | None
pallas_tpu: types.ModuleType | None
try:
    from jax.experimental.pallas import triton as _triton

    pallas_triton = _triton
except ImportError:  # pragma: no cover - depends on the installed jax
    pallas_triton = None
try:
    from jax.experimental.pallas import tpu as _tpu

    pallas_tpu = _tpu
except ImportError:  # pragma: no cover - depends on the installed jax
    pallas_tpu = None

Implementation = Literal["xla", "pallas"] | None
Platform = Literal["cpu", "gpu", "tpu"]

#: The values of every `implementation=` argument (see `dispatch`).
IMPLEMENTATIONS = (None, "xla", "pallas")
_PLATFORMS = ("cpu", "gpu", "tpu")

# Elements per kernel block. Interpreted (CPU) and TPU blocks are large: each grid
# step costs a loop iteration or a pipeline stage, and 2**16 float32 (256 KiB,
# double-buffered in and out) sits well inside TPU VMEM. A Triton program keeps its
# whole block in registers, so GPU blocks are 16x smaller (16 values per thread at
# 8 warps).
_BLOCK_ELEMENTS = {"cpu": 1 << 16, "gpu": 1 << 12, "tpu": 1 << 16}
# Mosaic tiles the last two dims of a TPU block by (rows, 128 lanes), where a tile
# holds 8 rows of 32-bit values: 8 rows of float32, 16 of bfloat16, 32 of uint8.
_TPU_LANES = 128


def check_implementation(implementation) -> None:
    """Raises ValueError unless `implementation` is one of `IMPLEMENTATIONS`."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be None, 'xla' or 'pallas'; got {implementation!r}.")


@dataclasses.dataclass(frozen=True)
class Target:
    """Where a Pallas kernel runs: whose compiled-kernel parameters it uses, and how.

    Attributes:
      platform: "cpu", "gpu" (the Triton lowering) or "tpu" (Mosaic). It sets the
        block size, the compiler parameters and any lowering-specific form of the
        kernel body (see `minmax_jnp.row_min_max`).
      interpret: run the kernel body on XLA one grid step at a time instead of
        compiling it. Pallas has no CPU lowering, so "cpu" is always interpreted;
        tests interpret the "gpu" and "tpu" kernels to check them on CPU.
      num_warps: GPU only, Triton's warps per program; None (the dispatch's
        choice) takes 8 for blocks of 4096 elements or more, else 4.
        `bench/gpu_kernels.py --parts tune` times the others.
    """

    platform: Platform
    interpret: bool = False
    num_warps: int | None = None

    def __post_init__(self):
        if self.platform not in _PLATFORMS:
            raise ValueError(f"platform must be one of {_PLATFORMS}; got {self.platform!r}.")
        if self.platform == "cpu" and not self.interpret:
            object.__setattr__(self, "interpret", True)

    @property
    def block_elements(self) -> int:
        return _BLOCK_ELEMENTS[self.platform]

    def block_rows(self, rows: int, row_length: int, dtypes=(jnp.float32,)) -> int:
        """Rows per block of a [rows, row_length] kernel whose row blocks hold `dtypes`.

        A power of two near `block_elements / row_length`. On TPU a block that does
        not cover every row is a whole number of row tiles of each dtype.
        """
        br = _blocks.block_rows_for(rows, row_length, self.block_elements)
        if self.platform == "tpu" and br < rows:
            tile = max(_tpu_tile_rows(d) for d in dtypes)
            # Fewer rows than a tile: one block of all of them (equal to the array dim).
            br = rows if tile >= rows else max(br, tile)
        return br

    def lowers(self, *blocks: Block) -> bool:
        """Whether this platform's compiler accepts blocks of these shapes.

        Triton needs every block extent to be a power of two. Mosaic needs each of
        a block's last two dims to be a multiple of its dtype's (rows, 128) tile or
        to equal the array's dim. Interpreting accepts anything, but the
        choice must not depend on it: a test interpreting the "gpu" kernel checks
        what a GPU runs.
        """
        if self.platform == "gpu":
            return pallas_triton is not None and all(
                _blocks.is_power_of_two(e) for block, _, _ in blocks for e in block
            )
        if self.platform == "tpu":
            return pallas_tpu is not None and all(_tpu_tiles(*b) for b in blocks)
        return True

    def compiler_params(self, block_elements: int):
        """The one place that chooses each platform's lowering of lpdec's kernels.

        GPU: Triton (jax 0.10 and 0.11; 0.11 deprecates it for Mosaic GPU, whose
        `pallas_call` path is deprecated too and wants warpgroup-shaped kernels).
        Without explicit Triton parameters jax 0.10 picks Mosaic GPU, which rejects
        these kernels' block shapes. The kernels hold no loops, so one stage.
        TPU: every grid step is independent ("parallel" lets a megacore split it).
        """
        if self.platform == "gpu" and pallas_triton is not None:
            warps = self.num_warps or (8 if block_elements >= 4096 else 4)
            return pallas_triton.CompilerParams(num_warps=warps, num_stages=1)
        if self.platform == "tpu" and pallas_tpu is not None:
            return pallas_tpu.CompilerParams(dimension_semantics=("parallel",))
        return None

    def scalar_spec(self, shape: tuple[int, ...]):
        """BlockSpec of a small array every grid step reads whole (seeds, a scale).

        On TPU it lives in scalar memory (SMEM), where a kernel reads single values.
        """
        if self.platform == "tpu" and pallas_tpu is not None:
            return pl.BlockSpec(memory_space=pallas_tpu.SMEM)
        return _blocks.whole(shape)

    def pallas_call(self, kernel, *, block_elements: int, **kwargs):
        """`pl.pallas_call` with this target's interpret mode and compiler parameters."""
        return pl.pallas_call(
            kernel,
            interpret=self.interpret,
            compiler_params=None if self.interpret else self.compiler_params(block_elements),
            **kwargs,
        )


def _tpu_tile_rows(dtype) -> int:
    return 8 * 4 // _blocks.np_dtype(dtype).itemsize


def _tpu_tiles(block: tuple[int, ...], shape: tuple[int, ...], dtype) -> bool:
    last_two = list(zip(block, shape, strict=True))[-2:]
    tiles = [_tpu_tile_rows(dtype), _TPU_LANES][-len(last_two) :]
    return all(b == s or b % t == 0 for (b, s), t in zip(last_two, tiles, strict=True))


def _per_platform(body: Callable, args, *, gpu, tpu, other):
    on_gpu = functools.partial(body, target=gpu)
    return jax.lax.platform_dependent(
        *args,
        cuda=on_gpu,
        rocm=on_gpu,
        tpu=functools.partial(body, target=tpu),
        default=functools.partial(body, target=other),
    )


def on_each_platform(body: Callable, *args, interpret: bool = False):
    """`body(*args, target=...)` with the Pallas target of the lowering platform.

    CUDA and ROCm get the "gpu" target, TPU the "tpu" one (interpreted when
    `interpret`), and CPU and any other platform the interpreted "cpu" target.
    """
    return _per_platform(
        body,
        args,
        gpu=Target("gpu", interpret),
        tpu=Target("tpu", interpret),
        other=Target("cpu", True),
    )


def dispatch(implementation: Implementation, body: Callable, *args, interpret: bool = False):
    """`body(*args, target=...)` with the target `implementation` picks per lowering platform.

    `body` runs the jnp path for `target=None`; for a `Target` it runs the Pallas
    kernel, or the jnp path where `target.lowers` rejects the kernel's blocks. The
    choice is staged out with `jax.lax.platform_dependent`: an eager call runs the
    default backend's branch only; under `jax.jit` every branch is traced and
    lowering keeps the lowering platform's.

    Args:
      implementation: "xla": the jnp path everywhere. "pallas": the kernel on every
        platform, interpreted on CPU. None: jnp on CPU (and platforms Pallas cannot
        compile for), the compiled kernel on GPU and TPU.
      body: callable(*args, target=Target | None).
      *args: arrays (or pytrees of arrays) passed to `body`.
      interpret: interpret the kernel wherever one runs (tests).
    """
    check_implementation(implementation)
    if implementation == "xla":
        return body(*args, target=None)
    if implementation == "pallas":
        return on_each_platform(body, *args, interpret=interpret)
    return _per_platform(
        body,
        args,
        gpu=Target("gpu", interpret),
        tpu=Target("tpu", interpret),
        other=None,
    )
