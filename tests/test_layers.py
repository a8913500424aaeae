"""Each lpdec module imports only the layers below it (docs/DESIGN.md, "Layers").

The table is the one in DESIGN.md: a new module must be placed in it, so the
document and the code cannot drift apart silently.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "lpdec"

# Layer -> the lpdec layers it may import (besides itself). Lowest layers first.
MAY_IMPORT = {
    "lpdec._edge_coloring": (),
    "lpdec.topology": ("lpdec._edge_coloring",),
    "lpdec.kernels_pallas": (),
    "lpdec.compress": ("lpdec.kernels_pallas",),
    "lpdec.wire": (),
    "lpdec.gossip": ("lpdec.wire", "lpdec.compress", "lpdec.topology"),
    "lpdec.algorithms": (
        "lpdec.gossip",
        "lpdec.wire",
        "lpdec.compress",
        "lpdec.kernels_pallas",
        "lpdec.topology",
    ),
    "lpdec.metrics": (),
    # init_nodes checks the chain it initialises (check_chain reads the algorithms' states).
    "lpdec.layout": ("lpdec.gossip", "lpdec.algorithms"),
    "lpdec.testing": ("lpdec.gossip", "lpdec.layout"),
    "lpdec.nn": ("lpdec.compress", "lpdec.kernels_pallas"),
    "lpdec.models": ("lpdec.nn",),
    "lpdec.data": (),
}


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(name: str) -> str | None:
    matches = [layer for layer in MAY_IMPORT if name == layer or name.startswith(layer + ".")]
    return max(matches, key=len) if matches else None


def lpdec_imports(path: pathlib.Path) -> set[str]:
    """Every lpdec module `path` imports, at any depth of the file (lazy imports too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "lpdec")
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "lpdec":
                found.update(f"lpdec.{a.name}" for a in node.names)
            elif node.module.startswith("lpdec."):
                found.add(node.module)
    return found


MODULES = sorted(p for p in PACKAGE.rglob("*.py") if module_name(p) != "lpdec")


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p))
def test_module_imports_only_lower_layers(path):
    name = module_name(path)
    layer = layer_of(name)
    assert layer is not None, f"{name} is in no layer: add it to docs/DESIGN.md and MAY_IMPORT"
    allowed = {layer, *MAY_IMPORT[layer]}
    for imported in lpdec_imports(path):
        target = layer_of(imported)
        assert target in allowed, (
            f"{name} (layer {layer}) imports {imported} (layer {target}); "
            f"it may import only {sorted(allowed)}"
        )


def test_design_doc_lists_every_layer():
    design = (ROOT / "docs" / "DESIGN.md").read_text()
    for layer in MAY_IMPORT:
        assert f"`{layer.replace('.', '/')}" in design, f"docs/DESIGN.md does not list {layer}"
