"""The README's code blocks marked <!-- test:exec --> run as written."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"<!-- test:exec -->\n```python\n(.*?)```", README.read_text(), re.S)


def test_readme_has_executable_blocks():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("block", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_block_runs(block):
    exec(compile("import optax\nimport lpdec\n" + block, str(README), "exec"), {})
