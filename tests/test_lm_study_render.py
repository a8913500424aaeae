"""The language-model study's headline section, rendered from hand-made records."""

from bench.experiments import lm_tables


def _runs(method, values, machines=2):
    return [
        {
            "method": method,
            "final_val_bits_per_byte": v,
            "diverged": False,
            "config": {"machines": machines, "num_steps": 2000},
            "bytes_per_node_per_step": 1000.0,
            "bytes_by_axis": {"machines": 250.0},
            "seed": seed,
        }
        for seed, v in enumerate(values)
    ]


def test_the_headline_states_the_one_percent_verdict_only_with_three_seeds_each():
    out = {
        "headline allreduce sweep": {"a": _runs("ar, learning_rate=0.002", [2.0])[0]},
        "headline allreduce": _runs("ar", [1.99, 2.00, 2.01]),  # mean 2.00
        "headline diloco 4-bit": _runs("d", [2.00, 2.01, 2.02]),  # +0.50%
        "headline diloco 4-bit 4x2": _runs("d4", [2.03, 2.05], machines=4),  # 2 seeds
    }
    text = "\n".join(lm_tables._headline(out))
    assert "- allreduce sweep: learning_rate=0.002: 2.0000" in text
    assert "| d | 250 | 2.0100 ± 0.0100 (+0.50%) | 2.0000 / 2.0100 / 2.0200 |" in text
    assert "| d4 | 250 | 2.0400 ± 0.0100 (+2.00%) (2 of 3 seeds) | 2.0300 / 2.0500 |" in text
    assert "On 2 machines x 4 workers, DiLoCo" in text and "ends +0.50%" in text
    # Seed by seed: 2.00 / 1.99, 2.01 / 2.00, 2.02 / 2.01.
    assert "of the same seed: +0.50%, +0.50%, +0.50%)" in text
    assert "within issue 41's 1%" in text and "4 machines x 2 workers" not in text

    out["headline diloco 4-bit 4x2"] = _runs("d4", [2.03, 2.05, 2.07], machines=4)  # +2.50%
    text = "\n".join(lm_tables._headline(out))
    assert "On 4 machines x 2 workers, DiLoCo with the 4-bit error-feedback exchange " in text
    assert "ends +2.50% from the tuned all-reduce over 3 seeds: not within" in text

    out["headline allreduce"] = out["headline allreduce"][:2]  # the target not yet tuned
    assert "issue 41's 1%" not in "\n".join(lm_tables._headline(out))


def _keyed(method, values, key):
    runs = _runs(method, values, machines=4)
    for seed, run in enumerate(runs):
        run.update(key=f"{key}{seed}", seed=seed)
    return runs


def test_a_retuned_setting_that_picks_a_listed_row_is_not_listed_twice():
    fix = _keyed("fix H=10", [2.02, 2.04, 2.06], "a")  # mean 2.04
    out = {
        "fix: H=10 on 4": fix,
        "4 machines outer tuned": [dict(r) for r in fix],  # the sweep's winner: the same runs
        "4 machines H=5": _keyed("H=5", [2.01, 2.02, 2.03], "b"),  # mean 2.02
    }
    rows = [line for line in lm_tables._closing(out, 2.0) if line.startswith("| fix H=10")]
    assert len(rows) == 1 and "(+2.00%)" in rows[0]
    assert any(
        line.startswith("| H=5 | 250 | 2.0200 ± 0.0100 (+1.00%)")
        for line in lm_tables._closing(out, 2.0)
    )


def test_the_four_machine_finding_names_the_outer_sweep_and_whether_it_moved():
    sweep = {
        lr: dict(_keyed(f"x, learning_rate=0.008, outer_lr={lr:g}, outer_momentum=0.6", [v], lr)[0])
        for lr, v in ((0.5, 2.30), (0.7, 2.10), (1.0, 2.20))
    }
    out = {
        "wide outer sweep": sweep,
        "4 machines H=5": _keyed("H=5", [2.01, 2.02, 2.03], "b"),
        "4 machines H=10": _keyed("H=10", [2.04], "c"),
        "diloco best": {"learning_rate": 0.008, "outer_lr": 0.7, "outer_momentum": 0.6},
    }
    said = "\n".join(lm_tables._findings(out, 2.0))
    assert "H=5 ends +1.00% over its 3 seeds, H=10 +2.00%" in said
    assert "picks outer_lr=0.7 / outer_momentum=0.6: 2.1000, as on 2 machines; then " in said
    assert (
        "outer_lr=1 / outer_momentum=0.6: 2.2000; outer_lr=0.5 / outer_momentum=0.6: 2.3000" in said
    )
    out["diloco best"]["outer_lr"] = 1.0
    assert "as on 2 machines" not in "\n".join(lm_tables._findings(out, 2.0))
