"""A paper projection from measured bytes: a 1B-parameter model on 8, 64 and 512 machines.

    python -m bench.projection --results /tmp/lm_link/link_results.json

Reads `bench/link.py --workload lm`'s results (2 machines, the config they name),
turns each method's measured link bytes per step into bytes per parameter per
exchange, and projects them to a model of `--params` parameters on M machines
joined by `--rate`:

- mean-based exchanges (the all-reduce, the compressed mean, DiLoCo's mean): a
  reduce-scatter and an all-gather, whose per-machine traffic grows as 2 (M - 1) / M
  from the measured M = 2 (factor 1);
- gossip (CHOCO): a fixed number of neighbours, ring: 2 from M = 3 on, against the
  one neighbour of M = 2.

Each exchange is set against the compute it must hide behind: `--step-s` seconds per
step (our estimate for a GPU machine, stated in the section) times the steps between
exchanges. Writes a section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from bench import _sections

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTION = "bench/projection.py"
RATES = {"10mbit": 10e6, "100mbit": 100e6, "1gbit": 1e9, "10gbit": 10e9}

#: The step-time estimate: a 1B-parameter transformer, 0.5M tokens per machine and step
#: (256 sequences of 2,048), 6 N FLOPs per token, on 8 H100s (989 TFLOP/s dense bf16 each)
#: at 40% model FLOPs utilisation: 3.0e15 / 3.2e15 = 0.95 s.
STEP_S = 6 * 1e9 * 0.5e6 / (8 * 989e12 * 0.4)
STEP_TEXT = (
    "a 1B-parameter transformer trained on 0.5M tokens per machine and step (256 x 2,048), "
    "6 N FLOPs per token, on a machine of 8 H100s (989 TFLOP/s dense bf16 each) at 40% "
    f"model FLOPs utilisation: {STEP_S:.2f} s per step"
)


def measured_parameters(config_path: str) -> int:
    """Parameters of the transformer of the config the bytes were measured on."""
    sys.path.insert(0, ROOT)
    import lpdec
    from bench import link

    fields = dict(link.load_config(config_path).model_kwargs)
    return lpdec.models.transformer_param_count(**fields)


def scale(method: dict, machines: int) -> float:
    """Per-machine traffic at `machines` relative to the measured 2."""
    gossip = method["overrides"].get("algorithm") == "choco" or (
        method["overrides"].get("exchange") == "gossip"
    )
    if gossip:
        return 1.0 if machines == 2 else 2.0
    return 2 * (machines - 1) / machines


def project(results: list[dict], methods: dict, parameters: int, args) -> str:
    rate = RATES[args.rate]
    lines = [
        "| method | bytes per parameter per exchange | steps per exchange | "
        + " | ".join(f"M={m}: s per exchange (x compute)" for m in args.machines)
        + " |",
        "|---|---|---|" + "---|" * len(args.machines),
    ]
    for r in results:
        if "error" in r:
            continue
        # PyTorch DDP all-reduces every step, as the fp32 all-reduce does.
        overrides = methods[r["method"]].overrides if r["method"] in methods else {}
        every = int(overrides.get("local_steps", 1))
        if math.isnan(r["link_bytes_per_step"]):
            lines.append(
                f"| {r['label']} | (link bytes not measured) | {every} |"
                + " |" * len(args.machines)
            )
            continue
        per_param = r["link_bytes_per_step"] * every / parameters
        cells = []
        for m in args.machines:
            seconds = per_param * args.params * scale({"overrides": overrides}, m) * 8 / rate
            cells.append(f"{seconds:,.2f} s ({seconds / (every * args.step_s):.2f}x)")
        lines.append(f"| {r['label']} | {per_param:.3f} | {every} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


#: Bytes a 4-bit min-max payload takes per value: 4 bits, and a float32 lo and hi per
#: block of 256 values (bench/elastic_scale.py's codec, as lpdec's min-max sends it).
ELASTIC_BYTES_PER_VALUE = 0.5 + 8 / 256
ELASTIC_H = 10  # DiLoCo's local steps per round: configs/lm_study.py's tuned H


def elastic_seconds(kind: str, machines: int, payload: float, rate: float) -> float:
    """Seconds the bytes of one elastic round take on links of `rate` bit/s each.

    star: the service's one link carries n payloads in and n (n - 1) out (in and out
    at once: the larger); p2p and a ring all-reduce: every machine sends and receives
    2 (n - 1) / n of a payload."""
    if kind == "star":
        return machines * (machines - 1) * payload * 8 / rate
    return 2 * (machines - 1) / machines * payload * 8 / rate


def elastic_table(measured: dict, args) -> str:
    """The elastic round's exchange at `args.machines`, from the bytes formula, beside
    how far bench/elastic_scale.py's measurement lay above that formula."""
    payload = args.params * ELASTIC_BYTES_PER_VALUE
    rate = RATES[args.rate]
    compute = ELASTIC_H * args.step_s
    results = measured["results"]
    size = measured["args"]["values"] * ELASTIC_BYTES_PER_VALUE
    setting = next((s for s in results if s != "loopback"), None)
    largest = max(results[setting], key=int) if setting else None
    lines = [
        "| exchange | bytes of the busiest link per round | "
        + " | ".join(f"M={m}: s per round (x compute)" for m in args.machines)
        + (
            f" | measured at {largest} machines, {setting}: over the formula |" if largest else " |"
        ),
        "|---|---|" + "---|" * len(args.machines) + ("---|" if largest else ""),
    ]
    names = {
        "star": ("star: through the service (`elastic_transport=\"service\"`, the default)",
                 "n (n - 1) payloads"),
        "p2p": ("peer to peer: reduce-scatter + all-gather (`elastic_transport=\"peers\"`)",
                "2 (n - 1) / n payloads"),
        "ring": ("ring all-reduce of the same bytes (reference)", "2 (n - 1) / n payloads"),
    }  # fmt: skip
    for kind, (name, busiest) in names.items():
        cells = []
        for m in args.machines:
            seconds = elastic_seconds(kind, m, payload, rate)
            cells.append(f"{seconds:,.1f} s ({seconds / compute:.2f}x)")
        ratio = ""
        if largest:
            case = results[setting][largest].get(kind)
            rate_measured = float(setting.removesuffix("mbit")) * 1e6
            formula = elastic_seconds(kind, int(largest), size, rate_measured)
            ratio = f" {case['seconds'] / formula:.2f}x |" if case else " |"
        lines.append(f"| {name} | {busiest} | " + " | ".join(cells) + " |" + ratio)
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", required=True, help="bench/link.py --workload lm's JSON")
    parser.add_argument("--params", type=float, default=1e9)
    parser.add_argument("--machines", default="8,64,512")
    parser.add_argument("--rate", default="1gbit", choices=sorted(RATES))
    parser.add_argument("--step-s", type=float, default=STEP_S, help="compute seconds per step")
    parser.add_argument(
        "--elastic-results",
        default=os.path.join(ROOT, "docs", "elastic_scale_results.json"),
        help='bench/elastic_scale.py\'s JSON ("": no elastic table)',
    )
    parser.add_argument("--output", default=os.path.join(ROOT, "BENCHMARKS.md"))
    args = parser.parse_args(argv)
    args.machines = [int(m) for m in args.machines.split(",")]
    from bench import link

    with open(args.results) as f:
        data = json.load(f)
    results = data["results"].get("2") or data["results"].get(2)
    if results is None:
        parser.error(f"--results={args.results}: no 2-process results to project from")
    parameters = measured_parameters(data["args"]["config"])
    table = project(results, link.LM_METHODS, parameters, args)
    command = "python -m bench.projection " + " ".join(sys.argv[1:] if argv is None else argv)
    body = "\n".join(
        [
            f"## Projection: {args.params:.0e} parameters on {args.machines} machines at "
            f"{args.rate} (`bench/projection.py`)",
            "",
            f"`{command}`",
            "",
            f"From the link bytes `bench/link.py --workload lm` measured between 2 machines on "
            f"`{os.path.relpath(data['args']['config'], ROOT)}` ({parameters:,} parameters, "
            "each machine's model sharded "
            "over its 4 workers): bytes per parameter per exchange, scaled to the model and "
            "the machine count (mean-based exchanges: x 2 (M - 1) / M; gossip on a ring: 2 "
            "neighbours from M = 3). Seconds per exchange on the link, and in parentheses "
            "that time over the compute between two exchanges, with the step-time estimate "
            f"{STEP_TEXT if args.step_s == STEP_S else f'{args.step_s} s per step'}. Below "
            "1x an exchange can hide behind the compute (DiLoCo's overlap, Streaming "
            "DiLoCo); above, the link sets the pace. Latency and TCP overheads are not in it.",
            "",
            table,
        ]
    )
    if args.elastic_results and os.path.exists(args.elastic_results):
        with open(args.elastic_results) as f:
            measured = json.load(f)
        body += "\n".join(
            [
                "",
                "",
                f"### An elastic round's exchange at {args.machines} machines",
                "",
                f"One DiLoCo round of the {args.params:.0e}-parameter model: each machine's "
                "4-bit min-max pseudo-gradient "
                f"({args.params * ELASTIC_BYTES_PER_VALUE / 1e6:,.0f} MB), every machine on "
                f"its own {args.rate} link, against the compute of "
                f"H = {ELASTIC_H} steps at {args.step_s:.2f} s. From the bytes each exchange "
                "puts on its busiest link (the formula: latency, TCP and the service's "
                "decision are not in it); the last column is how far "
                "`bench/elastic_scale.py`'s measured round lay above the same formula on "
                f"its own payload and link (`{os.path.relpath(args.elastic_results, ROOT)}`; "
                "17 processes on 2 CPU cores: the service's decision and the codec's "
                "arithmetic are in the measured time, not in the formula).",
                "",
                elastic_table(measured, args),
            ]
        )
    _sections.replace_section(args.output, SECTION, body, header=_sections.BENCHMARKS_HEADER)
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
