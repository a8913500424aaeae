"""The documentation's code blocks marked <!-- test:exec --> run as written, and its
links resolve.

The pages are README.md and every docs/*.md. README's first block is a complete
training program; what it prints is compared, line for line, with what the README says
it prints (on both CI legs: .ci/compat-tests.txt names these tests), and its accuracy
is checked against a model trained centrally on the same data and reported in the test
output (stderr, which pytest-xdist workers pass through, and the JUnit properties).
Every other marked block, on any page, runs as a test of its own, named after its page
and its place there.
"""

import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
# docs/DESIGN.md is the API contract, not a page a user runs: its one python block is a
# sketch whose names (params, loss_fn) are the reader's. It is left out of the rule that
# every python block runs in CI or says why not; its marked blocks, if any, still run.
CONTRACT = ROOT / "docs" / "DESIGN.md"
# README.md held this many marked blocks before docs/ was split from it; none may be lost.
BLOCKS_BEFORE_THE_SPLIT = 4
MAX_README_LINES = 260
TEXT = README.read_text()
EXEC = re.compile(r"<!-- test:exec -->\n```python\n(.*?)```", re.S)


def _name(page):
    return page.relative_to(ROOT).as_posix()


def _marked_blocks(page):
    return EXEC.findall(page.read_text())


# (page, index on the page, code) of every marked block; OTHERS leaves out README's first.
BLOCKS = [(page, i, code) for page in PAGES for i, code in enumerate(_marked_blocks(page))]
FIRST = _marked_blocks(README)[0]
OTHERS = [block for block in BLOCKS if block[:2] != (README, 0)]
AVERAGED = re.compile(r"step 300: test accuracy of the averaged model (\d\.\d+)")
OWN = re.compile(r"mean test accuracy of the nodes' own models: (\d\.\d+)")
# What the README says the first program prints, read from its text: the test compares
# every line, at the README's precision, on both CI legs (jax 0.10.2 and the newest).
PRINTED = re.search(r"It prints, on 1 device[^\n]*:\n\n```text\n(.*?)```", TEXT, re.S)[1]


def _figures(printed):
    return float(AVERAGED.search(printed)[1]), float(OWN.search(printed)[1])


def test_the_pages_hold_every_executable_block():
    """None was lost when docs/ was split from README.md, which keeps the first program."""
    assert len(BLOCKS) >= BLOCKS_BEFORE_THE_SPLIT
    assert _marked_blocks(README)


@pytest.mark.parametrize("page", [p for p in PAGES if p != CONTRACT], ids=_name)
def test_every_python_block_runs_in_ci_or_says_why_not(page):
    text = page.read_text()
    blocks = re.findall(r"(.*)\n```python\n((?s:.*?))```", text)
    assert len(blocks) >= len(_marked_blocks(page))
    for marker, body in blocks:
        runs = marker == "<!-- test:exec -->"
        message = f"{_name(page)} block not run in CI: {body[:80]!r}"
        assert runs or "# not run in CI:" in body, message


@pytest.mark.parametrize(
    "page, code", [(p, c) for p, _, c in OTHERS], ids=[f"{_name(p)}-block{i}" for p, i, _ in OTHERS]
)
def test_doc_block_runs(page, code):
    exec(compile("import optax\nimport lpdec\n" + code, str(page), "exec"), {})


def test_the_documented_programs_type_check(tmp_path):
    """Every marked block, as the test above runs it, passes mypy against lpdec's own
    annotations (lpdec ships py.typed; optax and jax's other untyped neighbours are
    skipped): a name lpdec does not export statically, or a call that does not match
    a signature, fails here as it would in a user's editor. A call with a wrong
    argument type, checked in the same run, must be reported: with lpdec not found or
    not analysed (every name Any) the test fails."""
    files = []
    for page, i, code in BLOCKS:
        path = tmp_path / f"{page.stem}_{i}.py"
        path.write_text("import optax\nimport lpdec\n" + code)
        files.append(str(path))
    wrong = tmp_path / "wrong_call.py"
    wrong.write_text("import lpdec\nlpdec.choco(lpdec.minmax(bits=8), lpdec.ring(8))\n")
    assert (ROOT / "lpdec" / "py.typed").exists()
    # lpdec's modules are analysed; the libraries under them are not (skipped, their
    # names typed Any): analysing jax, numpy and flax took 3/4 of the test's time and
    # checks nothing of lpdec's API. Only they may be missing: lpdec not found is an error.
    skipped = "jax,jaxlib,flax,optax,numpy,orbax,chex,ml_collections,scipy,absl,etils"
    modules = ",".join(f"{m},{m}.*" for m in skipped.split(","))
    (tmp_path / "mypy.ini").write_text(
        "[mypy]\nfollow_imports = silent\n"
        f"[mypy-{modules}]\nfollow_imports = skip\nignore_missing_imports = True\n"
    )
    env = dict(os.environ, MYPYPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(tmp_path / "mypy.ini"),
         "--cache-dir", str(tmp_path / "cache"), *files, str(wrong)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600,
    )  # fmt: skip
    errors = [line for line in proc.stdout.splitlines() if ": error:" in line]
    expected = 'wrong_call.py:2: error: Argument 1 to "choco" has incompatible type "MinMax"'
    output = proc.stdout[-3000:] + proc.stderr[-2000:]
    assert [e for e in errors if not e.startswith("wrong_call.py")] == [], output
    assert any(e.startswith(expected) for e in errors), output


