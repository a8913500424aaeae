"""The public API comes from the algorithm modules' declarations (docs/DESIGN.md, "Public API")."""

import ast
import dataclasses
import importlib
import inspect
import pathlib
import pkgutil

import pytest

import lpdec
import lpdec.algorithms
from lpdec.algorithms import declaration

# Modules of lpdec.algorithms that are not algorithms (no DECLARATION).
NOT_ALGORITHMS = {"declaration", "chain_order", "health"}


def algorithm_modules():
    for info in pkgutil.iter_modules(lpdec.algorithms.__path__):
        if not info.name.startswith("_") and info.name not in NOT_ALGORITHMS:
            yield importlib.import_module(f"lpdec.algorithms.{info.name}")


def defined_state_classes(module):
    return {
        obj
        for obj in vars(module).values()
        if inspect.isclass(obj) and obj.__module__ == module.__name__ and hasattr(obj, "_fields")
    }


def test_every_algorithm_module_declares_itself_and_is_collected():
    modules = list(algorithm_modules())
    assert len(modules) >= 16
    declared = [module.DECLARATION for module in modules]
    assert all(isinstance(d, declaration.Declaration) for d in declared)
    assert set(declared) == set(lpdec.algorithms.declarations())
    for module in modules:
        name = module.__name__.rsplit(".", 1)[1]
        assert module.DECLARATION.factory is getattr(module, name)


def test_every_state_class_and_health_is_exported():
    defined = {"Health"} | {
        cls.__name__ for module in algorithm_modules() for cls in defined_state_classes(module)
    }
    assert {"Health", "ChocoState", "DCDState"} <= defined
    assert defined <= set(lpdec.__all__)
    for name in defined:
        assert getattr(lpdec, name).__name__ == name


def test_every_algorithm_module_exports_its_factory():
    for module in algorithm_modules():
        name = module.__name__.rsplit(".", 1)[1]
        assert getattr(lpdec, name) is getattr(module, name)


def test_the_statically_imported_names_are_the_declared_ones():
    """lpdec/__init__.py imports every declared factory and state class by name (so mypy
    and editors see them), and nothing injects names at run time: the file's own
    `from ... import` names, read from its syntax tree, are __all__, and each algorithm
    module's are exactly what its declaration exports."""
    tree = ast.parse(pathlib.Path(lpdec.__file__).read_text())
    imported = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                imported[alias.asname or alias.name] = node.module
    assert sorted(imported) == lpdec.__all__
    declared = lpdec.algorithms.exports()
    from_algorithms = {
        name for name, module in imported.items() if module.startswith("lpdec.algorithms.")
    }
    assert from_algorithms - {"chain", "check_chain", "Health"} == set(declared)
    for name, obj in declared.items():
        assert getattr(lpdec, name) is obj, name
    assert not any(
        isinstance(node, ast.Expr) and "globals" in ast.dump(node) for node in tree.body
    ), "lpdec/__init__.py must not add names at run time"


def test_all_is_sorted_and_complete():
    assert lpdec.__all__ == sorted(lpdec.__all__)
    assert len(set(lpdec.__all__)) == len(lpdec.__all__)
    assert all(hasattr(lpdec, name) for name in lpdec.__all__)


def test_every_state_class_has_a_place_in_the_chain_check():
    """lpdec.check_chain reads the order from the states: every state class defined in an
    algorithm module is declared, with a role, by that module."""
    for module in algorithm_modules():
        for cls in defined_state_classes(module):
            assert cls in module.DECLARATION.states, cls.__name__
            assert lpdec.algorithms.role_of(cls) == module.DECLARATION.role


def test_the_roles_are_the_chain_positions_the_papers_give():
    role = {d.name: d.role for d in lpdec.algorithms.declarations()}
    assert {n for n, r in role.items() if r == "mean"} == {"compressed_mean", "local_mean"}
    assert {n for n, r in role.items() if r == "whole"} == {"diloco"}
    assert role["qg_momentum"] == role["delay"] == "local"
    assert role["choco"] == role["dpsgd"] == role["moniqua"] == "gossip"


@pytest.mark.parametrize(
    "declared",
    [d for d in lpdec.algorithms.declarations() if d.hyperparams is not None],
    ids=lambda d: d.name,
)
def test_a_factory_takes_exactly_its_hyperparameter_record(declared):
    """Each hyperparameter is written in the factory's signature and in its record only:
    the names and the defaults must agree, so `Hyperparams(**locals())` passes them all."""
    signature = inspect.signature(declared.factory).parameters
    fields = {f.name: f for f in dataclasses.fields(declared.hyperparams)}
    assert list(signature) == list(fields)
    for name, parameter in signature.items():
        default = fields[name].default
        expected = inspect.Parameter.empty if default is dataclasses.MISSING else default
        assert parameter.default == expected, name


UNIFORM = ("topology", "compressor", "gamma", "axis_name", "seed")


@pytest.mark.parametrize(
    "declared",
    [d for d in lpdec.algorithms.declarations() if d.role in ("gossip", "mean")],
    ids=lambda d: d.name,
)
def test_communicating_factories_take_the_uniform_arguments(declared):
    """(topology, compressor, *, gamma=..., axis_name=..., seed=...), where each exists."""
    parameters = inspect.signature(declared.factory).parameters
    present = [name for name in UNIFORM if name in parameters]
    assert [name for name in parameters if name in UNIFORM] == present
    for name in ("topology", "compressor"):
        if name in parameters:
            assert parameters[name].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD, name
    for name in ("gamma", "axis_name", "seed"):
        if name in parameters:
            assert parameters[name].kind is inspect.Parameter.KEYWORD_ONLY, name


def test_the_training_registry_places_each_algorithm_by_its_declared_role():
    """train_lib's chain positions are the declarations', not a second list."""
    import pathlib  # noqa: PLC0415
    import sys  # noqa: PLC0415

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
    from train_lib import registry  # noqa: PLC0415

    for name, entry in registry.ALGORITHMS.items():
        if entry.factory is None:
            assert name == "none"
            continue
        assert entry.role == lpdec.algorithms.role_of(entry.factory), name
    assert registry.ALGORITHMS["compressed_mean"].role == "mean"
    assert registry.ALGORITHMS["allreduce"].role == "mean"
    assert registry.ALGORITHMS["diloco"].role == "whole"
    assert registry.ALGORITHMS["choco"].role == "gossip"
