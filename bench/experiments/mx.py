"""Study "mx": MXFP4 (block-scaled E2M1) against 4-bit min-max at equal bytes (issue 26).

Both cost 4.25 bits per value on the wire: MXFP4 sends 4-bit codes and one E8M0
byte per 32 values; min-max sends 4-bit codes and 8 bytes (lo, unit) per chunk,
so chunks of 256 values. Two places the exchange matters: CHOCO's gossip of
compressed model differences, and the DiLoCo exchange of pseudo-gradients (a
compressed mean with error feedback, as Streaming DiLoCo sends FP4 outer
gradients).
"""

# Markdown table rows are long lines by nature.

from __future__ import annotations

from bench.experiments.render import accuracy
from bench.experiments.render import fmt
from bench.experiments.runner import Runner
from bench.experiments.runner import describe_schedule
from bench.experiments.runner import seed002_config

# 4 + 64 / 256 = 4.25 bits per value, as MXFP4's 4 + 8 / 32.
MINMAX4 = dict(compressor="minmax", bits=4, chunk_size=256)
MXFP4 = dict(compressor="mxfp4")
COMPRESSORS = {
    "min-max 4-bit, chunks of 256": MINMAX4,
    "MXFP4": MXFP4,
}
# CHOCO (Quant-SGP) on the directed ring with the gamma the gamma study chose for
# 8-bit codes; skew 0.9, where compression error shows most in Table 2.
CHOCO = dict(topology="directed_ring", algorithm="quant_sgp", gamma=0.3, skew=0.9)
# DiLoCo: 10 local steps, the pseudo-gradients' compressed mean with error feedback.
DILOCO = dict(
    algorithm="diloco",
    local_steps=10,
    exchange="compressed_mean",
    error_feedback=True,
    skew=0.9,
)
# Each setting's rounding: CHOCO's analysis wants an unbiased compressor (stochastic);
# DiLoCo's error feedback carries what nearest rounding loses.
SETTINGS = {
    "CHOCO, directed ring of 8, stochastic rounding": (CHOCO, "stochastic"),
    "DiLoCo H=10, compressed mean + EF, nearest rounding": (DILOCO, "nearest"),
}


def mx_runs(runner: Runner) -> dict:
    """{(setting, compressor): records}, plus each setting's fp32 reference."""
    runs = {}
    for i, (setting, (overrides, rounding)) in enumerate(SETTINGS.items()):
        compressors = list(COMPRESSORS.items())
        if runner.quick:  # CI's smoke test: one compressor per setting, each once
            compressors = compressors[i % len(compressors) :][:1]
        for label, comp in compressors:
            runs[(setting, label)] = runner.repeat(
                "mx",
                f"{setting}, {label}",
                seed002_config,
                rounding=rounding,
                **overrides,
                **comp,
            )
        if runner.quick:  # no reference either
            continue
        reference = dict(overrides, compressor="identity")
        if overrides is DILOCO:
            reference = dict(overrides, exchange="mean", error_feedback=False)
        runs[(setting, "fp32")] = runner.repeat(
            "mx", f"{setting}, fp32", seed002_config, **reference
        )
    return runs


def mx(runner: Runner, docs: str) -> str:
    """MXFP4 against min-max 4-bit at equal bytes, on CHOCO and on the DiLoCo exchange."""
    del docs
    runs = mx_runs(runner)
    columns = [c for c in (*COMPRESSORS, "fp32") if any((s, c) in runs for s in SETTINGS)]
    minmax, mxfp4 = COMPRESSORS
    rows = []
    for setting in SETTINGS:
        got = {c: runs[(setting, c)] for c in columns if (setting, c) in runs}
        cells = [fmt(got[c]) if c in got else "—" for c in columns]
        gap = "—"  # a quick run trains one compressor per setting
        if minmax in got and mxfp4 in got:
            gap = f"{accuracy(got[mxfp4])[0] - accuracy(got[minmax])[0]:+.1f}"
        sent = [f"{got[c][0]['bytes_per_node_per_step']:,.0f}" if c in got else "—" for c in (minmax, mxfp4)]  # fmt: skip
        cells += [gap, " / ".join(sent)]
        rows.append(f"| {setting} | " + " | ".join(cells) + " |")
    header = " | ".join(columns) + " | MXFP4 − min-max (points) | bytes per node per step"
    config = seed002_config(runner.quick)
    seeds = 1 if runner.quick else runner.seeds
    return "\n".join(
        [
            "## MXFP4 against 4-bit min-max at equal bytes",
            "",
            "Seed 002's recipe (MNIST-1D, 8 nodes, "
            f"{describe_schedule(config)}), {config.num_steps} steps, skew 0.9, "
            f"{seeds} seed(s). Both compressors send 4.25 bits per value: MXFP4 (E2M1 "
            "codes, one power-of-two E8M0 scale per 32 values) and min-max with 4-bit codes "
            "and a (lo, unit) float32 pair per 256 values. CHOCO = Quant-SGP on the "
            "directed ring, gamma 0.3 (the gamma study's choice for 8-bit codes); DiLoCo "
            "= 10 local steps, then the compressed mean of the pseudo-gradients with "
            "error feedback (fp32: the exact mean). Test accuracy (%) of the averaged "
            "model, mean ± std over seeds.",
            "",
            f"| setting | {header} |",
            "|---|" + "---|" * (len(columns) + 2),
            *rows,
        ]
    )
