"""The supported range that pyproject.toml states is the range CI tests.

`.ci/run` installs `.ci/oldest.txt` on Python 3.11 as the oldest supported
combination, so that file must pin every direct dependency (and every dependency of
the test extra) at exactly the lower bound pyproject.toml states; and jax, jaxlib and
Python must have upper bounds, so that pip never resolves a combination CI has not run.
"""

import pathlib
import re
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


def _declared() -> dict[str, dict[str, str]]:
    return _bounds(PROJECT["dependencies"] + PROJECT["optional-dependencies"]["test"])


def test_oldest_pins_every_dependency_at_its_lower_bound():
    lower = {name: ops[">="] for name, ops in _declared().items()}
    assert _pinned() == lower


def test_jax_jaxlib_and_python_have_upper_bounds():
    declared = _declared()
    for name in ("jax", "jaxlib"):
        assert "<" in declared[name], f"{name} needs an upper bound: {declared[name]}"
        assert declared[name][">="] == declared["jax"][">="]
    python = dict(re.findall(r"(>=|<)\s*([\d.]+)", PROJECT["requires-python"]))
    # .ci/run builds the oldest environment on Python 3.11.
    assert python.get(">=") == "3.11" and "<" in python, PROJECT["requires-python"]
