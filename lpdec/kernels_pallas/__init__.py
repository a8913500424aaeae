"""Pallas kernels, each beside its jnp reference, and the one op that picks between them.

For each op there are three names:

* `<op>`: what callers use. It takes the caller's array and runs the compiled
  Pallas kernel on GPU and TPU where that platform's compiler accepts the
  blocks, and jnp elsewhere, chosen per lowering platform; `implementation=`
  ("xla": jnp everywhere, "pallas": the kernel everywhere, interpreted on CPU)
  overrides it (docs/DESIGN.md, "Kernels per platform").
* `<op>_pallas`: the Pallas kernel, on the kernel's layout: [rows, chunk] for
  min-max, [rows, width] for modulo, [groups, 8] codes and [groups, bits] bytes
  for bit packing.
* `<op>_reference`: its jnp reference on the same layout, the single source of
  truth: the kernel matches it bit for bit, and so does `<op>`.

Beside them are the rules every caller shares: `check_bits` (code widths 1..8),
`check_implementation` (`IMPLEMENTATIONS`), the hash seeds of stochastic
rounding (`seeds_from_key`), and the rounding helpers that keep arithmetic
outside a kernel bit-exact (`rounded`, `round_up_significand`).

Each op has the same modules (docs/DESIGN.md, "Layers"): `<op>.py` (the public op
and its row kernels), `<op>_gpu.py` (the GPU's flat kernels) and `<op>_jnp.py`
(the shared arithmetic and the reference). Inside the package the modules
compose each other's `<op>_on` functions (an op for one `platforms.Target`) and
`_blocks`' layout helpers: those are package-internal (each module's docstring
names its own, and leaves them out of its `__all__`).
"""

from lpdec.kernels_pallas.bitpack import pack_bits
from lpdec.kernels_pallas.bitpack import pack_pallas as pack_bits_pallas
from lpdec.kernels_pallas.bitpack import pack_reference as pack_bits_reference
from lpdec.kernels_pallas.bitpack import packed_size
from lpdec.kernels_pallas.bitpack import unpack_bits
from lpdec.kernels_pallas.bitpack import unpack_pallas as unpack_bits_pallas
from lpdec.kernels_pallas.bitpack import unpack_reference as unpack_bits_reference
from lpdec.kernels_pallas.minmax import dequantize as minmax_dequantize
from lpdec.kernels_pallas.minmax import dequantize_accumulate as minmax_dequantize_accumulate
from lpdec.kernels_pallas.minmax import (
    dequantize_accumulate_pallas as minmax_dequantize_accumulate_pallas,
)
from lpdec.kernels_pallas.minmax import (
    dequantize_accumulate_reference as minmax_dequantize_accumulate_reference,
)
from lpdec.kernels_pallas.minmax import dequantize_pallas as minmax_dequantize_pallas
from lpdec.kernels_pallas.minmax import dequantize_reference as minmax_dequantize_reference
from lpdec.kernels_pallas.minmax import quantize as minmax_quantize
from lpdec.kernels_pallas.minmax import quantize_packed as minmax_quantize_packed
from lpdec.kernels_pallas.minmax import quantize_pallas as minmax_quantize_pallas
from lpdec.kernels_pallas.minmax import quantize_reference as minmax_quantize_reference
from lpdec.kernels_pallas.minmax_feedback import quantize_feedback as minmax_quantize_feedback
from lpdec.kernels_pallas.minmax_feedback import (
    quantize_feedback_packed as minmax_quantize_feedback_packed,
)
from lpdec.kernels_pallas.minmax_tree import quantize_leaves as minmax_quantize_leaves
from lpdec.kernels_pallas.minmax_tree import quantize_tree_packed as minmax_quantize_tree_packed
from lpdec.kernels_pallas.modulo import encode as modulo_encode
from lpdec.kernels_pallas.modulo import encode_pallas as modulo_encode_pallas
from lpdec.kernels_pallas.modulo import encode_reference as modulo_encode_reference
from lpdec.kernels_pallas.numerics import check_bits
from lpdec.kernels_pallas.numerics import round_up_significand
from lpdec.kernels_pallas.numerics import rounded
from lpdec.kernels_pallas.numerics import seeds_from_key
from lpdec.kernels_pallas.platforms import IMPLEMENTATIONS
from lpdec.kernels_pallas.platforms import Implementation
from lpdec.kernels_pallas.platforms import check_implementation

__all__ = [
    "IMPLEMENTATIONS",
    "Implementation",
    "check_bits",
    "check_implementation",
    "minmax_dequantize",
    "minmax_dequantize_accumulate",
    "minmax_dequantize_accumulate_pallas",
    "minmax_dequantize_accumulate_reference",
    "minmax_dequantize_pallas",
    "minmax_dequantize_reference",
    "minmax_quantize",
    "minmax_quantize_packed",
    "minmax_quantize_feedback",
    "minmax_quantize_feedback_packed",
    "minmax_quantize_leaves",
    "minmax_quantize_pallas",
    "minmax_quantize_reference",
    "minmax_quantize_tree_packed",
    "modulo_encode",
    "modulo_encode_pallas",
    "modulo_encode_reference",
    "pack_bits",
    "pack_bits_pallas",
    "pack_bits_reference",
    "packed_size",
    "round_up_significand",
    "rounded",
    "seeds_from_key",
    "unpack_bits",
    "unpack_bits_pallas",
    "unpack_bits_reference",
]
