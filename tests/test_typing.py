"""Types that users' tools see.

mypy on lpdec itself is clean with mypy's defaults (pyproject.toml, [tool.mypy]); and
after the README's install, mypy run on a user's file (no MYPYPATH, no PYTHONPATH) finds
lpdec, reads its annotations (py.typed) and reports a call with a wrong argument type.
The install is the README's own command, run by pip into a fresh virtual environment
that borrows this environment's packages (jax, mypy, setuptools: a .pth file lists
their directories) and builds lpdec without build isolation, so offline and in seconds.
"""

import os
import pathlib
import re
import shlex
import subprocess
import sys
import sysconfig

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIRST_COMMAND = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)[1]

# A user's file: the headline API, well used and wrongly used. The last three calls are
# wrong: a string for ring's node count, a MinMax where moniqua needs a Modulo
# compressor (docs/api.md), a string for DiLoCo's local step count.
USER_FILE = """\
import lpdec

reveal_type(lpdec.choco)
reveal_type(lpdec.moniqua)
reveal_type(lpdec.diloco)
reveal_type(lpdec.minmax)
reveal_type(lpdec.ring)
topology = lpdec.ring(8)
compressor = lpdec.minmax(bits=8)
reveal_type(topology)
tx = lpdec.choco(topology, compressor, gamma=0.5, axis_name="nodes")
moniqua = lpdec.moniqua(topology, lpdec.modulo(bits=4), axis_name="nodes")
bad_ring = lpdec.ring("8")
bad_moniqua = lpdec.moniqua(topology, compressor)
bad_diloco = lpdec.diloco(tx, tx, local_steps="10")
"""


def _environment():
    """The environment a subprocess gets: neither PYTHONPATH nor MYPYPATH, which would
    show mypy the worktree's lpdec however (or whether) it was installed."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MYPYPATH")}


def _readme_install_arguments():
    """pip's arguments in README.md's first command (`pip install -e '.[train]'`)."""
    line = next(line for line in FIRST_COMMAND.splitlines() if "pip install" in line)
    words = shlex.split(line.split("pip install", 1)[1].split("&&")[0])
    assert words and all(w.startswith("-") or w.startswith(".") for w in words), line
    return words


def _fresh_environment(path):
    """A virtual environment at `path` that sees this one's packages (but any lpdec)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    python = path / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True, env=_environment(),
    ).stdout.strip()  # fmt: skip
    # This process's import path (site-packages, and a PYTHONPATH entry such as a
    # setuptools) without the directories that hold an lpdec: the worktree itself.
    borrowed = [
        entry
        for entry in sys.path
        if entry and os.path.isdir(entry) and not os.path.exists(os.path.join(entry, "lpdec"))
    ]
    own = pathlib.Path(sysconfig.get_paths()["purelib"])
    assert str(own) in borrowed, f"{own} holds lpdec itself: run in an editable install"
    pathlib.Path(purelib, "_borrowed.pth").write_text("\n".join(borrowed) + "\n")
    return python


def test_lpdec_type_checks_clean_with_mypys_defaults(tmp_path):
    """`mypy` in the project's root checks lpdec ([tool.mypy] files) with no error."""
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache")],
        capture_output=True, text=True, cwd=ROOT, env=_environment(), timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert re.search(r"Success: no issues found in \d+ source files", proc.stdout)


def test_a_users_file_sees_lpdecs_types_after_the_readme_install(tmp_path):
    import setuptools  # the build backend pip runs here, without build isolation

    major = int(setuptools.__version__.split(".")[0])
    assert major >= 77, f"setuptools {setuptools.__version__}: the test extra needs >= 77.0.1"
    python = _fresh_environment(tmp_path / "venv")
    install = [str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index"]
    install += ["--no-build-isolation", "--ignore-installed", *_readme_install_arguments()]
    done = subprocess.run(
        install, capture_output=True, text=True, cwd=ROOT, env=_environment(), timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    user = tmp_path / "user" / "user_program.py"
    user.parent.mkdir()
    user.write_text(USER_FILE)
    # Outside the worktree, no config file (the user's, not lpdec's), this venv's mypy.
    proc = subprocess.run(
        [str(python), "-m", "mypy", "--config-file", "", "--cache-dir", str(tmp_path / "cache"),
         user.name],
        capture_output=True, text=True, cwd=user.parent, env=_environment(), timeout=600,
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    lines = USER_FILE.splitlines()
    # {the expression revealed: its type}
    revealed = {
        lines[int(n) - 1].removeprefix("reveal_type(").removesuffix(")"): kind
        for n, kind in re.findall(r":(\d+): note: Revealed type is \"(.*)\"", output)
    }
    errors = re.findall(r":(\d+): error: (.*)", output)

    # The names resolve to their signatures, lpdec's own types in them.
    choco, moniqua, diloco, minmax, ring, topology = (
        revealed.get(name)
        for name in ("lpdec.choco", "lpdec.moniqua", "lpdec.diloco", "lpdec.minmax", "lpdec.ring",
                     "topology")
    )  # fmt: skip
    assert choco and choco.startswith("def (topology: lpdec.topology.Topology, compressor: "), (
        output
    )
    assert "lpdec.compress.base.Compressor" in choco and "gamma: " in choco, output
    assert moniqua and "compressor: lpdec.compress.modulo_quantizer.Modulo" in moniqua, output
    assert diloco and "local_steps: int" in diloco, output
    assert minmax and "bits: int =" in minmax, output
    assert ring and ring.startswith("def (n: int) -> lpdec.topology.Topology"), output
    assert topology == "lpdec.topology.Topology", output
    # Exactly the three wrong calls are reported, each where it is.
    assert [lines[int(n) - 1].split(" = ")[0] for n, _ in errors] == [
        "bad_ring",
        "bad_moniqua",
        "bad_diloco",
    ], output
    assert 'Argument 1 to "ring" has incompatible type "str"; expected "int"' in errors[0][1]
    assert 'incompatible type "MinMax"; expected "Modulo"' in errors[1][1]
    assert 'Argument "local_steps" to "diloco" has incompatible type "str"' in errors[2][1]


def test_the_readme_installs_the_train_extra_in_its_first_command():
    # One command installs what train.py needs (pyproject.toml's train extra).
    assert any(w.endswith("[train]") for w in _readme_install_arguments()), FIRST_COMMAND
