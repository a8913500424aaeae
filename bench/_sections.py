"""Markdown files written by several bench scripts: each owns the block between its markers."""

from __future__ import annotations

import os
import platform
import subprocess

BENCHMARKS_HEADER = """# lpdec benchmarks

Numbers measured by the scripts in `bench/`. Each section is owned by the
script named in its markers and is rewritten in place when that script runs;
see each section for the command, the machine and the software versions.
"""


def replace_section(path: str | os.PathLike, marker: str, body: str, *, header: str) -> None:
    """Writes `body` between `<!-- marker:start -->` and `<!-- marker:end -->` in `path`.

    The rest of the file is kept; a missing section is appended, a missing file
    is created starting with `header`.
    """
    start, end = f"<!-- {marker}:start -->", f"<!-- {marker}:end -->"
    text = open(path).read() if os.path.exists(path) else header
    block = f"{start}\n{body.strip()}\n{end}"
    if start in text and end in text:
        head, rest = text.split(start, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    with open(path, "w") as f:
        f.write(text)


def versions() -> str:
    """Python, jax, jaxlib, iproute2 and kernel versions, for a section's header line."""
    import jax
    import jaxlib

    try:  # a GPU machine may have no iproute2
        iproute = subprocess.run(["ip", "-V"], capture_output=True, text=True).stdout.strip()
    except FileNotFoundError:
        iproute = "no iproute2"
    return (
        f"Python {platform.python_version()}, jax {jax.__version__}, jaxlib {jaxlib.__version__}, "
        f"{iproute}, Linux {platform.release()}"
    )
