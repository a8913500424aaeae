"""The supported range that pyproject.toml states is the range CI tests.

`.ci/run` installs `.ci/oldest.txt` on Python 3.11 as the oldest supported
combination, so that file must pin every direct dependency (and every dependency of
the test extra) at exactly the lower bound pyproject.toml states; and jax, jaxlib and
Python must have upper bounds, so that pip never resolves a combination CI has not run.
"""

import os
import pathlib
import re
import subprocess
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
REQUIREMENT = re.compile(r"^([A-Za-z0-9_.\-]+)\s*(.*)$")


def _name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _bounds(requirements: list[str]) -> dict[str, dict[str, str]]:
    """{name: {operator: version}} of requirements such as 'jax>=0.10.2,<0.13'."""
    out = {}
    for requirement in requirements:
        name, spec = REQUIREMENT.match(requirement).groups()
        clauses = [c.strip() for c in spec.split(",") if c.strip()]
        out[_name(name)] = dict(re.match(r"(>=|<=|==|<|>|!=)\s*(.+)", c).groups() for c in clauses)
    return out


def _pinned() -> dict[str, str]:
    lines = (ROOT / ".ci" / "oldest.txt").read_text().splitlines()
    pins = [line.split("#")[0].strip() for line in lines]
    return {_name(n): v for n, v in (p.split("==") for p in pins if p)}


def _extra(name: str) -> list[str]:
    """The requirements of extra `name`, with the extras it names of lpdec itself
    ("lpdec[train]") replaced by their own requirements."""
    out = []
    for requirement in PROJECT["optional-dependencies"][name]:
        own = re.fullmatch(r"lpdec\[([\w,\s-]+)\]", requirement)
        if own:
            out += [r for e in own.group(1).split(",") for r in _extra(e.strip())]
        else:
            out.append(requirement)
    return out


def _declared() -> dict[str, dict[str, str]]:
    return _bounds(PROJECT["dependencies"] + _extra("test"))


def test_oldest_pins_every_dependency_at_its_lower_bound():
    lower = {name: ops[">="] for name, ops in _declared().items()}
    assert _pinned() == lower


def test_the_core_needs_only_the_designs_packages():
    # The library's own dependencies (issue 50): what train.py and bench add is in extras.
    core = {"jax", "jaxlib", "flax", "optax", "chex", "absl-py", "numpy"}
    assert set(_bounds(PROJECT["dependencies"])) == core
    train = {"ml-collections", "orbax-checkpoint", "scikit-learn", "tensorboardx", "tqdm"}
    assert set(_bounds(_extra("train"))) == train
    assert train <= set(_bounds(_extra("test"))), "the tests run train.py: test needs train"


def test_every_lpdec_module_imports_without_the_extras():
    # Each extra's top-level module made unimportable (None in sys.modules raises
    # ImportError); .ci/run checks the same in an environment without them.
    blocked = ["ml_collections", "orbax", "sklearn", "tensorboardX", "tqdm", "matplotlib"]
    blocked += ["cryptography", "train_lib"]
    program = f"""
import importlib, pkgutil, sys
for name in {blocked!r}:
    sys.modules[name] = None
import lpdec
names = [m.name for m in pkgutil.walk_packages(lpdec.__path__, "lpdec.")]
for name in names:
    importlib.import_module(name)
print(len(names))
"""
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    done = subprocess.run(
        [sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[-1]) > 50  # the walk found the package's modules


def test_jax_jaxlib_and_python_have_upper_bounds():
    declared = _declared()
    for name in ("jax", "jaxlib"):
        assert "<" in declared[name], f"{name} needs an upper bound: {declared[name]}"
        assert declared[name][">="] == declared["jax"][">="]
    python = dict(re.findall(r"(>=|<)\s*([\d.]+)", PROJECT["requires-python"]))
    # .ci/run builds the oldest environment on Python 3.11.
    assert python.get(">=") == "3.11" and "<" in python, PROJECT["requires-python"]
