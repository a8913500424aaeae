"""The public API is the one list in lpdec/__init__.py (docs/DESIGN.md, "Public API")."""

import importlib
import inspect
import pkgutil

import lpdec
import lpdec.algorithms


def algorithm_modules():
    for info in pkgutil.iter_modules(lpdec.algorithms.__path__):
        if not info.name.startswith("_"):
            yield importlib.import_module(f"lpdec.algorithms.{info.name}")


def test_every_state_class_and_health_is_exported():
    defined = {
        name
        for module in algorithm_modules()
        for name, obj in vars(module).items()
        if inspect.isclass(obj) and obj.__module__ == module.__name__ and hasattr(obj, "_fields")
    }
    assert {"Health", "ChocoState", "DCDState"} <= defined
    assert defined <= set(lpdec.__all__)
    for name in defined:
        assert getattr(lpdec, name).__name__ == name


def test_every_algorithm_module_exports_its_factory():
    for module in algorithm_modules():
        name = module.__name__.rsplit(".", 1)[1]
        if name == "health":
            continue
        assert getattr(lpdec, name) is getattr(module, name)


def test_all_is_sorted_and_complete():
    assert lpdec.__all__ == sorted(lpdec.__all__)
    assert all(hasattr(lpdec, name) for name in lpdec.__all__)


def test_every_state_class_has_a_place_in_the_chain_check():
    """lpdec.check_chain reads the order from the states: a new algorithm's state must be
    classified there (gossip last, mean first, whole optimizer) or be local."""
    from lpdec.algorithms import local_apply_if_finite as chain_lib  # noqa: PLC0415

    local = {
        "Health",
        "LocalIfFiniteState",
        "QGMomentumState",
        "DelayState",
        "ShardOverState",
        "MasterWeightsState",
    }
    classified = chain_lib.GOSSIP_STATES + chain_lib.MEAN_STATES + chain_lib.WHOLE_STATES
    for module in algorithm_modules():
        for name, obj in vars(module).items():
            if (
                inspect.isclass(obj)
                and obj.__module__ == module.__name__
                and hasattr(obj, "_fields")
            ):
                assert name in local or issubclass(obj, classified), name