def _github_anchor(heading):
    """The fragment GitHub gives a heading: lower case, punctuation dropped, spaces to -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_github_anchor(h) for h in re.findall(r"^#+ (.*)$", text, re.M)}


def _relative_links(page):
    """The targets of the page's markdown links and images, outside code, but web links."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    return [t for t in targets if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_relative_link_resolves(page):
    for link in _relative_links(page):
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        assert target.exists(), f"{_name(page)} links {link!r}: no such file"
        if anchor and target.suffix == ".md":
            assert anchor in _anchors(target), f"{_name(page)} links {link!r}: no such heading"


def test_the_readme_is_short_and_links_every_docs_page():
    assert len(TEXT.splitlines()) <= MAX_README_LINES
    linked = {(ROOT / link.partition("#")[0]).resolve() for link in _relative_links(README)}
    for page in DOCS:
        assert page.resolve() in linked, f"README.md does not link {_name(page)}"


def _central_accuracy(x, y, x_test, y_test, steps):
    """The first program's model and optimizer on one node holding all the data."""
    d, classes = x.shape[-1], 10
    x, y = jnp.asarray(x).reshape(-1, d), jnp.asarray(y).reshape(-1)

    def loss_fn(params):
        logits = x @ params["w"] + params["b"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    opt = optax.sgd(0.1, momentum=0.9)

    def step(carry, _):
        params, state = carry
        updates, state = opt.update(jax.grad(loss_fn)(params), state)
        return (optax.apply_updates(params, updates), state), None

    params = {"w": jnp.zeros((d, classes)), "b": jnp.zeros(classes)}
    params, _ = jax.lax.scan(step, (params, opt.init(params)), length=steps)[0]
    logits = x_test @ np.asarray(params["w"]) + np.asarray(params["b"])
    return float(np.mean(np.argmax(logits, -1) == y_test))


def _report(record_property, capsys, name, value):
    record_property(name, value)
    # Visible in CI logs for a passing test, with or without -s: past pytest's capture,
    # on the process's stderr, which pytest-xdist workers share with the main process.
    with capsys.disabled():
        print(f"\nREADME first program: {name} = {value}", file=sys.stderr, flush=True)


def test_first_program_trains_the_nodes_to_the_central_accuracy(record_property, capsys):
    """Gossip is what makes this work: every node holds one or two of the 10 classes,
    so nodes that never communicate reach ~0.2 on their own models and 0.80 averaged
    (README), while the centrally trained model reaches 0.855. Bounds: the averaged
    model within 0.02 of the central one, each node's own model above 0.6."""
    namespace = {}
    exec(compile(FIRST, str(README), "exec"), namespace)
    printed = capsys.readouterr().out
    averaged, own = _figures(printed)
    _report(record_property, capsys, "averaged_model_accuracy", averaged)
    _report(record_property, capsys, "own_models_accuracy", own)
    x, y = np.asarray(namespace["x"]), np.asarray(namespace["y"])
    central = _central_accuracy(x, y, namespace["x_test"], namespace["y_test"], 300)
    _report(record_property, capsys, "central_accuracy", central)
    assert averaged >= central - 0.02, printed
    assert own >= 0.6, printed
    # The README quotes these lines: the same digits on this process's devices.
    assert printed == PRINTED, f"README.md shows:\n{PRINTED}the program printed:\n{printed}"


def test_first_program_runs_as_a_script_on_one_device(tmp_path):
    """As a user runs it: a fresh interpreter with a single CPU device (all 8 nodes
    vmapped on it); it prints the lines the README quotes, digit for digit."""
    script = tmp_path / "first.py"
    script.write_text("import jax\nassert jax.device_count() == 1\n" + FIRST)
    env = dict(os.environ, PYTHONPATH=str(ROOT), XLA_FLAGS="")
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == PRINTED, f"README.md shows:\n{PRINTED}the program printed:\n{proc.stdout}"


def _code(page):
    """The page's code as a reader copies it: its fenced blocks, then its inline spans."""
    text = page.read_text()
    blocks = re.findall(r"```[^\n]*\n(.*?)```", text, re.S)
    return blocks + re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))


