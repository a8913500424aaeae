"""Each lpdec module imports only the layers below it (docs/DESIGN.md, "Layers").

The table is the one in DESIGN.md: a new module must be placed in it, so the
document and the code cannot drift apart silently. And no package reaches into
another one's private modules or names: what a package offers the others is
what it names without a leading underscore.
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
    "lpdec.host_sum": (),
    # local_sum routes a sum over the processes through the installed host sum.
    "lpdec.gossip": ("lpdec.wire", "lpdec.host_sum", "lpdec.compress", "lpdec.topology"),
    "lpdec.algorithms": (
        "lpdec.gossip",
        "lpdec.wire",
        "lpdec.compress",
        "lpdec.kernels_pallas",
        "lpdec.topology",
    ),
    "lpdec.metrics": (),
    # The exact AD-PSGD simulator: edges from a topology, Moniqua's modulo compressor.
    "lpdec.async_sim": ("lpdec.compress", "lpdec.topology"),
    # init_nodes checks the chain it initialises (check_chain reads the algorithms' states).
    "lpdec.layout": ("lpdec.gossip", "lpdec.algorithms"),
    # The traffic meter counts the gathers a step sends.
    "lpdec.fsdp": ("lpdec.wire",),
    "lpdec.testing": ("lpdec.gossip", "lpdec.layout"),
    "lpdec.nn": ("lpdec.compress", "lpdec.kernels_pallas"),
    "lpdec.models": ("lpdec.nn",),
    "lpdec.data": (),
    "lpdec.elastic": (),
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


# ----------------------------------------------------------------------------
# Private modules and names stay inside their package.
# ----------------------------------------------------------------------------

# The code that must keep to other packages' public names (tests/ may use privates).
APPLICATION = [PACKAGE / "__init__.py", *MODULES, *sorted((ROOT / "train_lib").rglob("*.py"))]
APPLICATION += [*sorted((ROOT / "bench").rglob("*.py")), ROOT / "train.py"]
OURS = ("lpdec", "train_lib", "bench", "train")
# NamedTuple's own API starts with an underscore; calling it is public use.
NAMEDTUPLE_API = {"_replace", "_make", "_asdict", "_fields", "_field_defaults"}


def package_of(name: str) -> str:
    """The package a dotted name is in: lpdec's subpackage or top-level module, or ours.

    `lpdec/_edge_coloring.py` is topology's own helper: the two share a row of the
    layer table.
    """
    parts = name.split(".")
    if parts[0] != "lpdec" or len(parts) == 1:
        return parts[0]
    return "lpdec.topology" if parts[1] == "_edge_coloring" else f"lpdec.{parts[1]}"


def is_private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__") and part not in NAMEDTUPLE_API


def referenced_names(path: pathlib.Path):
    """(line, dotted name) of what `path` imports from our packages and reads through it.

    An attribute read through an imported name counts as its full dotted name:
    `kernels._common.rounded` after `from lpdec import kernels_pallas as kernels`.
    """
    tree = ast.parse(path.read_text())
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in OURS:
                    yield node.lineno, a.name
                    local = a.asname or a.name.split(".")[0]
                    bound[local] = a.name if a.asname else local
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] in OURS:
                for a in node.names:
                    yield node.lineno, f"{node.module}.{a.name}"
                    bound[a.asname or a.name] = f"{node.module}.{a.name}"
    for node in ast.walk(tree):
        attrs = []
        while isinstance(node, ast.Attribute):
            attrs.append(node.attr)
            node = node.value
        if attrs and isinstance(node, ast.Name) and node.id in bound:
            yield node.lineno, ".".join([bound[node.id], *reversed(attrs)])


def private_references(path: pathlib.Path) -> list[str]:
    """What `path` uses of another package's private modules and names, one line each."""
    relative = path.relative_to(ROOT)
    own = package_of(module_name(path))
    found = set()
    for line, name in referenced_names(path):
        parts = name.split(".")
        first = next((i for i, part in enumerate(parts) if is_private(part)), None)
        if first is not None and package_of(name) != own:
            found.add((line, ".".join(parts[: first + 1])))
    return [f"{relative}:{line} uses {name}" for line, name in sorted(found)]


@pytest.mark.parametrize("path", APPLICATION, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_package_uses_another_packages_privates(path):
    found = private_references(path)
    assert not found, "private to another package: " + "; ".join(found)
