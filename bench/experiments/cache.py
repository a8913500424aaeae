"""The run cache: training records keyed by their config and the code that trained them.

A record is stored under `config_key(config)` with the `code_fingerprint()` of the
code that trained it. The workdir's `results.json` holds every record trained
there; docs/experiments.json publishes the records behind EXPERIMENTS.md, each
with its study and method. Records of other code are stale and never reused.

A dry run's records (`dry_run: True`, placeholder numbers, code "dry run (...)") are
never reused either, and never share an experiments.json with trained runs.
"""

from __future__ import annotations

import ast
import contextlib
import fcntl
import hashlib
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The code whose change invalidates cached runs (bench/ is not part of it: rewriting
# a study's tables keeps its runs).
CODE = ("train.py", "train_lib", "lpdec", os.path.join("configs", "default.py"))
# The studies, in the order docs/experiments.json and EXPERIMENTS.md list them.
STUDIES = (
    "gamma",
    "table2",
    "precision",
    "qgm",
    "moniqua",
    "theorem1",
    "centralized",
    "tradeoff",
    "mx",
    "ad_psgd",
    "lm",
    "scale",
)


DRY_RUN_NOTE = (
    "DRY RUN: no run was trained; every config was checked as train.py checks it "
    "before its first step, and every number is a placeholder derived from its key."
)


def code_fingerprint(root: str = ROOT) -> str:
    """Hash of the training code's syntax trees, without comments and docstrings.

    Editing a comment or a docstring keeps cached runs; any other change to
    train.py, train_lib/, lpdec/ or configs/default.py discards them.
    """
    digest = hashlib.sha256()
    files = []
    for entry in CODE:
        path = os.path.join(root, entry)
        if os.path.isfile(path):
            files.append(path)
        for folder, _, names in sorted(os.walk(path)):
            files += [os.path.join(folder, n) for n in sorted(names) if n.endswith(".py")]
    for path in files:
        tree = ast.parse(open(path).read())
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if (
                isinstance(body, list)
                and body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                node.body = body[1:] or [ast.Pass()]
        digest.update(os.path.relpath(path, root).encode())
        digest.update(ast.dump(tree).encode())
    return digest.hexdigest()[:16]


def config_key(config) -> str:
    """The key a run is cached under: a hash of its whole config."""
    text = json.dumps(config.to_dict(), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def load_results(path: str, code: str | None) -> dict[str, dict]:
    """The records in a workdir's results.json that `code` trained (None: any code; none
    without the file)."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        cached = json.load(f)
    # Runs of other code are stale: drop them; a dry run's placeholders are no runs.
    return {
        k: r for k, r in cached.items() if code in (None, r.get("code")) and not r.get("dry_run")
    }


def save_results(path: str, records: dict[str, dict]) -> None:
    """Adds the records to a workdir's results.json, keeping what other invocations wrote.

    Invocations that train in one workdir at once (`--train-only`) each add their runs:
    the file is read and written under a lock and replaced whole, never half written.
    """
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        merged = {}
        if os.path.exists(path):
            with open(path) as f:
                merged = json.load(f)
        merged.update(records)
        with open(path + ".tmp", "w") as f:
            json.dump(merged, f)
        os.replace(path + ".tmp", path)


@contextlib.contextmanager
def claim(directory: str, key: str):
    """Claims the training of run `key` for this process among the invocations sharing a
    workdir: yields True while this process holds `directory`/<key>.claim locked, False
    when another does (it is training that run now). The lock goes with its holder's
    process however that ends, so a killed invocation leaves no stale claim."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, f"{key}.claim"), "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True


def published_results(path: str, code: str) -> dict[str, dict]:
    """The runs in docs/experiments.json that `code` trained, as cache records.

    A run several studies share is listed once per study; the first listing is kept,
    without the study and method it was listed under.
    """
    records: dict[str, dict] = {}
    with open(path) as f:
        for entry in json.load(f)["runs"]:
            if (
                entry.get("code") == code
                and not entry.get("dry_run")
                and entry.get("key") not in records
            ):
                records[entry["key"]] = {
                    k: v for k, v in entry.items() if k not in ("study", "method")
                }
    return records


def load_published(path: str) -> dict[str, dict]:
    """Every run in docs/experiments.json by key, whatever code trained it (for --render)."""
    with open(path) as f:
        return {e["key"]: e for e in json.load(f)["runs"]}


def published_listings(path: str) -> dict[tuple, set[str]]:
    """(study, method, seed) -> the keys docs/experiments.json lists under it: every
    listing, where `load_published` keeps one per key (a run two studies share is
    listed under both)."""
    with open(path) as f:
        runs = json.load(f)["runs"]
    listings: dict[tuple, set[str]] = {}
    for e in runs:
        if not e.get("dry_run"):
            listings.setdefault((e["study"], e["method"], e["seed"]), set()).add(e["key"])
    return listings


def refuse_trained(path: str) -> None:
    """Exits if the experiments.json at `path` holds trained runs (a dry run's target)."""
    if os.path.exists(path):
        with open(path) as f:
            runs = json.load(f).get("runs", [])
        if any(not e.get("dry_run") for e in runs):
            raise SystemExit(
                f"error: {path} holds trained runs; a dry run writes its placeholders "
                "elsewhere (--output; by default runs/experiments_dry_run/)."
            )


def publish(path: str, code: str, entries: list[dict], studies, dry_run: bool = False) -> None:
    """Replaces the runs of `studies` in docs/experiments.json with `entries` of theirs.

    A dry run's entries (`dry_run`) go only into a file of dry runs: a file holding
    trained runs is an error, and trained runs published over a dry run's file drop
    its placeholders.
    """
    data = {"runs": []}
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
    runs = data.get("runs", [])
    if dry_run:
        refuse_trained(path)
    kept = [e for e in runs if e["study"] not in studies and bool(e.get("dry_run")) == dry_run]
    runs = kept + [e for e in entries if e["study"] in studies]
    data = {
        "description": (
            (DRY_RUN_NOTE + " " if dry_run else "")
            + "Every training run behind EXPERIMENTS.md: study, method, the config fields "
            "that differ from configs/default.py (plus the seed), steps, schedule, final "
            "test accuracy of the node-averaged model, bytes per node, wall-clock seconds "
            "on this machine, the accuracy curve [step, accuracy, train loss], and the "
            "fingerprint of the code that trained it (bench.experiments.code_fingerprint)."
        ),
        "code": code,
        **({"dry_run": True} if dry_run else {}),
        "runs": sorted(runs, key=lambda e: (STUDIES.index(e["study"]), e["method"], e["seed"])),
    }
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