def _documented(pattern):
    """{match: the pages it is on} of `pattern` in every page's code."""
    found: dict[str, set[str]] = {}
    for page in PAGES:
        for code in _code(page):
            for match in re.findall(pattern, code, re.M):
                found.setdefault(match.strip(), set()).add(_name(page))
    return found


# Every import statement of the pages' code, and every dotted lpdec name (`lpdec.data.
# text_directory(...)`: the name, not the call), and every `python -m lpdec.X` module.
IMPORTS = _documented(r"^\s*(?:import|from)\s+[\w.]+.*$")
NAMES = _documented(r"(?<![\w./-])lpdec(?:\.[A-Za-z_]\w*)+")
MODULES = _documented(r"python3? -m (lpdec[\w.]*)")
# A fresh interpreter that has run `import lpdec` only, as a reader who copied it has:
# each name is looked up attribute by attribute from there (a subpackage lpdec does not
# import is an AttributeError here, as in the reader's program).
_RESOLVE = """
import importlib.util, json, sys
import lpdec
failed = {}
for name in json.loads(sys.argv[1]):
    value = lpdec
    try:
        for part in name.split(".")[1:]:
            value = getattr(value, part)
    except AttributeError as error:
        failed[name] = str(error)
for line in json.loads(sys.argv[2]):
    try:
        exec(line, {})
    except Exception as error:
        failed[line] = repr(error)
for module in json.loads(sys.argv[3]):
    if importlib.util.find_spec(module) is None:
        failed[module] = "no such module"
print(json.dumps(failed))
"""


def test_every_documented_import_and_lpdec_name_works_as_written():
    """README.md's and docs/*.md's code, fenced or inline: each import line runs; each
    `lpdec.a.b` resolves after a plain `import lpdec`; each `python -m lpdec.X` exists."""
    assert "lpdec.data.text_directory" in NAMES and "import lpdec" in IMPORTS
    env = dict(os.environ, PYTHONPATH=str(ROOT), XLA_FLAGS="")
    proc = subprocess.run(
        [sys.executable, "-c", _RESOLVE, json.dumps(sorted(NAMES)), json.dumps(sorted(IMPORTS)),
         json.dumps(sorted(MODULES))],
        env=env, capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    failed = json.loads(proc.stdout.strip().splitlines()[-1])
    where = {**IMPORTS, **NAMES, **MODULES}
    assert not failed, "\n".join(f"{sorted(where[k])}: {k}: {v}" for k, v in failed.items())


# One metrics row written as train.py writes it: from an absl app, by the run's writer.
_WRITE_A_ROW = """
import sys
from absl import app
from train_lib import metrics

def main(argv):
    writer = metrics.MetricWriter(sys.argv[1], 0, 10, fields=("step", "train_loss"))
    writer.write({"step": 3, "train_loss": 1.25})

app.run(main)
"""


def test_the_metrics_line_goes_where_docs_training_md_says(tmp_path):
    """docs/training.md says each metrics row is a line on stderr (absl logging) and
    stdout stays empty: the writer, run as train.py runs it, does that."""
    bullet = re.search(r"^- \*\*Metrics\*\*(.*?)^- ", (ROOT / "docs" / "training.md").read_text(),
                       re.S | re.M)[1]  # fmt: skip
    assert "one line to stderr" in bullet and "stdout stays empty" in bullet, bullet
    env = dict(os.environ, PYTHONPATH=str(ROOT), XLA_FLAGS="")
    proc = subprocess.run(
        [sys.executable, "-c", _WRITE_A_ROW, str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"\] step 3: train_loss=1\.25$", proc.stderr, re.M), proc.stderr[-3000:]
    assert proc.stdout == ""
    assert (tmp_path / "metrics.csv").read_text().splitlines() == ["step,train_loss", "3,1.25"]
